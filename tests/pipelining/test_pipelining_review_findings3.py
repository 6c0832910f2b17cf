"""Findings of a hostile review of 8d02292 (B computes the closed weight side ``K`` of
checkpointed/offloaded ops and custom Functions whole), each a minimal reproduction against a
fused backward (``torch.autograd.backward`` on an identical model) in fp64; the docstring states
its severity. Open ones are strict xfails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import stage_backward_input, stage_backward_weight


@pytest.fixture(autouse=True)
def _fp64():  # type: ignore[no-untyped-def]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class _Scale(torch.autograd.Function):
    """A custom Function weight transform (what a quantizer or weight-norm kernel is)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(w)
        return w * 1.5

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (w,) = ctx.saved_tensors
        return g * 1.5 + 0 * w


def _backward(loss: torch.Tensor, x: torch.Tensor, params: list[nn.Parameter], split: bool) -> list[torch.Tensor | None]:
    if split:
        (dx,), handoff = stage_backward_input(loss, None, [x], params)
        stage_backward_weight(params, handoff)
    else:
        loss.backward()
        dx = x.grad
    return [dx, *(p.grad for p in params)]


def _weight_only_custom_function_in_a_region(split: bool) -> tuple[int, list[torch.Tensor | None]]:
    torch.manual_seed(0)
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    runs = [0]

    def region(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        runs[0] += 1
        return a.sin(), _Scale.apply(b)

    s, ws = checkpoint(region, x, u, use_reentrant=False)
    loss = (s @ ws).pow(2).sum()
    before = runs[0]
    grads = _backward(loss, x, [u], split)
    return runs[0] - before, grads


def test_custom_function_on_the_weight_side_of_a_checkpointed_region_recomputes_once() -> None:
    """Severity: wrong recompute count (and, with dropout and preserve_rng_state=False in the
    region, a different mask for W's unpack).

    One checkpointed region computes ``sin(x)`` (input side, not an intermediate) and a custom
    Function of the parameter ``u`` (weight-only); a plain ``@`` joins them. No intermediate is
    checkpointed, so ``in_b`` is empty, and ``_group_for`` looks for hooked saved tensors only on
    *built-in* weight-only nodes (``not is_python_node(n)``): the custom Function node saved
    ``u`` through the checkpoint's hooks too, but B and W get no ``GraphExecGroup``. B unpacks
    ``sin``'s input (recompute 1), W's engine pass unpacks the Function's (recompute 2). Fused: 1.
    """
    fused_runs, fused = _weight_only_custom_function_in_a_region(split=False)
    split_runs, split = _weight_only_custom_function_in_a_region(split=True)
    for f, s in zip(fused, split):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)
    assert (fused_runs, split_runs) == (1, 1)


def _dropconnect(split: bool) -> list[torch.Tensor | None]:
    torch.manual_seed(0)
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    h = checkpoint(lambda a: F.dropout(a.sin(), 0.5), x, use_reentrant=False, preserve_rng_state=False)
    # A checkpointed weight-only region with dropout (DropConnect-style), created after `h`'s.
    wd = checkpoint(lambda b: F.dropout(b * 1.0, 0.5), u, use_reentrant=False, preserve_rng_state=False)
    loss = (h @ wd).pow(2).sum()
    torch.manual_seed(1)  # the same RNG state at the start of both backwards
    return _backward(loss, x, [u], split)


def test_weight_only_checkpointed_dropout_sees_the_fused_masks() -> None:
    """Severity: silent wrong gradient (dx and u.grad), with preserve_rng_state=False only.

    The docs promise the fused backward's dropout masks also with ``preserve_rng_state=False``.
    Each region does recompute once, but a checkpointed region on the weight-only side outside
    ``K`` recomputes in W's engine pass, after every region B recomputed; a fused backward
    recomputes the regions in its own (sequence-number) order, here the weight-only one first.
    The regions draw their masks from the global RNG in a different order, so both ``dx`` and
    ``u.grad`` differ from the fused backward's.
    """
    fused = _dropconnect(split=False)
    split = _dropconnect(split=True)
    for f, s in zip(fused, split):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)


class _MainGradMatmul(torch.autograd.Function):
    """Megatron-style: ``dW`` is added to ``w.main_grad``, autograd gets None for ``w``."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h, w)
        ctx.weight = w
        return h @ w

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        h, w = ctx.saved_tensors
        ctx.weight.main_grad += h.t() @ g
        return g @ w.t(), None


def test_refused_b_changes_nothing_with_main_grad() -> None:
    """Severity: misleading error (a refused B has already changed ``main_grad``; redoing the
    microbatch as the message suggests, or falling back to ``stage_backward``, counts it twice).

    The donated-buffer refusal is raised from inside B's engine call: every node that ran before
    the compiled block's backward has run, including a Megatron-style custom Function's
    ``main_grad += dW`` (and any hook on ``K``). The message says no parameter gradient has
    changed; ``w.main_grad`` has.
    """
    from gradsafe.pipelining import SplitBackwardError

    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    block = torch.compile(lambda a: torch.tanh(lin(a)) * 2, backend="aot_eager", fullgraph=True)
    w = nn.Parameter(torch.randn(4, 4))
    w.main_grad = torch.zeros(4, 4)  # type: ignore[attr-defined]
    params = [w, *lin.parameters()]

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(3, 4, requires_grad=True)
        return x, _MainGradMatmul.apply(block(x), w).pow(2).sum()

    x, loss = forward()
    loss.backward()  # a fused warm-up step compiles the backward with donated buffers
    for p in params:
        p.grad = None
    w.main_grad.zero_()  # type: ignore[attr-defined]
    x, loss = forward()
    with pytest.raises(SplitBackwardError, match="donated_buffer"):
        stage_backward_input(loss, None, [x], params)
    assert x.grad is None and all(p.grad is None for p in params)
    assert w.main_grad.abs().sum() == 0, "the refused B already added dW to main_grad"  # type: ignore[attr-defined]
