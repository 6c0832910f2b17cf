"""FSDP2: B and W find the parameters autograd saw, whichever of sharded/unsharded the caller passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ranks import rendezvous, worker_env

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.distributed


def test_sharded_in_b_unsharded_in_w_exact_and_stray_parameter_named(tmp_path: Path) -> None:
    out = tmp_path / "found.pt"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_pipelining_fsdp_worker.py"), rendezvous(tmp_path), str(out)],
        env=worker_env(),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-3000:]
    found = torch.load(out, weights_only=False)
    assert found["B sees"] == "DTensor" and found["W sees"] != "DTensor", found
    assert found["max error"] < 1e-12, found
    assert "leaf tensor" not in found["stray"] and "parameter of shape (4, 4)" in found["stray"], (
        found
    )
    # A forward between B and W reshards: W refuses instead of reading freed memory.
    assert "storage has been freed since B" in found["resharded before W"], found
    # RECOMPUTE_IN_W: a re-gather between B and W keeps W exact; an optimizer step
    # on the sharded parameters before it is refused (W would recompute with it).
    assert isinstance(found["recompute in W, step=False"], float), found
    assert found["recompute in W, step=False"] < 1e-12, found
    assert "modified in place after B" in found["recompute in W, step=True"], found


def test_checkpointed_fsdp2_stages_under_zero_bubble_schedules_exact_or_refused(
    tmp_path: Path,
) -> None:
    """Every CheckpointedWeights policy, ``reshard_after_forward`` on and off, fully_shard per
    block and per stage, under ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble: the
    fused schedule's gradients bitwise. A hand-written B/W loop that leaves FSDP2's gradient
    sync on (its backward hook reduces in B, before W's gradients exist) is refused in B: with
    IN_B it once gave every parameter a wrong gradient silently."""
    out = tmp_path / "found.pt"
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "_pipelining_fsdp_checkpoint_worker.py"),
            rendezvous(tmp_path),
            str(out),
        ],
        env=worker_env(),
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-3000:]
    found = torch.load(out, weights_only=False)
    crash = str(found.pop("crash", ""))
    if "Pair is not connected" in crash:
        pytest.skip(f"this torch cannot run two stages on one gloo rank: {crash[:200]}")
    assert not crash, crash
    hand_written = {k: v for k, v in found.items() if k.startswith("hand-written")}
    schedules = {k: v for k, v in found.items() if k not in hand_written}
    assert len(schedules) == 12 and len(hand_written) == 3, found
    assert all(v == 0.0 for v in schedules.values()), schedules
    for case, answer in hand_written.items():
        assert "requires_gradient_sync is on" in answer and "No gradient has changed" in answer, (
            case,
            answer,
        )
