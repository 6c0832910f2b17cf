"""gradsafe.wgrad kernels (fused or delayed weight gradients) inside a gradsafe.pipelining split backward.

A custom autograd.Function on the input side runs its backward once per
microbatch, in B, which keeps its weight-side results for W: a fused wgrad GEMM
into ``main_grad`` or a ``WeightGradStore.record`` happens once, as in a fused
backward (found by review when it happened twice).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import MegatronStyleDDP, module_of
from gradsafe.wgrad import WeightGradStore
from gradsafe.wgrad._hazards import repro_linear
from gradsafe.wgrad.markers import mark_delayed_wgrad

pytestmark = pytest.mark.usefixtures("fp64")


@pytest.mark.parametrize("fuse, delayed", [(True, False), (False, True), (True, True)])
def test_fused_or_delayed_wgrad_kernel_in_a_split_stage_counts_once(
    fuse: bool, delayed: bool
) -> None:
    """Was: main_grad exactly 2x the reference. A two-layer stage
    built from a wgrad_return kernel (fused into main_grad, or delayed through WeightGradStore)
    under MegatronStyleDDP, run with gradsafe's stage_backward_input + stage_backward_weight
    (what gradsafe.patch("pipelining") gives a zero-bubble schedule): the kernel's backward runs in
    B and again in W, so the fused GEMM adds into main_grad twice / the store records every use
    twice. Neither docs/wgrad.md nor docs/pipelining.md warns about combining the two."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    want = torch.autograd.grad(torch.tanh(x @ w.t()) @ w.t(), w, g)[0]

    store = WeightGradStore() if delayed else None
    if delayed:
        mark_delayed_wgrad(w)
    ddp = MegatronStyleDDP(module_of([w], store), delay_wgrad_compute=delayed)
    out = repro_linear(
        torch.tanh(repro_linear(x, w, fuse=fuse, store=store)), w, fuse=fuse, store=store
    )
    _, handoff = stage_backward_input([out], [g], [x], [w])
    stage_backward_weight([w], handoff)
    if store is not None:
        store.seal().run()
    torch.testing.assert_close(w.main_grad, want)  # type: ignore[attr-defined]
    assert len(ddp.calls(w)) == 1


class _CountingMatmul(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        _CountingMatmul.calls += 1
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


def test_custom_function_backward_runs_once_per_microbatch() -> None:
    """An input-side custom Function's backward runs once per microbatch with B + W, as in a fused backward.

    Running it again in W would repeat its side effects and double custom kernels' dgrad cost.
    """
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    _CountingMatmul.calls = 0
    out = _CountingMatmul.apply(torch.tanh(_CountingMatmul.apply(x, w)), w)
    _, handoff = stage_backward_input([out], [torch.ones(3, 4)], [x], [w])
    stage_backward_weight([w], handoff)
    assert _CountingMatmul.calls == 2  # two uses, each once, as in a fused backward
