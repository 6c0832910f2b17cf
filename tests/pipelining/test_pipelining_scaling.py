"""H7: a parameter several stages of one rank share is divided once at the end of a step, as in a fused backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsafe
from gradsafe.pipelining.schedule._one_rank import one_rank_world
from gradsafe.pipelining.schedule._scaling_hazards import (
    shared_weight_scaled_once,
    tied_stages_reference,
    tied_stages_scaled,
    tied_stages_step,
)

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke

MULTI_STAGE = (
    "ScheduleZBVZeroBubble",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleDualPipeV",
)


def _worst(got: dict, want: dict) -> float:
    return max(float((got[k] - v).abs().max()) for k, v in want.items())


def test_upstream_divides_a_tied_weight_once_per_stage() -> None:
    outcome = shared_weight_scaled_once()
    assert outcome.correct is False
    assert "0.25x" in outcome.detail


def test_the_step_end_divides_a_tied_weight_once_under_the_patch() -> None:
    with gradsafe.patch("pipelining"):
        assert shared_weight_scaled_once().correct is True
        with one_rank_world():
            got = tied_stages_scaled()
    assert _worst(got, tied_stages_reference()) < 1e-14


def _step(schedule: str) -> dict:
    try:
        with one_rank_world():
            return tied_stages_step(schedule)
    except RuntimeError as exc:
        if "Pair is not connected" in str(exc) or "state_ >= CONNECTED" in str(exc):
            pytest.skip("this torch cannot run two stages on one gloo rank")
        raise


@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_a_real_step_with_tied_stages_equals_the_fused_backward(schedule: str) -> None:
    reference = tied_stages_reference()
    assert _worst(_step(schedule), reference) > 1e-3  # upstream: the last stage divides mid-step
    with gradsafe.patch("pipelining"):
        got = _step(schedule)
    assert _worst(got, reference) < 1e-14


def test_a_schedule_built_before_the_patch_is_covered_from_its_next_step() -> None:
    from torch.distributed.pipelining import PipelineStage, schedules

    from gradsafe.pipelining.schedule import _scaling_hazards as h

    reference = tied_stages_reference()
    model = h._stages()
    ids, target = h._data()
    try:
        with one_rank_world():
            cpu = torch.device("cpu")
            stages = [PipelineStage(model.first, 0, 2, cpu), PipelineStage(model.last, 1, 2, cpu)]
            runner = schedules.ScheduleZBVZeroBubble(stages, n_microbatches=4, loss_fn=h._loss)
            with gradsafe.patch("pipelining"):
                runner.step(ids.reshape(-1, 5), target=target.reshape(-1, 5))
    except RuntimeError as exc:
        if "state_ >= CONNECTED" in str(exc) or "Pair is not connected" in str(exc):
            pytest.skip("this torch cannot run two stages on one gloo rank")
        raise
    assert _worst(model.grads(), reference) < 1e-14


def test_a_parameter_of_one_stage_is_divided_each_time_its_stage_asks() -> None:
    from torch.distributed.pipelining import PipelineStage

    lin = nn.Linear(2, 2)
    with gradsafe.patch("pipelining"), one_rank_world():
        stage = PipelineStage(lin, 0, 1, torch.device("cpu"))
        lin.weight.grad = torch.full((2, 2), 8.0)
        stage.scale_grads(2)
        stage.scale_grads(2)  # as upstream: a second call divides again
    assert torch.equal(lin.weight.grad, torch.full((2, 2), 2.0))


def test_unpatch_restores_torchs_scaling() -> None:
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    before = (
        vars(stage._PipelineStageBase)["scale_grads"],
        schedules.PipelineScheduleMulti.__init__,
    )
    with gradsafe.patch("pipelining"):
        assert vars(stage._PipelineStageBase)["scale_grads"] is not before[0]
    assert (
        vars(stage._PipelineStageBase)["scale_grads"],
        schedules.PipelineScheduleMulti.__init__,
    ) == before


def test_a_stage_never_registered_is_divided_as_torch_does_after_the_registered_ones_died() -> None:
    import gc

    from gradsafe.pipelining.schedule._scaling import SharedParameters

    class Stage:
        def __init__(self, submod: nn.Module) -> None:
            self.submod = submod

    table = nn.Parameter(torch.ones(2))
    shared = SharedParameters()
    first, last = Stage(nn.ParameterList([table])), Stage(nn.ParameterList([table]))
    shared.register([first, last])
    assert not shared.divide_now(table, last)  # waits for the first stage
    del first, last
    gc.collect()
    assert shared.divide_now(table, Stage(nn.ParameterList([table])))


def test_a_stage_reused_where_its_weight_is_no_longer_shared_divides_it_when_it_asks() -> None:
    # A schedule over [first, tied] records the table as shared; a rebuilt one
    # over [first, untied] (the old stages still alive) must not leave `first`
    # waiting for `tied`, which it never runs: the table would not be divided
    # (n_microbatches x too large; 0.702 max abs error in a real step, 4 microbatches).
    from gradsafe.pipelining.schedule._scaling import SharedParameters

    class Stage:
        def __init__(self, submod: nn.Module) -> None:
            self.submod = submod

    table, own = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    shared = SharedParameters()
    first, tied = Stage(nn.ParameterList([table])), Stage(nn.ParameterList([table]))
    untied = Stage(nn.ParameterList([own]))
    shared.register([first, tied])
    shared.register([first, untied])
    assert shared.divide_now(table, first)
    assert shared.divide_now(own, untied)
    assert tied is not None  # alive throughout
