"""gradsafe.cuda_graphs.make_graphed_split_callables against an eager split backward and a fused backward.

Every behaviour test runs in an ``emulated`` mode (CPU, ``emulate_cuda_graphs``)
and a ``cuda`` mode (a real GPU, skipped without one). Gradients are fp64 and
compared to 1e-9 against (a) plain ``Tensor.backward`` per microbatch and (b)
gradsafe's eager ``stage_backward_input`` / ``stage_backward_weight`` run in
the same order on a copy of the modules.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch.distributed.pipelining.schedules import (
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from gradsafe.cuda_graphs.capture_order import CaptureEntry, CaptureOrder, EntryKind
from gradsafe.cuda_graphs.split_stages import (
    GraphedSplitStages,
    ReplayOrderError,
    SplitStageState,
    make_graphed_split_callables,
)
from gradsafe.pipelining import stage_backward, stage_backward_input, stage_backward_weight
from gradsafe.wgrad import WeightGradStore

D = torch.float64
TOL = 1e-9
WIDTH = 6
ROWS = 5


@dataclasses.dataclass(frozen=True)
class Env:
    device: torch.device


@pytest.fixture
def env(graph_device: torch.device) -> Env:
    return Env(graph_device)


class Nested(torch.nn.Module):
    """A Linear reused at nested sites, ``h @ w @ w``, and a parameter-only second output (H1 cases)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH, dtype=D)
        self.w = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=D) / WIDTH)
        self.prefix = torch.nn.Parameter(torch.randn(WIDTH, dtype=D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(x))
        h = torch.tanh(self.lin(h @ self.w @ self.w))
        return h + self.prefix, self.prefix * 2.0


class TiedNorm(torch.nn.Module):
    """A weight used on both sides of a LayerNorm (tied embedding/head: overlapping W traversals)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=D) / WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x @ self.w.t()) @ self.w


class _MatmulFn(torch.autograd.Function):
    """``x @ w`` as a custom Function: W drives it through the engine, not by a direct call."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return (
            g @ w.t() if ctx.needs_input_grad[0] else None,
            x.t() @ g if ctx.needs_input_grad[1] else None,
        )


