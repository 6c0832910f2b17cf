"""CaptureOrder derived from torch.distributed.pipelining schedules (hazard H5)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from torch.distributed.pipelining import schedules

from gradsafe.cuda_graphs._capture_order_hazards import te_count_check
from gradsafe.cuda_graphs.capture_order import (
    CaptureEntry,
    CaptureOrder,
    CaptureOrderError,
    EntryKind,
    Rule,
    _no_loss,
    _PlaceholderStage,
)

F, D, W = CaptureEntry.forward, CaptureEntry.dgrad, CaptureEntry.wgrad

ZERO_BUBBLE = [schedules.ScheduleZBVZeroBubble, schedules.ScheduleInterleavedZeroBubble]


def compute_actions(schedule_cls: type, rank: int, ranks: int, microbatches: int) -> list[str]:
    """The rank's compute actions as strings, read independently from ``pipeline_order``."""
    stages = [_PlaceholderStage(k * ranks, 2 * ranks, ranks) for k in range(2)]
    schedule = schedule_cls(stages, n_microbatches=microbatches, loss_fn=_no_loss)
    return [str(a) for a in schedule.pipeline_order[rank] if a is not None]


def expected_stages(schedule_cls: type, rank: int, ranks: int) -> tuple[int, int]:
    if schedule_cls is schedules.ScheduleZBVZeroBubble:
        return (
            rank,
            2 * ranks - 1 - rank,
        )  # the "V": a rank holds the first and the mirrored stage
    return (rank, rank + ranks)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule_cls", ZERO_BUBBLE, ids=lambda c: c.__name__)
def test_zero_bubble_orders(schedule_cls: type, ranks: int) -> None:
    microbatches = 2 * ranks
    for rank in range(ranks):
        order = CaptureOrder.from_schedule_class(
            schedule_cls, rank=rank, ranks=ranks, microbatches=microbatches
        )
        assert order.stage_indices == expected_stages(schedule_cls, rank, ranks)
        assert order.delayed_wgrad_chunks == frozenset({0, 1})
        for chunk in (0, 1):
            assert order.microbatches(chunk) == tuple(range(microbatches))
        assert len(order) == 2 * 3 * microbatches
        # Entry by entry, the compute actions of the schedule's own list (I -> dgrad, W -> wgrad).
        letter = {EntryKind.FORWARD: "F", EntryKind.DGRAD: "I", EntryKind.WGRAD: "W"}
        derived = [f"{order.stage_indices[e.chunk]}{letter[e.kind]}{e.microbatch}" for e in order]
        assert derived == compute_actions(schedule_cls, rank, ranks, microbatches)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule_cls", ZERO_BUBBLE, ids=lambda c: c.__name__)
def test_zero_bubble_orders_and_transformer_engine(schedule_cls: type, ranks: int) -> None:
    # Rank 0 keeps every W before its chunk's next I; the other ranks delay some W further,
    # which TransformerEngine's list cannot say (it matches W to the chunk's latest dgrad).
    for rank in range(ranks):
        order = CaptureOrder.from_schedule_class(
            schedule_cls, rank=rank, ranks=ranks, microbatches=2 * ranks
        )
        if rank == 0:
            te = order.to_te_order()
            assert te_count_check(te.order) is None
            assert CaptureOrder.from_te_order(te.order, strict=True).entries == order.entries
        else:
            with pytest.raises(CaptureOrderError) as info:
                order.to_te_order()
            assert info.value.rule is Rule.WGRAD_BEFORE_NEXT_DGRAD
            with pytest.raises(CaptureOrderError):
                CaptureOrder.from_schedule_class(
                    schedule_cls, rank=rank, ranks=ranks, microbatches=2 * ranks, strict=True
                )


def test_zbv_rank0_of_2_order() -> None:
    order = CaptureOrder.from_schedule_class(
        schedule_cls=schedules.ScheduleZBVZeroBubble, rank=0, ranks=2, microbatches=4
    )
    assert order.to_te_order().order[:12] == (1, 1, 1, 2, -2, -2.5, 2, -2, -2.5, 1, -1, -1.5)


