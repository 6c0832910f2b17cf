"""A W pass run under ``torch.inference_mode()`` or ``torch.no_grad()`` delivers what it delivers outside."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

from gradsafe.wgrad import WeightGradStore
from gradsafe.wgrad._hazards import repro_linear

_MODES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
}


@pytest.mark.parametrize("undelayed", [False, True], ids=["delayed only", "with an undelayed use"])
@pytest.mark.parametrize("mode", list(_MODES))
def test_w_run_under_a_grad_mode_leaves_a_grad_later_passes_and_backwards_add_into(
    mode: str, undelayed: bool
) -> None:
    # The first W pass makes .grad; if it were an inference tensor, the next
    # pass (and AccumulateGrad of the undelayed use) could not add into it.
    torch.manual_seed(0)
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    plain = w.detach().clone().requires_grad_()
    xs = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    for i, x in enumerate(xs):
        delayed = repro_linear(x, w, fuse=False, store=store)
        loss = delayed.pow(2).sum()
        (loss + (x @ w.t()).sum() if undelayed else loss).backward()
        pending = store.seal()
        with _MODES[mode]() if i % 2 == 0 else contextlib.nullcontext():
            pending.run()
        want = (x @ plain.t()).pow(2).sum()
        (want + (x @ plain.t()).sum() if undelayed else want).backward()
    assert w.grad is not None and not w.grad.is_inference()
    torch.testing.assert_close(w.grad, plain.grad, rtol=1e-12, atol=1e-12)
