"""B and W under the caller's grad-mode contexts give a fused backward's gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight

CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "plain": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


@pytest.mark.parametrize("b_context", list(CONTEXTS))
@pytest.mark.parametrize("w_context", list(CONTEXTS))
def test_split_under_contexts_equals_fused(b_context: str, w_context: str) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    m(x).backward(g)
    want = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]  # type: ignore[union-attr]
    m.zero_grad(set_to_none=True)
    x.grad = None

    out = m(x)
    with CONTEXTS[b_context]():
        (dx,), handoff = stage_backward_input([out], [g], [x], list(m.parameters()))
    with CONTEXTS[w_context]():
        stage_backward_weight(list(m.parameters()), handoff)
    got = [p.grad for p in m.parameters()] + [dx]
    for a, b in zip(got, want):
        assert a is not None
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("fp64")
def test_flop_counter_mode_around_a_split_stage() -> None:
    """FlopCounterMode around B and W: B refuses with SplitBackwardError before anything runs, or runs exact.

    ``torch.utils.module_tracker.ModuleTracker`` (used by ``FlopCounterMode``, a common way to
    measure MFU) registers ``register_multi_grad_hook(module inputs, mode="all")``; for the first
    module that is the leaf stage input, which B's ``autograd.grad(inputs=...)`` captures, and
    torch's engine raises "A leaf node was passed to _will_engine_execute_node" from inside such
    a call (torch's own split fails the same way; a fused backward works). Any mode-"all"
    multi-grad hook over a leaf stage input alone is the same case.
    """
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    params = list(seq.parameters())
    with FlopCounterMode(display=False) as fused_counter:
        seq(x).backward(g)  # autograd.grad would hit the same torch error
    want = [t.grad for t in (x, *params)]
    for t in (x, *params):
        t.grad = None
    with FlopCounterMode(display=False) as counter:
        out = seq(x)
        try:
            _, handoff = stage_backward_input([out], [g], [x], params)
        except SplitBackwardError:
            assert x.grad is None and all(p.grad is None for p in params)
            return
        stage_backward_weight(params, handoff)
    for got, ref in zip([x.grad, *(p.grad for p in params)], want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert counter.get_total_flops() == fused_counter.get_total_flops()
