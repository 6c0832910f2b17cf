"""H6: a schedule's first step infers stage metadata by running the stages; gradsafe leaves no trace of it.

Two stages on one gloo rank, 4 microbatches, a loss that backwards inside
itself (torchtitan's chunked loss), against gradient accumulation in one
process (gradsafe.pipelining.schedule._inference_hazards has the model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import stage as stage_module

import gradsafe
from gradsafe.pipelining import MetadataInferenceError
from gradsafe.pipelining.schedule import _inference
from gradsafe.pipelining.schedule import _inference_hazards as _hazards

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


def _schedule_step(
    modules: Sequence[nn.Module],
    loss_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    target: torch.Tensor,
    schedule: str = "ScheduleInterleaved1F1B",
) -> None:
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    runner = getattr(schedules, schedule)(
        stages, n_microbatches=4, loss_fn=loss_fn, scale_grads=False
    )
    try:
        runner.step(x, target=target)
    except RuntimeError as exc:
        if _hazards._SELF_SEND in str(exc):
            pytest.skip("this torch cannot run two stages on one gloo rank")
        raise


def _accumulate(
    modules: Sequence[nn.Module],
    loss_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    target: torch.Tensor,
) -> None:
    for xs, goal in zip(x.chunk(4), target.chunk(4)):
        out = xs
        for module in modules:
            out = module(out)
        loss_fn(out, goal).backward()


def test_a_parameter_the_loss_changes_in_place_is_refused_naming_cause_and_fix(
    world: None,
) -> None:
    modules = _hazards._build(None)
    chunked = _hazards.ChunkedHeadLoss(modules[1].head)

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            modules[1].head.weight.clamp_(-0.1, 0.1)  # weight clipping: not undoable
        return chunked(hidden, target)

    x, target = _hazards._data()
    with gradsafe.patch("pipelining"), pytest.raises(MetadataInferenceError) as raised:
        _schedule_step(modules, loss_fn, x, target)
    message = str(raised.value)
    assert "head.weight" in message and "input_args" in message


def test_an_optimizer_stepped_in_the_loss_finds_no_gradient_from_the_inference(
    world: None,
) -> None:
    modules = _hazards._build(None)
    head = modules[1].head
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    chunked = _hazards.ChunkedHeadLoss(head)
    seen: list[bool] = []

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = chunked(hidden, target)
        seen.append(head.weight.grad is None)
        optimizer.step()  # optimizer-in-loss: skips a parameter without a gradient
        return loss

    x, target = _hazards._data()
    with gradsafe.patch("pipelining"):
        _schedule_step(modules, loss_fn, x, target)
    assert seen == [True] * _RUNS_LOSS + [False] * 4


_NODE_HOOK_KINDS = ["edge_prehook", "edge_posthook", "view_prehook"]


def _accumulator_reducer(
    modules: Sequence[nn.Module], kind: str
) -> tuple[dict[str, torch.Tensor], list[int], list[object]]:
    """A reducer written as AccumulateGrad node hooks (DDP's reducer, Megatron's DDP), its own buffers."""
    reduced: dict[str, torch.Tensor] = {}
    fired = [0]
    keep: list[object] = []  # the accumulator nodes, alive as a reducer keeps them
    for i, module in enumerate(modules):
        for name, param in module.named_parameters():
            key = f"{i}.{name}"
            reduced[key] = torch.zeros_like(param)
            if kind == "view_prehook":
                node = param.view_as(param).grad_fn.next_functions[0][0]
            else:
                node = torch.autograd.graph.get_gradient_edge(param).node
            keep.append(node)

            def add(grad: torch.Tensor, key: str = key) -> None:
                fired[0] += 1
                reduced[key].add_(grad)

            if kind == "edge_posthook":
                # A post hook sees the accumulator's (empty) outputs and its input.
                node.register_hook(lambda grads_in, grads_out, add=add: add(grads_out[0]))
            else:
                node.register_prehook(lambda grads_out, add=add: add(grads_out[0]))
    return reduced, fired, keep


@pytest.mark.parametrize("kind", _NODE_HOOK_KINDS)
@pytest.mark.parametrize("schedule", ["ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"])
def test_accumulator_node_hooks_see_the_microbatches_only(
    schedule: str, kind: str, world: None
) -> None:
    x, target = _hazards._data()
    modules = _hazards._build(None)
    expected, expected_fired, _ = _accumulator_reducer(modules, kind)
    _accumulate(modules, _hazards.ChunkedHeadLoss(modules[1].head), x, target)

    modules = _hazards._build(None)
    reduced, fired, keep = _accumulator_reducer(modules, kind)
    with gradsafe.patch("pipelining"):
        _schedule_step(modules, _hazards.ChunkedHeadLoss(modules[1].head), x, target, schedule)
    assert fired[0] == expected_fired[0] > 0
    for key, value in expected.items():
        assert torch.allclose(reduced[key], value, rtol=1e-12, atol=0), key


def test_backwards_inside_the_inference_leave_parameters_and_their_hooks_alone() -> None:
    from gradsafe.pipelining import _torch

    weight = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    other = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)  # a leaf the inference made
    fired: list[str] = []
    node = torch.autograd.graph.get_gradient_edge(weight).node
    node.register_prehook(lambda g: fired.append("pre"))
    node.register_hook(lambda gi, go: fired.append("post"))
    weight.register_post_accumulate_grad_hook(lambda p: fired.append("accumulated"))
    x = torch.randn(2, 3, dtype=torch.float64)
    with _torch.backwards_spare([weight], keep_graphs=False):
        (x @ weight @ other).square().sum().backward()
        (x @ weight).sum().backward()  # reaches the parameter only: not run
        (x @ weight @ other).sum().backward(inputs=[weight])
    assert weight.grad is None and not fired
    expected = torch.autograd.grad((x @ weight.detach() @ other).square().sum(), other)[0]
    assert torch.equal(other.grad, expected + torch.zeros_like(other))
    (x @ weight).sum().backward()  # outside: as usual
    assert fired == ["pre", "accumulated", "post"] and weight.grad is not None


def test_an_embedding_max_norm_renorms_what_the_microbatches_look_up_only(world: None) -> None:
    """The inference's forward renormalises the rows it looks up; gradsafe puts them back."""
    vocab, dim = 8, 4

    class Lookup(nn.Module):
        # Row 1 is looked up only for a zero input: the inference's, never the step's.
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(dim, dim)
            self.emb = nn.Embedding(vocab, dim, max_norm=1.0)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.lin(h) + self.emb((h.detach()[..., 0] != 0).long() + 1)

    def build() -> list[nn.Module]:
        torch.manual_seed(0)
        first = nn.Sequential(nn.Embedding(vocab, dim, max_norm=1.0), nn.Linear(dim, dim))
        return [first.double(), nn.Sequential(Lookup(), nn.Linear(dim, vocab)).double()]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, vocab), target.reshape(-1))

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (8, 3), generator=gen)
    target = torch.randint(0, vocab, (8, 3), generator=gen)
    expected = build()
    _accumulate(expected, loss_fn, tokens, target)
    got = build()
    with gradsafe.patch("pipelining"):
        _schedule_step(got, loss_fn, tokens, target)
    for (name, want), have in zip(
        [(n, p) for m in expected for n, p in m.named_parameters()],
        [p for m in got for p in m.parameters()],
    ):
        assert torch.equal(have, want), name
        assert torch.allclose(have.grad, want.grad, rtol=1e-12, atol=1e-15), name


