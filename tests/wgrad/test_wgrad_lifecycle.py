"""The delayed-W lifecycle under a guarded Megatron-style DDP (issue 30, items 1-5).

Every W pass of a step runs before the step's reduction: ``guard_ddp_step``
makes the reduction (``start_grad_sync``, ``finish_grad_sync``) and
``zero_grad_buffer()`` refuse, before changing anything, while a W pass of
the model's parameters is outstanding. Here under ``MegatronStyleDDP``
against plain fp64 autograd; test_megatron_real.py runs the same cases under
megatron-core's DistributedDataParallel.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

import pytest
import torch

from gradsafe.testing import MegatronStyleDDP, module_of
from gradsafe.wgrad import (
    PendingWeightGrads,
    WeightGradStore,
    guard_ddp_step,
    mark_delayed_wgrad,
    register_megatron_hook,
)


class _Head(torch.autograd.Function):
    """``h @ w.T`` whose weight gradient W computes (fused into main_grad or not)."""

    @staticmethod
    def forward(ctx, h, w, store, fused):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(h)
        ctx.w, ctx.store, ctx.fused = w, store, fused
        return h @ w.t()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (h,) = ctx.saved_tensors

        def compute(main_grad: torch.Tensor | None) -> torch.Tensor | None:
            if main_grad is None:
                return g.t() @ h
            main_grad.add_(g.t() @ h)
            return None

        ctx.store.record(ctx.w, compute, accumulate_into_main_grad=ctx.fused)
        return g @ ctx.w, None, None, None


class _Model:
    """A weight tied between an embedding-like undelayed use and a delayed head, plus a plain weight."""

    def __init__(self, *, fused: bool, overlap: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))
        self.v = torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))
        mark_delayed_wgrad(self.w)
        self.store = WeightGradStore()
        self.fused = fused
        self.ddp = MegatronStyleDDP(
            module_of([self.w, self.v], self.store),
            delay_wgrad_compute=True,
            overlap_grad_reduce=overlap,
        )
        self.guard = guard_ddp_step(self.ddp)
        self.ref = [p.detach().clone().requires_grad_() for p in (self.w, self.v)]

    @staticmethod
    def x(i: int) -> torch.Tensor:
        return torch.randn(
            2, 4, generator=torch.Generator().manual_seed(10 + i), dtype=torch.float64
        )

    def b(self, i: int) -> PendingWeightGrads:
        h = torch.tanh(self.x(i) @ self.w.t() @ self.v.t())
        _Head.apply(h, self.w, self.store, self.fused).pow(2).sum().backward()
        w, v = self.ref
        (torch.tanh(self.x(i) @ w.t() @ v.t()) @ w.t()).pow(2).sum().backward()
        return self.store.seal()

    def main_grads(self) -> list[torch.Tensor]:
        return [p.main_grad.clone() for p in (self.w, self.v)]  # type: ignore[attr-defined]

    def grads(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.clone() for p in (self.w, self.v)]

    def assert_exact(self) -> None:
        for p, r in zip((self.w, self.v), self.ref):
            torch.testing.assert_close(p.main_grad, r.grad)  # type: ignore[attr-defined]
            assert p.grad is None


@contextlib.contextmanager
def _nothing_changes(model: _Model) -> Iterator[None]:
    main_grads, grads = model.main_grads(), model.grads()
    yield
    for before, after in zip(main_grads, model.main_grads()):
        assert torch.equal(before, after)
    for before, after in zip(grads, model.grads()):  # type: ignore[assignment]
        assert (before is None) == (after is None)
        assert before is None or torch.equal(before, after)  # type: ignore[arg-type]


def _all_but_the_last_w(model: _Model, microbatches: int) -> PendingWeightGrads:
    """B0 B1 W0 B2 W1 ... B(n-1) W(n-2): the recipe's order, stopped before the last W."""
    previous = model.b(0)
    for i in range(1, microbatches):
        current = model.b(i)
        previous.run()
        previous = current
    return previous


FUSED_OVERLAP = pytest.mark.parametrize(
    ("fused", "overlap"), [(False, False), (True, False), (False, True), (True, True)]
)


@FUSED_OVERLAP
@pytest.mark.parametrize("reduction", ["finish_grad_sync", "start_grad_sync"])
def test_a_w_left_for_after_the_reduction_is_refused_by_the_reduction(
    fused: bool, overlap: bool, reduction: str
) -> None:
    """Item 1: at world 2 such a W left main_grad 0.41 off and the ranks 0.82 apart, silently."""
    model = _Model(fused=fused, overlap=overlap)
    last = _all_but_the_last_w(model, 3)
    with _nothing_changes(model), pytest.raises(RuntimeError) as refusal:
        getattr(model.ddp, reduction)()
    message = str(refusal.value)
    assert message.startswith(f"DDP.{reduction}(): delayed weight gradients")
    assert "1 sealed W pass(es) not run yet (parameters of shape (4, 4))" in message
    assert "before the step's reduction" in message and "finalize_model_grads_func" in message
    last.run()
    getattr(model.ddp, reduction)()
    model.assert_exact()


