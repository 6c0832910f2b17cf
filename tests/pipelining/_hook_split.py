"""One microbatch through a forward with two parameters and hooks, fused or split, compared.

Shared by the hook test files: the parameters' and input's gradients and what
the hooks recorded must equal a fused backward's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradsafe.pipelining import stage_backward_input, stage_backward_weight

Forward = Callable[[nn.Parameter, nn.Parameter, torch.Tensor, list[Any]], torch.Tensor]


def run(forward: Forward, split: bool) -> list[Any]:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    calls: list[Any] = []
    out = forward(w, u, x, calls)
    if split:
        _, handoff = stage_backward_input([out], [g], [x], [w, u])
        stage_backward_weight([w, u], handoff)
    else:
        out.backward(g)
    return [x.grad, w.grad, u.grad, calls]


def assert_same(forward: Forward) -> None:
    fused = run(forward, split=False)
    split = run(forward, split=True)
    assert len(split[3]) == len(fused[3]), (
        f"hook calls: fused {len(fused[3])}, split {len(split[3])}"
    )
    for f, s in zip(fused[:3], split[:3]):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)
    for f, s in zip(fused[3], split[3]):
        for ft, st in zip(f, s):
            assert (ft is None) == (st is None), (
                "a hook saw None where a fused backward gives a gradient"
            )
            if ft is not None:
                torch.testing.assert_close(st, ft, rtol=0, atol=1e-12)


class PassThrough(torch.autograd.Function):
    """``x + w`` whose backward hands one tensor to both: B runs it whole and keeps ``w``'s for W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x + w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad
