"""B and W under the caller's grad-mode contexts give a fused backward's gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradsafe.pipelining import stage_backward_input, stage_backward_weight

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
