"""A guarded Megatron-style DDP sees gradsafe's own split: a B whose W has not run is outstanding (issue 36, items 2-3).

``guard_ddp_step`` refuses the reduction and ``zero_grad_buffer()`` while a
pipelining hand-off of the model's parameters is pending, as it does for a
``WeightGradStore`` pass; a hand-off dropped or failed counts as lost until
the step is abandoned. Delayed work on parameters with a ``main_grad`` that
no guard covers warns once.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import gradsafe._shared.pending_w as pending_w
from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight
from gradsafe.testing import MegatronStyleDDP
from gradsafe.wgrad import UnguardedDDPWarning, WeightGradStore, guard_ddp_step


@pytest.fixture
def warn_again() -> Iterator[None]:
    # The warning is once per process: let each test see it.
    pending_w._warned = False
    yield
    pending_w._warned = False


def _stage() -> tuple[nn.Module, MegatronStyleDDP]:
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnguardedDDPWarning)
        ddp = MegatronStyleDDP(stage, grad_reduce_in_fp32=True)
    return stage, ddp


def _b(stage: nn.Module):  # type: ignore[no-untyped-def]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = stage(x)
    return stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())[1]


def test_the_reduction_and_zero_grad_buffer_refuse_while_a_pipelining_w_is_outstanding() -> None:
    stage, ddp = _stage()
    guard = guard_ddp_step(ddp)
    try:
        handoff = _b(stage)
        before = [p.main_grad.clone() for p in stage.parameters()]  # type: ignore[union-attr]
        for call in (ddp.finish_grad_sync, ddp.start_grad_sync, ddp.zero_grad_buffer):
            with pytest.raises(RuntimeError, match="pipelining B.*stage_backward_weight"):
                call()
        assert all(torch.equal(b, p.main_grad) for b, p in zip(before, stage.parameters()))  # type: ignore[arg-type]
        stage_backward_weight(stage.parameters(), handoff)
        ddp.finish_grad_sync()  # W ran: the reduction goes through, with the last weight's gradient
        assert stage[2].weight.main_grad.abs().sum() > 0  # type: ignore[union-attr]
        ddp.zero_grad_buffer()
    finally:
        guard.remove()


@pytest.mark.parametrize("how", ["dropped", "failed"])
def test_a_lost_pipelining_w_is_refused_at_the_reduction_until_the_step_is_abandoned(
    how: str,
) -> None:
    stage, ddp = _stage()
    guard = guard_ddp_step(ddp)
    try:
        handoff = _b(stage)
        if how == "dropped":
            del handoff
            gc.collect()
        else:
            with pytest.raises(SplitBackwardError):
                stage_backward_weight([], handoff)  # no weights: refused, the hand-off FAILED
        with pytest.raises(RuntimeError, match="will deliver nothing"):
            ddp.finish_grad_sync()
        # Abandon the step as the refusal says: nothing outstanding to run, so zeroing goes through.
        stage.zero_grad(set_to_none=True)
        ddp.zero_grad_buffer()
        stage_backward_weight(stage.parameters(), _b(stage))
        ddp.finish_grad_sync()
    finally:
        guard.remove()


def test_another_models_pipelining_w_does_not_block_this_ones_reduction() -> None:
    stage, ddp = _stage()
    other, _ = _stage()
    guard = guard_ddp_step(ddp)
    try:
        handoff = _b(other)
        ddp.finish_grad_sync()
        stage_backward_weight(other.parameters(), handoff)
    finally:
        guard.remove()


def test_a_pipelining_b_on_an_unguarded_megatron_ddp_warns_once(warn_again: None) -> None:
    stage, ddp = _stage()
    with pytest.warns(UnguardedDDPWarning, match="guard_ddp_step"):
        handoff = _b(stage)
    stage_backward_weight(stage.parameters(), handoff)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnguardedDDPWarning)
        stage_backward_weight(stage.parameters(), _b(stage))  # once per process


def test_a_guarded_ddp_or_no_main_grad_does_not_warn(warn_again: None) -> None:
    stage, ddp = _stage()
    guard = guard_ddp_step(ddp)
    plain = nn.Linear(4, 4).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnguardedDDPWarning)
        stage_backward_weight(stage.parameters(), _b(stage))
        stage_backward_weight(plain.parameters(), _b(plain))
    guard.remove()
    with pytest.warns(UnguardedDDPWarning):  # the guard removed: no longer covered
        stage_backward_weight(stage.parameters(), _b(stage))


def test_a_weight_grad_store_record_on_an_unguarded_megatron_ddp_warns_once(
    warn_again: None,
) -> None:
    weight = nn.Parameter(torch.ones(3))
    weight.main_grad = torch.zeros(3)  # type: ignore[attr-defined]  # as Megatron's DDP gives it
    store = WeightGradStore()
    with pytest.warns(UnguardedDDPWarning, match="WeightGradStore.record"):
        store.record(weight, lambda _: torch.ones(3), accumulate_into_main_grad=False)
    store.seal().run()