@FUSED_OVERLAP
def test_the_last_w_carried_into_the_next_step_is_refused_at_the_reduction_and_at_zero_grad_buffer(
    fused: bool, overlap: bool
) -> None:
    """Item 2: run after the next zero_grad_buffer(), that W was 0.97-1.69 off every step, silently."""
    model = _Model(fused=fused, overlap=overlap)
    last = _all_but_the_last_w(model, 2)
    for call in (model.ddp.finish_grad_sync, model.ddp.zero_grad_buffer):
        with _nothing_changes(model), pytest.raises(RuntimeError, match="sealed W pass"):
            call()
    last.run()
    model.ddp.finish_grad_sync()
    model.assert_exact()
    model.ddp.zero_grad_buffer()  # the next step starts


@FUSED_OVERLAP
def test_zero_grad_buffer_between_a_b_and_its_w_is_refused_before_zeroing(
    fused: bool, overlap: bool
) -> None:
    """Item 3: the zeroed microbatch came back for the delayed weight only (2.25 off).

    The tied weight's undelayed gradient waits in .grad for the W's hook: the
    refusal leaves it there too.
    """
    model = _Model(fused=fused, overlap=overlap)
    pending = model.b(0)
    assert model.w.grad is not None  # the undelayed use's gradient, waiting for W
    with _nothing_changes(model), pytest.raises(RuntimeError) as refusal:
        model.ddp.zero_grad_buffer()
    assert str(refusal.value).startswith("DDP.zero_grad_buffer(): delayed weight gradients")
    assert "To abandon the step instead" in str(refusal.value)
    pending.run()
    model.ddp.finish_grad_sync()
    model.assert_exact()


@FUSED_OVERLAP
@pytest.mark.parametrize("kept", [True, False], ids=["held", "dropped"])
def test_a_forgotten_last_w_is_refused_at_the_reduction(
    fused: bool, overlap: bool, kept: bool
) -> None:
    """Item 4: before, main_grad was short at the reduction and only a GC warning came, after the step."""
    model = _Model(fused=fused, overlap=overlap)
    last: PendingWeightGrads | None = _all_but_the_last_w(model, 3)
    if not kept:
        with pytest.warns(RuntimeWarning, match="dropped without run"):
            last = None
            gc.collect()
    with _nothing_changes(model), pytest.raises(RuntimeError) as refusal:
        model.ddp.finish_grad_sync()
    expected = "1 sealed W pass(es) not run yet" if kept else "1 dropped without run()"
    assert expected in str(refusal.value)
    if kept:
        assert last is not None
        last.run()
        model.ddp.finish_grad_sync()
        model.assert_exact()


def test_records_not_yet_sealed_are_outstanding_too() -> None:
    model = _Model(fused=False, overlap=False)
    h = torch.tanh(model.x(0) @ model.w.t())
    _Head.apply(h, model.w, model.store, False).pow(2).sum().backward()  # B, not sealed
    with pytest.raises(RuntimeError, match=r"1 weight use\(s\) recorded by B since the last"):
        model.ddp.finish_grad_sync()


def test_abandoning_a_step_as_the_refusal_says_lets_zero_grad_buffer_through() -> None:
    model = _Model(fused=False, overlap=False)
    pending: PendingWeightGrads | None = model.b(0)
    with pytest.raises(RuntimeError, match="To abandon the step instead"):
        model.ddp.zero_grad_buffer()
    with pytest.warns(RuntimeWarning, match="dropped without run"):
        pending = None
        gc.collect()
    model.w.grad = None
    model.ddp.zero_grad_buffer()  # the dropped pass no longer counts in the new step
    model.ref = [p.detach().clone().requires_grad_() for p in (model.w, model.v)]
    model.b(1).run()
    model.ddp.finish_grad_sync()
    model.assert_exact()
    assert pending is None


