"""H6: a schedule's first step infers stage metadata by running the stages; gradsafe leaves no trace of it.

Two stages on one gloo rank, 4 microbatches, a loss that backwards inside
itself (torchtitan's chunked loss), against gradient accumulation in one
process (gradsafe.pipelining._hazards has the model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import stage as stage_module

import gradsafe
from gradsafe.pipelining import MetadataInferenceError, _hazards, _inference

pytestmark = pytest.mark.distributed

SCHEDULES = [
    "ScheduleZBVZeroBubble",
    "ScheduleInterleavedZeroBubble",
    "ScheduleDualPipeV",
    "ScheduleInterleaved1F1B",
]
# torch 2.13+ runs the loss_fn in its inference; 2.11 only forwards, under no_grad.
_RUNS_LOSS = hasattr(stage_module.PipelineStage, "_backward_metadata_inference")


@pytest.fixture
def world() -> Iterator[None]:
    with _hazards.one_rank_world():
        yield


def _step(schedule: str, inner: Callable[[], nn.Module] | None = None) -> _hazards.PipelineRun:
    stages = 1 if schedule == "Schedule1F1B" else 2
    try:
        return _hazards.pipeline_step(schedule, inner, stages)
    except RuntimeError as exc:
        if _hazards._SELF_SEND in str(exc):
            pytest.skip(
                "this torch sends between two stages of one rank over gloo, which gloo refuses"
            )
        raise


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradsafe_step_equals_accumulation_where_upstream_counts_the_inference_loss(
    schedule: str, world: None
) -> None:
    reference = _hazards.accumulation_reference()
    with gradsafe.patch("pipelining"):
        run = _step(schedule)
    assert _hazards.worst_relative_error(run, reference)[1] <= 1e-12
    assert run.hook_firings == reference.hook_firings
    assert run.loss_calls == reference.loss_calls + _RUNS_LOSS  # the inference's call is torch's
    if _RUNS_LOSS:
        upstream = _step(schedule)
        error = _hazards.worst_relative_error(upstream, reference)[1]
        # The garbage inputs differ run to run (zeros give the head no gradient,
        # but the hooks still fire for the inference's backward).
        assert error > 1e-6 or upstream.hook_firings != reference.hook_firings


# Schedule1F1B: one stage holding both blocks (runs on every torch, 2.11's
# forward-only inference included).
@pytest.mark.parametrize(
    "schedule", ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"]
)
def test_batchnorm_statistics_count_the_microbatches_only(schedule: str, world: None) -> None:
    def norm() -> nn.Module:
        return nn.BatchNorm1d(4).double()

    reference = _hazards.accumulation_reference(norm)
    with gradsafe.patch("pipelining"):
        run = _step(schedule, norm)
    assert run.buffers.keys() == reference.buffers.keys() and run.buffers
    for name, expected in reference.buffers.items():
        assert torch.equal(run.buffers[name], expected), name
    assert _hazards.worst_relative_error(run, reference)[1] <= 1e-12


# Schedule1F1B: one stage holding both blocks (runs on every torch, 2.11's
# forward-only inference included).
@pytest.mark.parametrize(
    "schedule", ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"]
)
def test_dropout_draws_the_masks_of_the_microbatches_only(schedule: str, world: None) -> None:
    def dropout() -> nn.Module:
        return nn.Dropout(0.5)

    reference = _hazards.accumulation_reference(dropout)
    after_reference = torch.get_rng_state()
    with gradsafe.patch("pipelining"):
        run = _step(schedule, dropout)
    assert torch.equal(torch.get_rng_state(), after_reference)
    assert _hazards.worst_relative_error(run, reference)[1] <= 1e-12


def _hooked_step(
    step: Callable[[list[nn.Module]], None],
) -> tuple[dict[str, int], list[bool], dict[str, torch.Tensor]]:
    """Existing .grad tensors and every kind of gradient hook on both stages; what ``step`` did to them."""
    modules = list(_hazards._build(None))
    counts = {"tensor": 0, "module": 0, "module_pre": 0}
    originals = {}
    for i, module in enumerate(modules):
        for name, param in module.named_parameters():
            param.grad = torch.ones_like(param)
            originals[f"{i}.{name}"] = param.grad
            param.register_hook(lambda g: counts.__setitem__("tensor", counts["tensor"] + 1))
        module.register_full_backward_hook(
            lambda *a: counts.__setitem__("module", counts["module"] + 1)
        )
        module.register_full_backward_pre_hook(
            lambda *a: counts.__setitem__("module_pre", counts["module_pre"] + 1)
        )
    step(modules)
    params = {f"{i}.{n}": p for i, m in enumerate(modules) for n, p in m.named_parameters()}
    kept = [params[name].grad is grad for name, grad in originals.items()]
    return counts, kept, {name: p.grad for name, p in params.items()}


def test_existing_grads_and_every_gradient_hook_see_the_microbatches_only(world: None) -> None:
    from torch.distributed.pipelining import PipelineStage, schedules

    def accumulate(modules: list[nn.Module]) -> None:
        loss = _hazards.ChunkedHeadLoss(modules[1].head)
        x, target = _hazards._data()
        for xs, goal in zip(x.chunk(4), target.chunk(4)):
            loss(modules[1](modules[0](xs)), goal).backward()
        with torch.no_grad():
            for module in modules:
                for param in module.parameters():
                    param.grad /= 4

    def pipeline(modules: list[nn.Module]) -> None:
        stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
        loss = _hazards.ChunkedHeadLoss(modules[1].head)
        runner = schedules.ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=loss)
        x, target = _hazards._data()
        try:
            runner.step(x, target=target)
        except RuntimeError as exc:
            if _hazards._SELF_SEND in str(exc):
                pytest.skip("this torch cannot run two stages on one gloo rank")
            raise

    expected_counts, _, expected = _hooked_step(accumulate)
    with gradsafe.patch("pipelining"):
        counts, kept, grads = _hooked_step(pipeline)
    assert counts == expected_counts and all(expected_counts.values())
    assert all(kept)  # the caller's .grad tensors, accumulated into in place
    for name, grad in expected.items():
        assert torch.allclose(grads[name], grad, rtol=1e-12, atol=0), name


def test_a_loss_that_steps_an_optimizer_is_refused_naming_cause_and_fix(world: None) -> None:
    from torch.distributed.pipelining import PipelineStage, schedules

    modules = _hazards._build(None)
    optimizer = torch.optim.SGD(modules[1].head.parameters(), lr=0.1)
    chunked = _hazards.ChunkedHeadLoss(modules[1].head)

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = chunked(hidden, target)
        optimizer.step()  # optimizer-in-loss: the inference's update cannot be undone
        return loss

    stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    runner = schedules.ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=loss_fn)
    x, target = _hazards._data()
    with gradsafe.patch("pipelining"):
        try:
            runner.step(x, target=target)
        except MetadataInferenceError as exc:
            message = str(exc)
        except RuntimeError as exc:
            if _hazards._SELF_SEND in str(exc):
                pytest.skip("this torch cannot run two stages on one gloo rank")
            raise
        else:
            pytest.fail("an optimizer step inside the inference's loss_fn went unreported")
    assert "head.weight" in message and "optimizer" in message and "input_args" in message


def test_main_grad_written_by_the_loss_is_put_back(world: None) -> None:
    """A Megatron/TE-style ``main_grad`` accumulated directly (no hook) by the loss."""

    def run(step: Callable[[list[nn.Module], Callable[..., torch.Tensor]], None]) -> torch.Tensor:
        modules = list(_hazards._build(None))
        head = modules[1].head
        head.weight.main_grad = torch.zeros_like(head.weight)  # type: ignore[attr-defined]
        chunked = _hazards.ChunkedHeadLoss(head)

        def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = chunked(hidden, target)
            with torch.no_grad():
                head.weight.main_grad.add_(hidden.detach().sum())  # type: ignore[attr-defined]
            return loss

        step(modules, loss_fn)
        return head.weight.main_grad.clone()  # type: ignore[attr-defined]

    def accumulate(modules: list[nn.Module], loss_fn: Callable[..., torch.Tensor]) -> None:
        x, target = _hazards._data()
        for xs, goal in zip(x.chunk(4), target.chunk(4)):
            loss_fn(modules[1](modules[0](xs)), goal).backward()

    def pipeline(modules: list[nn.Module], loss_fn: Callable[..., torch.Tensor]) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
        runner = schedules.ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=loss_fn)
        x, target = _hazards._data()
        try:
            runner.step(x, target=target)
        except RuntimeError as exc:
            if _hazards._SELF_SEND in str(exc):
                pytest.skip("this torch cannot run two stages on one gloo rank")
            raise

    expected = run(accumulate)
    with gradsafe.patch("pipelining"):
        assert torch.equal(run(pipeline), expected)


def test_later_steps_take_no_snapshot(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = []
    original = _inference.InferenceSnapshot.take.__func__  # type: ignore[attr-defined]

    def counting(cls: type, modules: list[nn.Module]) -> _inference.InferenceSnapshot:
        taken.append(len(modules))
        return original(cls, modules)

    monkeypatch.setattr(_inference.InferenceSnapshot, "take", classmethod(counting))
    from torch.distributed.pipelining import PipelineStage, schedules

    modules = _hazards._build(None)
    stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    runner = schedules.ScheduleInterleaved1F1B(
        stages, n_microbatches=4, loss_fn=_hazards.ChunkedHeadLoss(modules[1].head)
    )
    x, target = _hazards._data()
    with gradsafe.patch("pipelining"):
        for _ in range(3):
            try:
                runner.step(x, target=target)
            except RuntimeError as exc:
                if _hazards._SELF_SEND in str(exc):
                    pytest.skip("this torch cannot run two stages on one gloo rank")
                raise
    assert taken == [2]  # once, over both stages, on the first step
