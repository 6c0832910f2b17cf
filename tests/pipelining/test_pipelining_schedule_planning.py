"""Every schedule class torch ships builds and plans its action order under the patch exactly as without it.

Schedule planners (and torch's own test_schedule) build schedules from stages
without a module (``submod`` None) only to read ``pipeline_order``: the patch
must neither fail there nor change the plan, for every class the installed
torch's ``schedules`` module defines, single- and multi-stage alike.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

import gradsafe


class _PlanningStage(_PipelineStageBase):
    """A stage with no module and no communication, as torch's schedule tests mock one."""

    def __init__(self, num_stages: int, group_size: int) -> None:  # no super(): nothing to run
        self.submod = None
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.group = None

    def _create_grad_recv_info(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _prepare_forward_infra(self, n_microbatches: int) -> None:
        pass

    def _prepare_backward_infra(self, n_microbatches: int) -> None:
        pass


SCHEDULE_CLASSES = sorted(
    (
        cls
        for _, cls in inspect.getmembers(schedules, inspect.isclass)
        if issubclass(cls, schedules._PipelineSchedule) and not inspect.isabstract(cls)
    ),
    key=lambda cls: cls.__name__,
)

# (stages on this rank, microbatches, ranks): one stage, the V schedules' two,
# odd counts, and microbatches that do not divide by the ranks (some classes refuse).
LAYOUTS = [(1, 4, 2), (2, 4, 2), (2, 8, 4), (2, 3, 4), (3, 6, 3), (4, 8, 4)]


def _plan(cls: type, local: int, microbatches: int, ranks: int) -> tuple[str, object]:
    """What building ``cls`` gives: its action orders, or the exception it raises."""
    stages: Any = [_PlanningStage(local * ranks, ranks) for _ in range(local)]
    if issubclass(cls, schedules.PipelineScheduleSingle):
        stages = stages[0]
    try:
        schedule = cls(stages, microbatches)
    except Exception as exc:  # noqa: BLE001 -- the exception itself is the outcome compared
        return "raised", (type(exc), str(exc))
    return "planned", (
        getattr(schedule, "pipeline_order", None),
        getattr(schedule, "pipeline_order_with_comms", None),
    )


def test_every_schedule_class_of_this_torch_is_checked() -> None:
    names = {cls.__name__ for cls in SCHEDULE_CLASSES}
    assert {
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
    } <= names


@pytest.mark.parametrize(
    ("cls", "layout"),
    [
        pytest.param(cls, layout, id=f"{cls.__name__}-{'x'.join(map(str, layout))}")
        for cls in SCHEDULE_CLASSES
        for layout in LAYOUTS
        # A single-stage schedule takes one stage.
        if layout[0] == 1 or not issubclass(cls, schedules.PipelineScheduleSingle)
    ],
)
def test_schedule_without_a_module_plans_the_same_action_order_under_the_patch(
    cls: type, layout: tuple[int, int, int]
) -> None:
    upstream = _plan(cls, *layout)
    with gradsafe.patch():
        patched = _plan(cls, *layout)
    assert patched == upstream