class CustomFunction(torch.nn.Module):
    """A custom autograd.Function using one weight at two nested sites."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=D) / WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MatmulFn.apply(torch.tanh(_MatmulFn.apply(x, self.w)), self.w)


MODELS = {"nested": Nested, "tied-norm": TiedNorm, "custom-function": CustomFunction}

ORDERS = {
    "zbv-2ranks-rank0": lambda: CaptureOrder.from_schedule_class(
        ScheduleZBVZeroBubble, rank=0, ranks=2, microbatches=4
    ),
    "zbv-2ranks-rank1": lambda: CaptureOrder.from_schedule_class(
        ScheduleZBVZeroBubble, rank=1, ranks=2, microbatches=4
    ),
    "interleaved-zb-2ranks-rank1": lambda: CaptureOrder.from_schedule_class(
        ScheduleInterleavedZeroBubble, rank=1, ranks=2, microbatches=4
    ),
}


def _outputs(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


class Run:
    """One rank's step data: inputs and output gradients per (chunk, microbatch, step)."""

    def __init__(
        self, env: Env, order: CaptureOrder, model: type[torch.nn.Module], steps: int
    ) -> None:
        self.env, self.order, self.steps = env, order, steps
        self.modules = [model().to(env.device) for _ in order.chunks]
        self.sample_out = [
            _outputs(m(torch.zeros(ROWS, WIDTH, dtype=D, device=env.device))) for m in self.modules
        ]
        self.x: dict[tuple[int, int, int], torch.Tensor] = {}
        self.g: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        for s in range(steps):
            for c in order.chunks:
                for m in order.microbatches(c):
                    self.x[(s, c, m)] = torch.randn(ROWS, WIDTH, dtype=D, device=env.device)
                    self.g[(s, c, m)] = [torch.randn_like(o) for o in self.sample_out[c]]

    def sample_args(self) -> list[tuple[torch.Tensor, ...]]:
        return [
            (torch.randn(ROWS, WIDTH, dtype=D, device=self.env.device, requires_grad=True),)
            for _ in self.order.chunks
        ]

    def fused(
        self, modules: list[torch.nn.Module], step: int
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Plain autograd: one backward per microbatch; returns input gradients."""
        dx = {}
        for c in self.order.chunks:
            for m in self.order.microbatches(c):
                x = self.x[(step, c, m)].clone().requires_grad_()
                torch.autograd.backward(_outputs(modules[c](x)), self.g[(step, c, m)])
                dx[(c, m)] = x.grad
        return dx

    def eager_split(
        self, modules: list[torch.nn.Module], step: int
    ) -> dict[tuple[int, int], torch.Tensor]:
        """gradsafe's eager split backward, in the order's sequence."""
        held: dict[tuple[int, int], Any] = {}
        dx = {}
        for e in self.order:
            key = (e.chunk, e.microbatch)
            params = list(modules[e.chunk].parameters())
            if e.kind is EntryKind.FORWARD:
                x = self.x[(step, *key)].clone().requires_grad_()
                held[key] = (x, _outputs(modules[e.chunk](x)))
            elif e.kind is EntryKind.DGRAD:
                x, outs = held[key]
                dinputs, handoff = stage_backward_input(outs, self.g[(step, *key)], [x], params)
                dx[key] = dinputs[0]
                held[key] = handoff
            else:
                stage_backward_weight(params, held.pop(key))
        return dx

    def graphed(
        self, stages: GraphedSplitStages, step: int, dgrad: str = "grad"
    ) -> dict[tuple[int, int], torch.Tensor]:
        held: dict[tuple[int, int], Any] = {}
        dx = {}
        for e in self.order:
            key = (e.chunk, e.microbatch)
            if e.kind is EntryKind.FORWARD:
                x = self.x[(step, *key)].clone().requires_grad_()
                held[key] = (x, _outputs(stages.callables[e.chunk](x)))
            elif e.kind is EntryKind.DGRAD:
                x, outs = held.pop(key)
                if dgrad == "grad":
                    dx[key] = torch.autograd.grad(outs, [x], self.g[(step, *key)])[0]
                else:
                    torch.autograd.backward(outs, self.g[(step, *key)])
                    dx[key] = x.grad
            else:
                stages.backward_weight(e.chunk)
        return dx


def _assert_close(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert got is not None and want is not None, what
    assert torch.allclose(got, want, atol=TOL, rtol=0), (
        f"{what}: max diff {(got - want).abs().max()}"
    )


def _assert_param_grads(a: list[torch.nn.Module], b: list[torch.nn.Module], what: str) -> None:
    for c, (ma, mb) in enumerate(zip(a, b)):
        for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
            _assert_close(p.grad, q.grad, f"{what}: chunk {c} {name}")


class HookCounter:
    """Tensor, post-accumulate and AccumulateGrad-node hooks on every parameter, counted; tensor-hook grads kept."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.tensor: dict[int, int] = {}
        self.post: dict[int, int] = {}
        self.node: dict[int, int] = {}
        self.kept: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # (kept gradient, its value when seen)
        self.params = [p for m in modules for p in m.parameters()]
        for p in self.params:
            key = id(p)
            p.register_hook(lambda g, key=key: self._tensor(key, g))
            p.register_post_accumulate_grad_hook(lambda _, key=key: self._count(self.post, key))
            accumulator = p.view_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            accumulator.register_hook(lambda *_, key=key: self._count(self.node, key))

    def _count(self, table: dict[int, int], key: int) -> None:
        table[key] = table.get(key, 0) + 1

    def _tensor(self, key: int, g: torch.Tensor) -> None:
        self._count(self.tensor, key)
        self.kept.append((g, g.detach().clone()))

    def assert_each(self, times: int) -> None:
        for table in (self.tensor, self.post, self.node):
            assert [table.get(id(p), 0) for p in self.params] == [times] * len(self.params)
        for kept, seen in self.kept:
            assert torch.equal(kept, seen), (
                "a gradient a hook kept was overwritten by a later replay"
            )


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("order_name", list(ORDERS))
def test_equals_fused_and_eager_split(env: Env, model: str, order_name: str) -> None:
    order = ORDERS[order_name]()
    run = Run(env, order, MODELS[model], steps=3)
    fused = copy.deepcopy(run.modules)
    split = copy.deepcopy(run.modules)
    stages = make_graphed_split_callables(run.modules, run.sample_args(), order)
    hooks = HookCounter(run.modules)
    kept: list[
        tuple[torch.Tensor, torch.Tensor]
    ] = []  # input gradients of earlier steps, and their values
    for step in range(run.steps):
        for mods in (fused, split, run.modules):
            for mod in mods:
                mod.zero_grad(set_to_none=True)
        want = run.fused(fused, step)
        eager = run.eager_split(split, step)
        got = run.graphed(stages, step)
        for key in want:
            _assert_close(got[key], want[key], f"step {step} input grad {key}")
            _assert_close(eager[key], want[key], f"step {step} eager input grad {key}")
        for held, value in kept:
            assert torch.equal(held, value), (
                "an input gradient returned earlier was overwritten by a replay"
            )
        kept += [(g, g.clone()) for g in got.values()]
        _assert_param_grads(run.modules, fused, f"step {step} vs fused")
        _assert_param_grads(run.modules, split, f"step {step} vs eager split")
    assert stages.position == 0 and stages.state is SplitStageState.READY
    n_w = sum(1 for e in order if e.kind is EntryKind.WGRAD) // len(order.chunks)
    hooks.assert_each(run.steps * n_w)


def test_accumulation_across_steps_and_backward_dgrad(env: Env) -> None:
    """No zero_grad between steps (.grad kept: W adds in place, no copy); D through Tensor.backward."""
    order = ORDERS["zbv-2ranks-rank1"]()
    run = Run(env, order, Nested, steps=2)
    fused = copy.deepcopy(run.modules)
    stages = make_graphed_split_callables(run.modules, run.sample_args(), order)
    copies = []
    for step in range(run.steps):
        want = run.fused(fused, step)
        before = stages.copies
        got = run.graphed(stages, step, dgrad="backward")
        copies.append(stages.copies - before)
        for key in want:
            _assert_close(got[key], want[key], f"step {step} input grad {key}")
        _assert_param_grads(run.modules, fused, f"step {step}")
    n_params = sum(len(list(m.parameters())) for m in run.modules)
    n_inputs = len(run.x) // run.steps
    # Step 0: each parameter's first W clones (its .grad is None); each input's .grad is None.
    # Step 1: parameters' .grad exist, so W adds in place: only the inputs' gradients are copied.
    assert copies == [n_params + n_inputs, n_inputs]


def test_dw_builder_protocol_of_pipeline_stage(env: Env) -> None:
    """What PipelineStage does with dw_builder: a full backward (B only here), builder() after it, runner at W."""
    order = ORDERS["interleaved-zb-2ranks-rank1"]()
    run = Run(env, order, TiedNorm, steps=2)
    fused = copy.deepcopy(run.modules)
    stages = make_graphed_split_callables(run.modules, run.sample_args(), order)
    builders = [stages.dw_builder(c) for c in order.chunks]
    for step in range(run.steps):
        want = run.fused(fused, step)
        held: dict[tuple[int, int], Any] = {}
        runners: dict[tuple[int, int], Any] = {}
        for e in order:
            key = (e.chunk, e.microbatch)
            if e.kind is EntryKind.FORWARD:
                x = run.x[(step, *key)].clone().requires_grad_()
                held[key] = (x, stages.callables[e.chunk](x))
            elif e.kind is EntryKind.DGRAD:
                x, out = held.pop(key)
                (dx,) = stage_backward(out, run.g[(step, *key)][0], [x])
                _assert_close(dx, want[key], f"step {step} input grad {key}")
                runners[key] = builders[e.chunk]()
            else:
                runners.pop(key)()
        _assert_param_grads(run.modules, fused, f"step {step}")


def test_megatron_style_main_grad_hook(env: Env) -> None:
    """An AccumulateGrad node hook that moves .grad into main_grad and clears it: W clones every time, exact."""
    order = ORDERS["zbv-2ranks-rank0"]()
    run = Run(env, order, Nested, steps=2)
    fused = copy.deepcopy(run.modules)
    stages = make_graphed_split_callables(run.modules, run.sample_args(), order)
    params = [p for m in run.modules for p in m.parameters()]
    main_grads = {id(p): torch.zeros_like(p) for p in params}

    def hook_for(p: torch.Tensor) -> Any:
        def hook(*_: Any) -> None:
            main_grads[id(p)].add_(p.grad)
            p.grad = None

        return hook

    for p in params:
        p.view_as(p).grad_fn.next_functions[0][0].register_hook(hook_for(p))  # type: ignore[union-attr]
    for step in range(run.steps):
        run.fused(fused, step)
        run.graphed(stages, step)
    for p, q in zip(params, (q for m in fused for q in m.parameters())):
        assert p.grad is None
        _assert_close(main_grads[id(p)], q.grad, "main_grad")


def test_out_of_order_replays_are_refused_before_anything_runs(env: Env) -> None:
    order = ORDERS["zbv-2ranks-rank1"]()
    run = Run(env, order, Nested, steps=1)
    fused = copy.deepcopy(run.modules)  # before graphing replaces forward
    stages = make_graphed_split_callables(run.modules, run.sample_args(), order)
    first = order.entries[0]
    with pytest.raises(TypeError, match="shaped like its sample_args"):
        stages.callables[first.chunk](torch.randn(1, WIDTH, dtype=D, device=env.device))
    assert stages.position == 0 and stages.state is SplitStageState.READY
    other = 1 - first.chunk
    x = run.x[(0, other, 0)]
    with pytest.raises(ReplayOrderError) as info:
        stages.callables[other](x)
    assert info.value.position == 0 and info.value.expected == first
    with pytest.raises(ReplayOrderError):
        stages.backward_weight(first.chunk)
    assert stages.position == 0

    # Run up to the first D; then try W before it, and the D of another microbatch.
    held = {}
    for e in order.entries:
        if e.kind is not EntryKind.FORWARD:
            break
        xin = run.x[(0, e.chunk, e.microbatch)].clone().requires_grad_()
        held[(e.chunk, e.microbatch)] = (xin, _outputs(stages.callables[e.chunk](xin)))
    d = stages.next_entry
    assert d.kind is EntryKind.DGRAD
    wrong = next(k for k in held if k != (d.chunk, d.microbatch))
    position = stages.position
    with pytest.raises(ReplayOrderError) as info:
        torch.autograd.grad(held[wrong][1], [held[wrong][0]], run.g[(0, *wrong)])
    assert info.value.expected == d and stages.position == position
    with pytest.raises(ReplayOrderError):
        stages.backward_weight(d.chunk)
    assert all(p.grad is None for m in run.modules for p in m.parameters())

    # The refused calls changed nothing: restart and run whole steps correctly.
    stages.restart_step()
    want = run.fused(fused, 0)
    got = run.graphed(stages, 0)
    for key in want:
        _assert_close(got[key], want[key], f"input grad {key}")
    _assert_param_grads(run.modules, fused, "after restart")


def test_a_raising_hook_breaks_the_step_until_restart(env: Env) -> None:
    order = ORDERS["zbv-2ranks-rank0"]()
    run = Run(env, order, TiedNorm, steps=1)
    fused = copy.deepcopy(run.modules)
    stages = make_graphed_split_callables(run.modules, run.sample_args(), order)
    boom = [True]

    def hook(_: torch.Tensor) -> None:
        if boom[0]:
            raise ValueError("boom")

    run.modules[0].w.register_post_accumulate_grad_hook(hook)
    with pytest.raises(ValueError, match="boom"):
        run.graphed(stages, 0)
    assert stages.state is SplitStageState.BROKEN_STEP
    with pytest.raises(RuntimeError, match="restart_step"):
        stages.callables[stages.next_entry.chunk](run.x[(0, 0, 0)])
    boom[0] = False
    stages.restart_step()
    for m in run.modules:
        m.zero_grad(set_to_none=True)
    run.fused(fused, 0)
    run.graphed(stages, 0)
    _assert_param_grads(run.modules, fused, "after restart")


def test_capture_time_refusals(env: Env) -> None:
    order = ORDERS["zbv-2ranks-rank0"]()
    run = Run(env, order, Nested, steps=1)
    run.modules[1].w.register_hook(lambda g: g)
    with pytest.raises(ValueError, match="tensor hook"):
        make_graphed_split_callables(run.modules, run.sample_args(), order)

    fresh = Run(env, order, Nested, steps=1)
    undelayed = CaptureOrder(
        [e for e in order if not (e.kind is EntryKind.WGRAD and e.chunk == 1)],
        delayed_wgrad_chunks={0},
    )
    with pytest.raises(ValueError, match=r"chunks \[1\] have no wgrad"):
        make_graphed_split_callables(fresh.modules, fresh.sample_args(), undelayed)
    with pytest.raises(ValueError, match="must be 0..2"):
        make_graphed_split_callables(
            [*fresh.modules, Nested()], [*fresh.sample_args(), *fresh.sample_args()[:1]], order
        )
    with pytest.raises(TypeError, match="nn.Module"):
        make_graphed_split_callables([fresh.modules[0], torch.tanh], fresh.sample_args(), order)  # type: ignore[list-item]


def test_single_chunk_order_by_hand(env: Env) -> None:
    """A hand-written order with two microbatches in flight and W after both dgrads."""
    order = CaptureOrder(
        [
            CaptureEntry.forward(0, 0),
            CaptureEntry.forward(0, 1),
            CaptureEntry.dgrad(0, 0),
            CaptureEntry.dgrad(0, 1),
            CaptureEntry.wgrad(0, 1),
            CaptureEntry.wgrad(0, 0),
        ]
    )
    run = Run(env, order, Nested, steps=2)
    fused = copy.deepcopy(run.modules)
    stages = make_graphed_split_callables(run.modules, run.sample_args(), order)
    for step in range(run.steps):
        want = run.fused(fused, step)
        got = run.graphed(stages, step)
        for key in want:
            _assert_close(got[key], want[key], f"step {step} input grad {key}")
        _assert_param_grads(run.modules, fused, f"step {step}")


class _DelayedMatmulFn(torch.autograd.Function):
    """``x @ w`` whose weight gradient a WeightGradStore computes at W time (unfused)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, store: WeightGradStore) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.store = store
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        ctx.store.record(w, lambda _: x.t() @ g, accumulate_into_main_grad=False)
        return g @ w.t(), None, None


class _DelayedStage(torch.nn.Module):
    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=D) / WIDTH)
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_DelayedMatmulFn.apply(x, self.w, self.store))


def test_a_wgrad_store_kernel_inside_a_graphed_stage_is_refused_at_the_next_seal(env: Env) -> None:
    # B's graph replays no Python: the store held the warm-up's and the
    # capture's records, and no replay would ever record the weight's gradient
    # (accepted silently before).
    order = CaptureOrder(
        [CaptureEntry.forward(0, 0), CaptureEntry.dgrad(0, 0), CaptureEntry.wgrad(0, 0)]
    )
    store = WeightGradStore()
    stage = _DelayedStage(store).to(env.device)
    sample = (torch.randn(ROWS, WIDTH, dtype=D, device=env.device, requires_grad=True),)
    make_graphed_split_callables([stage], [sample], order)
    with pytest.raises(RuntimeError, match="recorded while a CUDA graph was captured"):
        store.seal()