def test_interleaved_1f1b_has_no_wgrad_entries() -> None:
    order = CaptureOrder.from_schedule_class(
        schedules.ScheduleInterleaved1F1B, rank=1, ranks=2, microbatches=4
    )
    assert order.delayed_wgrad_chunks == frozenset()
    assert {e.kind for e in order} == {EntryKind.FORWARD, EntryKind.DGRAD}
    assert CaptureOrder.from_te_order(order.to_te_order().order).entries == order.entries


def test_dual_pipe_v_overlap_actions_are_expanded() -> None:
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV")
    order = CaptureOrder.from_schedule_class(
        schedules.ScheduleDualPipeV, rank=0, ranks=2, microbatches=4
    )
    # (0F3;3B1)OVERLAP_F_B: the forward, then stage 3's full backward as dgrad + wgrad.
    assert order.entries[7:10] == (F(0, 3), D(1, 1), W(1, 1))


def test_full_backward_on_delayed_and_plain_stages() -> None:
    delayed = CaptureOrder.from_actions(["0F0", "0I0", "0W0", "0F1", "0B1"])
    assert delayed.entries == (F(0, 0), D(0, 0), W(0, 0), F(0, 1), D(0, 1), W(0, 1))
    plain = CaptureOrder.from_actions(["1F0", None, "1SEND_F0", "1B0"])
    assert plain.entries == (F(0, 0), D(0, 0))
    assert plain.stage_indices == (1,)


def test_actions_and_their_strings_agree() -> None:
    actions = [schedules._Action.from_str(s) for s in ["0F0", "2F0", "2I0", "2W0", "0B0"]]
    assert CaptureOrder.from_actions(actions) == CaptureOrder.from_actions(
        ["0F0", "2F0", "2I0", "2W0", "0B0"]
    )


def test_schedule_missing_its_w_is_refused() -> None:
    with pytest.raises(CaptureOrderError) as info:
        CaptureOrder.from_actions(["0F0", "0F1", "0I0", "0W0", "0I1"])
    assert (info.value.rule, info.value.position) == (Rule.ONE_WGRAD_PER_DGRAD, 4)


def test_schedule_1f1b_last_rank_description_is_refused() -> None:
    # Schedule1F1B.pipeline_order[last rank] on torch 2.10-2.15 (2 ranks, 4 microbatches): its
    # steady state starts at F1, so F0 is missing and F4 is out of range. 1F1B runs a fixed loop,
    # not this list; an order derived from it would be wrong, and is refused.
    listed = ["1F1", "1B0", "1F2", "1B1", "1F3", "1B2", "1F4", "1B3", "1REDUCE_GRAD"]
    with pytest.raises(CaptureOrderError) as info:
        CaptureOrder.from_actions(listed)
    assert (info.value.rule, info.value.position) == (Rule.FORWARD_BEFORE_DGRAD, 1)


def test_from_schedule_errors() -> None:
    with pytest.raises(TypeError, match="no per-rank action list"):
        CaptureOrder.from_schedule(object(), 0)
    with pytest.raises(ValueError, match="rank 5"):
        CaptureOrder.from_schedule_class(
            schedules.ScheduleZBVZeroBubble, rank=5, ranks=2, microbatches=4
        )


_REAL_STAGES = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from gradsafe.cuda_graphs.capture_order import CaptureOrder

    ranks, rank = 2, 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
    try:
        for cls, stage_ids in (
            (schedules.ScheduleZBVZeroBubble, (rank, 2 * ranks - 1 - rank)),
            (schedules.ScheduleInterleavedZeroBubble, (rank, rank + ranks)),
        ):
            stages = [
                PipelineStage(torch.nn.Linear(4, 4), i, 2 * ranks, torch.device("cpu"))
                for i in stage_ids
            ]
            real = CaptureOrder.from_schedule(cls(stages, 4, loss_fn=lambda y, t: y.sum()), rank)
            planned = CaptureOrder.from_schedule_class(cls, rank=rank, ranks=ranks, microbatches=4)
            print(cls.__name__, real == planned, len(real))
    finally:
        dist.destroy_process_group()
    """
)


def test_placeholder_stages_give_the_real_schedules_order() -> None:
    # Real PipelineStages on torch's fake process group, in a subprocess (process-global group).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, "-c", _REAL_STAGES],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [
        "ScheduleZBVZeroBubble", "True", "24",
        "ScheduleInterleavedZeroBubble", "True", "24",
    ]  # fmt: skip
