"""Where W's gradients go: never into a tensor an unfused closure returned (it may be one another
closure of the same pass still reads), and only into the parameter itself (a view recorded in its
place is refused)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradsafe.wgrad import WeightGradStore, wgrad_return
from gradsafe.wgrad._hazards import repro_linear


class _ScaleShift(torch.autograd.Function):
    """``x * scale + shift`` for ``scale`` and ``shift`` of ``x``'s shape, weight gradients delayed.

    ``shift``'s weight gradient is the incoming gradient itself, which its closure returns as is.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, store: WeightGradStore
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale, ctx.shift, ctx.store = scale, shift, store
        return x * scale + shift

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        store: WeightGradStore = ctx.store
        store.record(ctx.shift, lambda _: g, accumulate_into_main_grad=False, reads=(g,))
        store.record(ctx.scale, lambda _: g * x, accumulate_into_main_grad=False, reads=(g, x))
        slots = [
            wgrad_return(p, None, accumulate_into_main_grad=False, delayed=True)
            for p in (ctx.scale, ctx.shift)
        ]
        return g * ctx.scale, *slots, None


def test_a_tied_weight_whose_closure_returns_grad_out_leaves_other_closures_reads_intact() -> None:
    # shift is tied across two uses; summing them into the first use's tensor wrote
    # into that use's grad_out, which scale_2's closure then read (2.38 off, silently).
    torch.manual_seed(0)
    shape = (3, 4)
    scale_1, scale_2, shift = (
        torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for _ in range(3)
    )
    x_1, x_2, c_1, c_2 = (torch.randn(shape, dtype=torch.float64) for _ in range(4))
    store = WeightGradStore()
    y_1 = _ScaleShift.apply(x_1, scale_1, shift, store)
    y_2 = _ScaleShift.apply(x_2, scale_2, shift, store)
    ((y_1 * c_1).sum() + (y_2 * c_2).sum()).backward()
    store.seal().run()
    plain = [p.detach().clone().requires_grad_() for p in (scale_1, scale_2, shift)]
    ((x_1 * plain[0] + plain[2]) * c_1 + (x_2 * plain[1] + plain[2]) * c_2).sum().backward()
    for delayed, want in zip((scale_1, scale_2, shift), plain):
        torch.testing.assert_close(delayed.grad, want.grad, rtol=1e-12, atol=1e-12)


def test_a_hook_zeroing_grad_in_place_leaves_a_later_closures_read_intact() -> None:
    # shift's closure returns grad_out, which became shift's .grad as is; a grad-ready
    # hook that zeroes .grad in place (zero_grad(set_to_none=False) after an optimizer
    # step in W) then zeroed what scale's closure read next (1.2 off, silently).
    torch.manual_seed(0)
    shape = (3, 4)
    scale, shift = (torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for _ in range(2))
    x, c = (torch.randn(shape, dtype=torch.float64) for _ in range(2))
    store = WeightGradStore()
    consumed: dict[int, torch.Tensor] = {}

    def step_then_zero(p: torch.Tensor) -> None:
        consumed[id(p)] = p.grad.clone()
        p.grad.zero_()

    for p in (scale, shift):
        store.register_grad_ready_hook(p, step_then_zero)
    (_ScaleShift.apply(x, scale, shift, store) * c).sum().backward()
    store.seal().run()
    plain = [p.detach().clone().requires_grad_() for p in (scale, shift)]
    ((x * plain[0] + plain[1]) * c).sum().backward()
    for delayed, want in zip((scale, shift), plain):
        torch.testing.assert_close(consumed[id(delayed)], want.grad, rtol=1e-12, atol=1e-12)


def test_recording_a_view_of_the_parameter_is_refused_in_b() -> None:
    # A tied weight passed as weight.t(): W put the gradient in the view's .grad
    # and the parameter's stayed None, silently (a non-leaf .grad warning only).
    weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    store = WeightGradStore()
    out = repro_linear(torch.randn(3, 4, dtype=torch.float64), weight.t(), fuse=False, store=store)
    with pytest.raises(ValueError, match=r"not a leaf but the output of TBackward0"):
        out.pow(2).sum().backward()