def test_a_lazy_module_is_materialised_by_the_inference_as_by_torch(world: None) -> None:
    def build() -> list[nn.Module]:
        torch.manual_seed(0)
        return [
            nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(5)).double(),
            nn.Sequential(nn.Tanh(), nn.LazyLinear(3)).double(),
        ]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).square().mean()

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, dtype=torch.float64, generator=gen)
    target = torch.randn(8, 3, dtype=torch.float64, generator=gen)
    expected = build()
    _accumulate(expected, loss_fn, x, target)
    got = build()
    with gradsafe.patch("pipelining"):
        _schedule_step(got, loss_fn, x, target)
    for want, have in zip(
        [p for m in expected for p in m.parameters()], [p for m in got for p in m.parameters()]
    ):
        assert torch.equal(have, want)
        assert torch.allclose(have.grad, want.grad, rtol=1e-12, atol=1e-15)


def test_a_lazy_buffer_the_inference_would_initialise_is_refused_naming_cause_and_fix(
    world: None,
) -> None:
    modules = [nn.Sequential(nn.Linear(4, 4), nn.LazyBatchNorm1d()).double(), nn.Linear(4, 3)]
    modules[1].double()
    x, target = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    with gradsafe.patch("pipelining"), pytest.raises(MetadataInferenceError) as raised:
        _schedule_step(modules, lambda out, t: (out - t).square().mean(), x, target)
    message = str(raised.value)
    assert "running_mean" in message and "initialise lazy modules" in message


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

    def counting(
        cls: type, modules: list[nn.Module], keep_graphs: bool
    ) -> _inference.InferenceSnapshot:
        taken.append(len(modules))
        return original(cls, modules, keep_graphs)

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
