"""``verify(work=True)`` flags a split whose W share is under half the uncheckpointed stage's.

The reference is measured: one extra run of gradsafe's split with
``torch.utils.checkpoint``'s call-time globals replaced, so every region runs
plainly, whatever wrapper captured ``checkpoint`` (torch's ``checkpoint_wrapper``
here, as torchtitan's does).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from _factories import _batches
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from gradsafe.pipelining import CheckpointedWeights, checkpointed_weights
from gradsafe.verify import _run, _uncheckpointed, verify
from gradsafe.verify._report import VerifyReport, WorkShare

ORDER = "w-after-b"


def _stage(wrap: CheckpointImpl | None) -> nn.Module:
    """Two MLP blocks, each wrapped with torch's checkpoint_wrapper (``wrap``) or not."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(2)]
    if wrap is not None:
        blocks = [checkpoint_wrapper(b, checkpoint_impl=wrap) for b in blocks]
    return nn.Sequential(*blocks)


def _verified(wrap: CheckpointImpl | None, policy: CheckpointedWeights) -> VerifyReport:
    with checkpointed_weights(policy):
        return verify(_stage(wrap), _batches(), orders=(ORDER,), work=True)


def _ours(report: VerifyReport, impl: str = "gradsafe") -> WorkShare:
    assert report.work is not None
    (share,) = report.work[impl]["fused" if impl == "fused" else ORDER]
    return share


def _globals() -> dict[str, Any]:
    return {n: getattr(torch_checkpoint, n) for n in _uncheckpointed.globals_to_replace()}


def test_a_checkpointed_stage_whose_weight_work_runs_in_b_is_flagged() -> None:
    report = _verified(CheckpointImpl.NO_REENTRANT, CheckpointedWeights.IN_B)
    ours = _ours(report)
    assert ours.w_share == 0.0 and ours.uncheckpointed_w_share == 0.5 and ours.w_share_low
    text = str(report)
    assert re.search(r"gradsafe +w-after-b +0 +\d+ +0 +\d+ +1\.00 +0\.000 LOW", text), text
    assert "gradsafe's default IN_W runs checkpointed ones in W" in text, text
    data = report.to_json()
    assert data["work"]["gradsafe"][ORDER][0]["w_share_low"] is True
    assert data["work"]["gradsafe"][ORDER][0]["uncheckpointed_w_share"] == 0.5


def test_under_in_w_the_checkpointed_stage_is_not_flagged() -> None:
    report = _verified(CheckpointImpl.NO_REENTRANT, CheckpointedWeights.IN_W)
    ours = _ours(report)
    assert ours.w_share == pytest.approx(0.4) and not ours.w_share_low
    assert ours.uncheckpointed_w_share == 0.5
    assert " LOW " not in str(report)


def test_an_uncheckpointed_stage_is_not_flagged() -> None:
    report = _verified(None, CheckpointedWeights.IN_B)
    for impl in ("gradsafe", "upstream"):
        share = _ours(report, impl)
        assert share.uncheckpointed_w_share == share.w_share == 0.5 and not share.w_share_low


def test_the_reference_is_the_uncheckpointed_models_measured_w_share() -> None:
    plain = _ours(_verified(None, CheckpointedWeights.IN_B))
    report = _verified(CheckpointImpl.NO_REENTRANT, CheckpointedWeights.IN_B)
    reference = _ours(report, "uncheckpointed")
    assert reference.recomputed == 0  # every checkpointed region ran plainly
    assert (reference.b_flops, reference.w_flops) == (plain.b_flops, plain.w_flops)
    assert _ours(report).uncheckpointed_w_share == plain.w_share


def test_reentrant_checkpoint_is_turned_off_too() -> None:
    plain = _ours(_verified(None, CheckpointedWeights.IN_B))
    report = _verified(CheckpointImpl.REENTRANT, CheckpointedWeights.IN_B)
    assert _ours(report, "fused").recomputed > 0  # the regions are checkpointed
    reference = _ours(report, "uncheckpointed")
    assert reference.recomputed == 0
    assert (reference.b_flops, reference.w_flops) == (plain.b_flops, plain.w_flops)


def test_checkpoints_globals_are_restored_after_verify() -> None:
    before = _globals()
    _verified(CheckpointImpl.NO_REENTRANT, CheckpointedWeights.IN_B)
    assert _globals() == before


def test_checkpoints_globals_are_restored_when_the_uncheckpointed_run_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _globals()
    real_run = _run.run

    def run_raising_without_checkpoints(*args: Any, **kwargs: Any) -> Any:
        if _globals() != before:
            raise RuntimeError("stopped inside the run without checkpoints")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(_run, "run", run_raising_without_checkpoints)
    with pytest.raises(RuntimeError, match="without checkpoints"):
        _verified(CheckpointImpl.NO_REENTRANT, CheckpointedWeights.IN_B)
    assert _globals() == before


def test_a_torch_whose_checkpoint_calls_other_names_leaves_the_reference_unmeasured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch_checkpoint.checkpoint

    def checkpoint_elsewhere(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_checkpoint, "checkpoint", checkpoint_elsewhere)
    _uncheckpointed.globals_to_replace.cache_clear()
    try:
        report = _verified(None, CheckpointedWeights.IN_B)
    finally:
        _uncheckpointed.globals_to_replace.cache_clear()
    ours = _ours(report)
    assert ours.uncheckpointed_w_share is None and not ours.w_share_low
    assert "cannot run the stage without its checkpoints" in ours.not_measured
    assert "Uncheckpointed share not measured: torch.utils.checkpoint.checkpoint" in str(report)


def test_concurrent_verifies_leave_checkpoint_restored_and_other_threads_checkpointing() -> None:
    """Two verifies on two threads whose runs without checkpointing overlap, the first to enter
    leaving first: before, the second put back the first's replacements on leaving, and
    ``checkpoint`` stayed turned off in the whole process. Meanwhile a checkpoint called on a
    third thread still recomputes."""
    import threading

    before = _globals()
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    recomputed: list[int] = []

    def other_thread_checkpoints() -> None:
        calls: list[int] = []
        x = torch.ones(2, requires_grad=True)
        out = torch_checkpoint.checkpoint(
            lambda t: (calls.append(1), t.sin())[1], x, use_reentrant=False
        )
        out.sum().backward()
        recomputed.append(len(calls) - 1)

    def progress_a(line: str) -> None:
        if "checkpointing off" in line:
            a_in.set()
            assert b_in.wait(120)
            checker = threading.Thread(target=other_thread_checkpoints)
            checker.start()
            checker.join(120)

    def progress_b(line: str) -> None:
        if "checkpointing off" in line:
            b_in.set()
            assert a_done.wait(120)

    def run(progress: Any, after: Any) -> None:
        verify(
            _stage(CheckpointImpl.NO_REENTRANT),
            _batches(),
            orders=(ORDER,),
            work=True,
            progress=progress,
        )
        after()

    first = threading.Thread(target=run, args=(progress_a, a_done.set))
    second = threading.Thread(target=run, args=(progress_b, lambda: None))
    first.start()
    assert a_in.wait(120)
    second.start()
    first.join(240)
    second.join(240)
    assert _globals() == before
    assert recomputed == [1]