def test_a_pass_failed_part_way_is_refused_at_the_reduction_until_the_step_is_redone() -> None:
    model = _Model(fused=False, overlap=False)
    pending = model.b(0)
    hook = model.store.register_grad_ready_hook(model.w, lambda p: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pending.run()
    hook.remove()
    with pytest.raises(RuntimeError, match="1 failed part-way"):
        model.ddp.finish_grad_sync()
    model.w.grad = None
    model.ddp.zero_grad_buffer()
    model.ddp.finish_grad_sync()  # a new step: the failed pass no longer counts


def test_the_guard_counts_what_several_threads_recorded_at_once() -> None:
    """Megatron runs backward hooks on autograd's device threads: records from many threads all count."""
    model = _Model(fused=False, overlap=False)
    start = threading.Barrier(8)

    def record() -> None:
        start.wait()
        for _ in range(50):
            model.store.record(
                model.w, lambda mg: torch.zeros(4, 4), accumulate_into_main_grad=False
            )

    threads = [threading.Thread(target=record) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with pytest.raises(RuntimeError, match=r"400 weight use\(s\)"):
        model.ddp.finish_grad_sync()


def test_a_w_of_another_model_does_not_block_this_ones_reduction() -> None:
    """The guard counts only W work for its own DDP's parameters (one DDP per model chunk)."""
    first, second = _Model(fused=False, overlap=False), _Model(fused=False, overlap=False)
    pending = second.b(0)
    first.b(0).run()
    first.ddp.finish_grad_sync()
    first.assert_exact()
    with pytest.raises(RuntimeError, match="sealed W pass"):
        second.ddp.finish_grad_sync()
    pending.run()


@pytest.mark.filterwarnings("ignore:a sealed W pass")
def test_remove_restores_the_ddp_and_a_second_guard_is_refused() -> None:
    model = _Model(fused=False, overlap=False)
    with pytest.raises(ValueError, match="already guarded"):
        guard_ddp_step(model.ddp)
    model.b(0)  # left unrun
    model.guard.remove()
    assert not {"finish_grad_sync", "start_grad_sync", "zero_grad_buffer"} & set(vars(model.ddp))
    model.ddp.finish_grad_sync()  # unguarded again: nothing refuses
    guard = guard_ddp_step(model.ddp)
    model.ddp.zero_grad_buffer = lambda: None  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="was replaced after the guard"):
        guard.remove()


class _Affine(torch.autograd.Function):
    """``x @ w.T + b`` with both gradients delayed, fused into main_grad or not."""

    @staticmethod
    def forward(ctx, x, w, b, store, fused):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        ctx.w, ctx.b, ctx.store, ctx.fused = w, b, store, fused
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors

        def of(wgrad: torch.Tensor):  # type: ignore[no-untyped-def]
            def compute(main_grad: torch.Tensor | None) -> torch.Tensor | None:
                if main_grad is None:
                    return wgrad
                main_grad.add_(wgrad)
                return None

            return compute

        ctx.store.record(ctx.w, of(g.t() @ x), accumulate_into_main_grad=ctx.fused)
        ctx.store.record(ctx.b, of(g.sum(0)), accumulate_into_main_grad=ctx.fused)
        return g @ ctx.w, None, None, None, None


class _DelayedWeightAndBias(torch.nn.Module):
    """docs/wgrad.md's module recipe, copied literally, over a weight and a delayed bias."""

    def __init__(self, store: WeightGradStore, fused: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.wgrad_store, self.fused = store, fused
        mark_delayed_wgrad(self.weight)
        mark_delayed_wgrad(self.bias)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):  # type: ignore[no-untyped-def]
        register_megatron_hook(self.wgrad_store, self.weight, hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Affine.apply(x, self.weight, self.bias, self.wgrad_store, self.fused)


@pytest.mark.parametrize("fused", [False, True])
def test_a_module_with_two_delayed_parameters_is_refused_when_the_ddp_is_guarded(
    fused: bool,
) -> None:
    """Item 5, with the guard: refused at set-up, before any backward."""
    module = _DelayedWeightAndBias(WeightGradStore(), fused)
    ddp = MegatronStyleDDP(module, delay_wgrad_compute=True)
    with pytest.raises(ValueError, match=r"holds 2 delayed parameters.*its own module"):
        guard_ddp_step(ddp)


@pytest.mark.filterwarnings("ignore:a sealed W pass")
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_module_with_two_delayed_parameters_is_refused_at_w_before_anything_is_written(
    fused: bool, overlap: bool
) -> None:
    """Item 5, without the guard: the message named a missing delay_wgrad_compute (unfused), or
    came after the weight's main_grad was written (fused)."""
    store = WeightGradStore()
    module = _DelayedWeightAndBias(store, fused)
    MegatronStyleDDP(module, delay_wgrad_compute=True, overlap_grad_reduce=overlap)
    torch.tanh(module(torch.randn(2, 3, dtype=torch.float64))).pow(2).sum().backward()
    pending = store.seal()
    with pytest.raises(RuntimeError) as refusal:
        pending.run()
    message = str(refusal.value)
    assert "shape (4,)" in message and "a delayed bias next to its weight" in message
    assert "Nothing was applied" in message
    for p in (module.weight, module.bias):
        assert not p.main_grad.any() and p.grad is None  # type: ignore[attr-defined]
