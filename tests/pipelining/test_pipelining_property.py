"""Property: on random DAGs over stage inputs and shared parameters, B then W equals a fused backward.

A program is a list of ops over two pools: activations (shape 3x4, start with
the stage inputs) and weight-only values (shape 4x4, start with the
parameters). Parameters are used several times, at nested sites, through
multi-output ops (split/chunk), and in parameter-only branches that may feed
activations or be stage outputs themselves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

ACT_OPS = (
    "matmul",
    "linear",
    "tanh_mul",
    "add",
    "split_swap",
    "chunk_mix",
    "bias_add",
    "matmul_derived",
    "lstm",
)
WEIGHT_OPS = ("tanh", "matmul", "transpose_scale")


@st.composite
def programs(draw: Any) -> tuple[int, list[bool], list[tuple[Any, ...]], list[tuple[str, int]]]:
    n_inputs = draw(st.integers(1, 2))
    requires = [draw(st.booleans()) or i == 0 and draw(st.booleans()) for i in range(n_inputs)]
    n_act, n_weight = n_inputs, 2  # two 4x4 parameters start the weight pool
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(2, 9))):
        if draw(st.integers(0, 3)) == 0:
            op = draw(st.sampled_from(WEIGHT_OPS))
            ops.append(
                ("w", op, draw(st.integers(0, n_weight - 1)), draw(st.integers(0, n_weight - 1)))
            )
            n_weight += 1
        else:
            op = draw(st.sampled_from(ACT_OPS))
            a = draw(st.integers(0, n_act - 1))
            b = draw(st.integers(0, n_act - 1))
            w = draw(st.integers(0, n_weight - 1))
            ops.append(("a", op, a, b, w))
            n_act += 1
    outputs = [("a", draw(st.integers(0, n_act - 1))) for _ in range(draw(st.integers(1, 3)))]
    if draw(st.booleans()):
        outputs.append(("w", draw(st.integers(2, n_weight - 1)) if n_weight > 2 else 0))
    return n_inputs, requires, ops, outputs


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w0 = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.w1 = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.b = nn.Parameter(torch.randn(4) * 0.5)
        self.lin = nn.Linear(4, 4)
        self.lstm = nn.LSTM(4, 4)


def _run(
    m: Shared, ops: list[tuple[Any, ...]], outputs: list[tuple[str, int]], *xs: torch.Tensor
) -> list[torch.Tensor]:
    acts: list[torch.Tensor] = list(xs)
    weights: list[torch.Tensor] = [m.w0, m.w1]
    for op in ops:
        if op[0] == "w":
            _, kind, i, j = op
            if kind == "tanh":
                weights.append(torch.tanh(weights[i]))
            elif kind == "matmul":
                weights.append(weights[i] @ weights[j] * 0.5)
            else:
                weights.append(weights[i].t() * 0.7)
            continue
        _, kind, a, b, w = op
        x, y, p = acts[a], acts[b], weights[w]
        if kind == "matmul":
            acts.append(x @ p)
        elif kind == "linear":
            acts.append(torch.tanh(m.lin(x)))
        elif kind == "tanh_mul":
            acts.append(torch.tanh(x) * (y @ m.w0))
        elif kind == "add":
            acts.append(x + y + m.b)
        elif kind == "split_swap":
            left, right = (x @ p).split(2, dim=1)
            acts.append(torch.cat([right * m.b[:2], left], dim=1))
        elif kind == "chunk_mix":
            top, bottom = p.chunk(2, dim=0)
            acts.append(torch.cat([x[:, :2] @ top, x[:, 2:] @ bottom], dim=1)[:, :4] + y)
        elif kind == "lstm":  # multi-output: out, h_n and c_n all used
            out, (h, c) = m.lstm(x.unsqueeze(1), (y[:1].unsqueeze(0), torch.zeros(1, 1, 4)))
            acts.append(out.squeeze(1) + h[0] * c[0])
        elif kind == "bias_add":
            acts.append(x * torch.sigmoid(m.b) + p.sum(0))
        else:
            acts.append(F.linear(x, p, m.lin.bias))
    return [acts[i] if pool == "a" else weights[i] for pool, i in outputs]


# split_checker is a pure function: nothing to reset between examples.
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(program=programs(), as_loss=st.booleans())
def test_random_dags_split_equals_fused(program: Any, as_loss: bool, split_checker: Any) -> None:
    n_inputs, requires, ops, outputs = program

    def make():  # type: ignore[no-untyped-def]
        m = Shared()
        xs = [torch.randn(3, 4, requires_grad=r) for r in requires]
        if as_loss:
            return m, xs, lambda *xs: [sum(o.pow(2).sum() for o in _run(m, ops, outputs, *xs))]
        return m, xs, lambda *xs: _run(m, ops, outputs, *xs)

    torch.set_default_dtype(torch.float64)
    split_checker(make, loss=as_loss)
