"""A custom Function with a delayed-wgrad path has its weight part run in gradsafe's W (issue 29, item 3).

The kernel is examples/fused_linear.py's: in gradsafe's B it finds a store
(gradsafe.wgrad.split_wgrad_store(ctx)), records its weight GEMM there and
returns None in the weight slot; the hand-off runs the closures in W and
delivers them through AccumulateGrad with the rest of W's gradients.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight
from gradsafe.testing import MegatronStyleDDP
from gradsafe.wgrad import split_wgrad_store

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fused_linear.py"

#: The B/W orders schedules use, for two microbatches: (phase, microbatch).
ORDERS = {
    "B0 B1 W0 W1": [("B", 0), ("B", 1), ("W", 0), ("W", 1)],
    "B0 W0 B1 W1": [("B", 0), ("W", 0), ("B", 1), ("W", 1)],
    "B0 B1 W1 W0": [("B", 0), ("B", 1), ("W", 1), ("W", 0)],
}


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fused_linear_example_split", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stage(example: ModuleType, *, fuse: bool = False) -> torch.nn.Module:
    """Two fused layers and a built-in Linear tied to the first fused weight (a mixed stage)."""
    torch.manual_seed(0)
    first = example.FusedLinear(6, 6, accumulate_into_main_grad=fuse, dtype=torch.float64)
    second = example.FusedLinear(6, 6, accumulate_into_main_grad=fuse, dtype=torch.float64)
    plain = torch.nn.Linear(6, 6, dtype=torch.float64)

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second, self.plain = first, second, plain

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.first(x))
            # the first weight again, through a built-in op: its gradient sums both uses
            return self.second(h) + self.plain(h) + h @ self.first.weight.t()

    return Stage()


def _inputs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(5, 6, dtype=torch.float64, generator=gen),
            torch.randn(5, 6, dtype=torch.float64, generator=gen),
        )
        for _ in range(n)
    ]


def _fused(stage: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    dxs = []
    for x, g in data:
        x = x.clone().requires_grad_()
        stage(x).backward(g)
        dxs.append(x.grad)
    return dxs


def _split(
    stage: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], order: list[Any]
) -> list[Any]:
    dxs: list[Any] = [None] * len(data)
    handoffs: dict[int, Any] = {}
    for phase, i in order:
        if phase == "B":
            x = data[i][0].clone().requires_grad_()
            y = stage(x)
            (dxs[i],), handoffs[i] = stage_backward_input(
                y, data[i][1], [x], list(stage.parameters())
            )
        else:
            stage_backward_weight(list(stage.parameters()), handoffs.pop(i))
    return dxs


@pytest.mark.parametrize("order", ORDERS, ids=str)
def test_delayed_kernel_split_is_exact_in_every_schedule_order(example, order: str) -> None:  # type: ignore[no-untyped-def]
    ref, split = _stage(example), _stage(example)
    data = _inputs(2)
    want_dx = _fused(ref, data)
    got_dx = _split(split, data, ORDERS[order])
    for a, b in zip(got_dx, want_dx):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    for (name, p), q in zip(split.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, msg=name)


@pytest.mark.parametrize("order", ORDERS, ids=str)
def test_delayed_kernel_fused_into_main_grad_matches_under_megatron_hooks(
    example, order: str
) -> None:  # type: ignore[no-untyped-def]
    ref, split = _stage(example, fuse=True), _stage(example, fuse=True)
    ddps = (MegatronStyleDDP(ref), MegatronStyleDDP(split))
    data = _inputs(2)
    _fused(ref, data)
    _split(split, data, ORDERS[order])
    for (name, p), q in zip(split.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, q.main_grad, rtol=1e-12, atol=0, msg=name)
        assert len(ddps[1].calls(p)) == len(ddps[0].calls(q)), name
    for ddp in ddps:
        ddp.remove()


def _hooked(stage: torch.nn.Module, log: list[tuple[str, str, Any]]) -> None:
    for name, p in stage.named_parameters():
        p.register_hook(lambda g, n=name: log.append(("tensor", n, g.clone())))
        p.register_post_accumulate_grad_hook(
            lambda q, n=name: log.append(("post", n, q.grad.clone()))
        )


def test_delayed_kernel_hooks_fire_in_w_once_each_with_the_fused_gradient(example) -> None:  # type: ignore[no-untyped-def]
    ref, split = _stage(example), _stage(example)
    want: list[Any] = []
    got: list[Any] = []
    _hooked(ref, want)
    _hooked(split, got)
    ((x, g),) = _inputs(1)
    ref(x.clone().requires_grad_()).backward(g)
    xs = x.clone().requires_grad_()
    _, handoff = stage_backward_input(split(xs), g, [xs], list(split.parameters()))
    assert got == []  # B runs no parameter hook
    stage_backward_weight(list(split.parameters()), handoff)
    key = lambda entry: (entry[0], entry[1])  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))
    by_key = {key(e): e[2] for e in want}
    for entry in got:
        torch.testing.assert_close(entry[2], by_key[key(entry)], rtol=1e-12, atol=0)


def test_w_share_of_a_delayed_kernel_stage_is_half_by_flop_count(example) -> None:  # type: ignore[no-untyped-def]
    d = 32
    for tokens in (d // 4, d, 4 * d):
        counts = example.split_flops(d=d, tokens=tokens, blocks=2)
        # dgrad and wgrad GEMMs have the same FLOPs: W does exactly half.
        assert counts["W"] == counts["B"] > 0, tokens
        # and nothing is computed twice: B+W is a fused backward's 4 GEMMs per block.
        assert counts["B"] + counts["W"] == 2 * 2 * 2 * (2 * tokens * d * 4 * d), tokens
    assert example.w_share() > 0.45


def test_store_is_seen_from_another_thread_in_b_and_nowhere_else(example) -> None:  # type: ignore[no-untyped-def]
    seen: list[Any] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            # autograd runs a CUDA backward's Python on a device thread: the
            # lookup keys on the node, not on the thread.
            worker = threading.Thread(target=lambda: seen.append(split_wgrad_store(ctx)))
            worker.start()
            worker.join()
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    _, handoff = stage_backward_input(Probe.apply(x, w), torch.ones(2, 3), [x], [w])
    stage_backward_weight([w], handoff)
    Probe.apply(x, w).sum().backward()  # a fused backward: no store
    assert seen[0] is not None and seen[1] is None


def _plain_linear() -> type[torch.autograd.Function]:
    class PlainLinear(torch.autograd.Function):
        """A kernel without a delayed path: its whole backward runs in B, as before."""

        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    return PlainLinear


def test_kernel_without_a_delayed_path_stays_exact_with_its_wgrad_in_b(example) -> None:  # type: ignore[no-untyped-def]
    fn = _plain_linear()
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    x, g = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    fn.apply(torch.tanh(fn.apply(xr, w1)), w2).backward(g)
    want = [w1.grad.clone(), w2.grad.clone(), xr.grad]
    w1.grad = w2.grad = None
    xs = x.clone().requires_grad_()
    counter = example.MatmulFlops()
    with counter:
        counter.phase = "B"
        (dx,), handoff = stage_backward_input(
            fn.apply(torch.tanh(fn.apply(xs, w1)), w2), g, [xs], [w1, w2]
        )
        counter.phase = "W"
        stage_backward_weight([w1, w2], handoff)
    assert counter.counts.get("W", 0) == 0 < counter.counts["B"]
    for got, ref in zip([w1.grad, w2.grad, dx], want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)


def _one_layer(example: ModuleType) -> tuple[torch.nn.Module, torch.Tensor, Any]:
    torch.manual_seed(0)
    lin = example.FusedLinear(4, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    _, handoff = stage_backward_input(lin(x), torch.ones(3, 4), [x], list(lin.parameters()))
    return lin, x, handoff


def test_w_run_twice_is_refused(example) -> None:  # type: ignore[no-untyped-def]
    lin, _, handoff = _one_layer(example)
    stage_backward_weight(list(lin.parameters()), handoff)
    once = lin.weight.grad.clone()
    with pytest.raises(SplitBackwardError, match="called twice"):
        stage_backward_weight(list(lin.parameters()), handoff)
    torch.testing.assert_close(lin.weight.grad, once, rtol=0, atol=0)


def test_a_read_modified_between_b_and_w_is_refused_before_anything_changes(example) -> None:  # type: ignore[no-untyped-def]
    lin, x, handoff = _one_layer(example)
    with torch.no_grad():
        x.mul_(2)  # the closure reads x: W would compute with the new values
    with pytest.raises(SplitBackwardError, match="modified in place after B recorded it"):
        stage_backward_weight(list(lin.parameters()), handoff)
    assert lin.weight.grad is None


def test_a_b_whose_w_never_runs_warns_that_its_weight_gradients_are_lost(example) -> None:  # type: ignore[no-untyped-def]
    _, _, handoff = _one_layer(example)
    with pytest.warns(RuntimeWarning, match="dropped without W"):
        del handoff
        gc.collect()


def test_a_store_kept_past_its_backward_is_refused(example) -> None:  # type: ignore[no-untyped-def]
    kept: list[Any] = []

    class Keeper(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            kept.append(split_wgrad_store(ctx))
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    _, handoff = stage_backward_input(Keeper.apply(x, w), torch.ones(2, 3), [x], [w])
    stage_backward_weight([w], handoff)
    with pytest.raises(RuntimeError, match="has ended"):
        kept[0].record(w, lambda _: w, accumulate_into_main_grad=False)


def test_a_recorded_parameter_not_passed_to_apply_is_refused_in_b(example) -> None:  # type: ignore[no-untyped-def]
    hidden = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))

    class ClosesOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            x, w = ctx.saved_tensors
            store = split_wgrad_store(ctx)
            store.record(hidden, lambda _: g.t() @ x, accumulate_into_main_grad=False)
            return g @ w, g.t() @ x

    w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(SplitBackwardError, match="not an input of its node"):
        stage_backward_input(ClosesOver.apply(x, w), torch.ones(2, 3), [x], [w, hidden])
    assert w.grad is None and hidden.grad is None and x.grad is None


def test_a_failing_closure_leaves_the_handoff_failed_and_names_the_kernel(example) -> None:  # type: ignore[no-untyped-def]
    class Broken(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            x, w = ctx.saved_tensors
            bad: Callable[[Any], Any] = lambda _: g  # noqa: E731  (wrong shape)
            split_wgrad_store(ctx).record(w, bad, accumulate_into_main_grad=False)
            return g @ w, None

    w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    _, handoff = stage_backward_input(Broken.apply(x, w), torch.ones(2, 3), [x], [w])
    with pytest.raises(SplitBackwardError, match="delayed weight gradient.*no .grad changed"):
        stage_backward_weight([w], handoff)
    assert w.grad is None and handoff.state.value == "failed"


@pytest.mark.parametrize("gemms_eager", [False, True], ids=["compiled", "linear-eager"])
def test_compiled_block_w_share_is_zero_unless_its_gemms_stay_eager(
    example, gemms_eager: bool
) -> None:  # type: ignore[no-untyped-def]
    """AOTAutograd runs a region's backward as one node B runs whole: W gets none of its GEMMs;
    a graph break around each Linear gives them back to W (docs/pipelining.md's table)."""
    torch.manual_seed(0)
    d = 16
    ref = torch.nn.Sequential(
        torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
    ).double()
    block = copy.deepcopy(ref)
    if gemms_eager:
        for layer in block:
            if isinstance(layer, torch.nn.Linear):
                layer.forward = torch.compiler.disable(layer.forward)  # type: ignore[method-assign]
    compiled = torch.compile(block, backend="aot_eager")
    x, g = torch.randn(8, d, dtype=torch.float64), torch.randn(8, d, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    xs = x.clone().requires_grad_()
    y = compiled(xs)
    params = list(block.parameters())
    counter = example.MatmulFlops()
    with counter:
        counter.phase = "B"
        (dx,), handoff = stage_backward_input(y, g, [xs], params)
        counter.phase = "W"
        stage_backward_weight(params, handoff)
    b, w = counter.counts.get("B", 0), counter.counts.get("W", 0)
    assert (w == b) if gemms_eager else (w == 0 < b)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-12, atol=1e-15)
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("schedule", ["ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"])
def test_delayed_kernel_stages_are_exact_under_torchs_zero_bubble_schedules(  # type: ignore[no-untyped-def]
    example, monkeypatch: pytest.MonkeyPatch, schedule: str
) -> None:
    """torch's own schedules (one rank, its two stages local) under gradsafe.patch("pipelining"):
    every B records the kernels' weight parts and the schedule's W runs them, exactly."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    import gradsafe

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    recorded = []

    def counting(ctx: object) -> Any:
        store = split_wgrad_store(ctx)
        recorded.append(store is not None)
        return store

    monkeypatch.setattr(example, "split_wgrad_store", counting)
    torch.manual_seed(0)
    mods = [example.Stage(8, 1) for _ in range(2)]
    refs = [example.Stage(8, 1) for _ in range(2)]
    for mod, ref in zip(mods, refs):
        ref.load_state_dict(mod.state_dict())
    x, target = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)

    def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((y - t) ** 2).sum()

    for xm, tm in zip(x.chunk(4), target.chunk(4)):
        loss_fn(refs[1](refs[0](xm)), tm).backward()
    recorded.clear()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with gradsafe.patch("pipelining"):
            stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
            cls = getattr(schedules, schedule)
            try:
                cls(stages, n_microbatches=4, loss_fn=loss_fn, scale_grads=False).step(
                    x, target=target
                )
            except RuntimeError as exc:  # torch 2.11 sends between local stages over gloo
                if "state_ >= CONNECTED" in str(exc) or "Pair is not connected" in str(exc):
                    pytest.skip("this torch cannot run two stages on one gloo rank")
                raise
    finally:
        dist.destroy_process_group()
    # Stage 1's B records for W (2 fused layers x 4 microbatches). Stage 0's input needs no
    # gradient: torch's schedules run its backward fused (stage_backward), no store there.
    assert recorded.count(True) == 8
    for mod, ref in zip(mods, refs):
        for p, q in zip(mod.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


def test_a_closure_returning_the_input_gradient_reaches_w_hooks_as_a_copy() -> None:
    """A bias-like kernel (y = x + w) whose closure returns the incoming gradient itself, which B
    also returned as the input gradient: a hook on w that modifies its argument in place must
    not change the input gradient B handed on (as for built-in nodes, docs/pipelining.md Hooks)."""

    class AddWeight(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.w = w
            return x + w

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            store = split_wgrad_store(ctx)
            store.record(ctx.w, lambda _: g, accumulate_into_main_grad=False, reads=(g,))
            return g, None

    w = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
    w.register_hook(lambda grad: grad.mul_(3))  # in place, returning the same tensor
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, dtype=torch.float64)
    (dx,), handoff = stage_backward_input(AddWeight.apply(x, w), g.clone(), [x], [w])
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(dx, g, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, 3 * g, rtol=0, atol=0)


def test_out_of_memory_in_a_kernels_closure_reaches_the_caller_as_itself(example) -> None:  # type: ignore[no-untyped-def]
    class OutOfMemory(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            x, w = ctx.saved_tensors

            def compute(_: Any) -> Any:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")

            split_wgrad_store(ctx).record(w, compute, accumulate_into_main_grad=False)
            return g @ w, None

    w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    _, handoff = stage_backward_input(OutOfMemory.apply(x, w), torch.ones(2, 3), [x], [w])
    with pytest.raises(torch.OutOfMemoryError, match="injected") as caught:
        stage_backward_weight([w], handoff)
    if sys.version_info >= (3, 11):  # exception notes
        notes = getattr(caught.value, "__notes__", [])
        assert any("delayed weight gradient" in note for note in notes), notes
    assert w.grad is None and handoff.state.value == "failed"


class _RecordsAndReturns(torch.autograd.Function):
    """A kernel that records its weight part for W and also returns it (a kernel bug)."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        x, w = ctx.saved_tensors
        store = split_wgrad_store(ctx)
        if store is not None:
            store.record(w, lambda _: g.t() @ x, accumulate_into_main_grad=False)
        return g @ w, g.t() @ x


class _Returns(torch.autograd.Function):
    """A kernel without a delayed path, for the same weight (a tied use)."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def test_a_kernel_that_records_its_weight_part_and_also_returns_it_is_refused_in_b() -> None:
    w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    y = _RecordsAndReturns.apply(x, w)
    with pytest.raises(SplitBackwardError, match="also returned it") as info:
        stage_backward_input(y, torch.ones(2, 3), [x], [w])
    assert "wgrad_return" in str(info.value)
    assert w.grad is None and x.grad is None


def test_a_recorded_weight_another_kernel_returns_for_its_own_use_stays_exact() -> None:
    # Tied: one kernel delays its use, another returns its own: not counted twice.
    class Delays(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            x, w = ctx.saved_tensors
            store = split_wgrad_store(ctx)
            if store is None:
                return g @ w, g.t() @ x
            store.record(w, lambda _: g.t() @ x, accumulate_into_main_grad=False)
            return g @ w, None

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, dtype=torch.float64)

    def stage(x: torch.Tensor) -> torch.Tensor:
        return _Returns.apply(torch.tanh(Delays.apply(x, w)), w)

    stage(x).backward(g)
    want = w.grad.clone()  # type: ignore[union-attr]
    w.grad = None
    _, handoff = stage_backward_input(stage(x), g, [x], [w])
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(w.grad, want, rtol=0, atol=1e-12)


class _Written(TorchDispatchMode):
    """Every operator W runs, and the bytes of the new storages each returns (not views)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        given = {
            a.untyped_storage().data_ptr()
            for a in (*args, *(kwargs or {}).values())
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("held", [False, True], ids=["grad None", "grad held"])
def test_w_runs_delayed_closures_without_copying_their_gradients_the_same_ops_every_run(
    example: ModuleType, held: bool
) -> None:
    """W writes each delayed weight gradient once (the closure's GEMM; AccumulateGrad adopts it
    or adds it in place), with the same operators on every run: a closure's inputs, freed once
    its parameter is done, once made a later gradient whose address (or id) they had look
    aliased, so W copied it, and AccumulateGrad copied the rest (W still held them)."""
    torch.manual_seed(0)
    layers = [example.FusedLinear(64, 64) for _ in range(6)]
    stage = torch.nn.Sequential(*(m for layer in layers for m in (layer, torch.nn.Tanh())))
    weights = sum(p.numel() * p.element_size() for p in stage.parameters())
    runs = []
    for _ in range(8):
        for p in stage.parameters():
            p.grad = torch.zeros_like(p) if held else None
        x = torch.randn(32, 64, requires_grad=True)
        out = stage(x)
        _, handoff = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
        gc.collect()
        with _Written() as written:
            stage_backward_weight(stage.parameters(), handoff)
        runs.append((written.ops, written.bytes))
    assert all(run == runs[0] for run in runs), [len(ops) for ops, _ in runs]
    ops, written_bytes = runs[0]
    assert "aten.copy_.default" not in ops and ops.count("aten.clone.default") <= 1, ops
    # The GEMMs' outputs, and W's one scalar helper (a clone of its anchor).
    assert written_bytes <= weights + 4, (written_bytes, weights)
