"""gradsafe.testing.MegatronStyleDDP: Megatron-core's main_grad, flag, hooks and their routing, against plain autograd.

Each behaviour pinned here was read in megatron-core 0.19.2 and is run side by side with
the real DistributedDataParallel in test_megatron_real.py."""

from __future__ import annotations

import threading

import pytest
import torch

from gradsafe.testing import MegatronStyleDDP, module_of
from gradsafe.wgrad import (
    PendingWeightGrads,
    WeightGradStore,
    mark_delayed_wgrad,
    register_megatron_hook,
)


def _model() -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64)),
        torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64)),
    )


def _loss(params, x):  # type: ignore[no-untyped-def]
    w, b = params
    return torch.tanh(x @ w.t() + b).pow(2).sum()


def test_hooks_accumulate_every_microbatch_into_main_grad() -> None:
    params = _model()
    ddp = MegatronStyleDDP(module_of(params))
    xs = [torch.randn(2, 3, dtype=torch.float64) for _ in range(3)]
    for x in xs:
        _loss(params, x).backward()
    ref = [p.detach().clone().requires_grad_() for p in params]
    for x in xs:
        _loss(ref, x).backward()
    for p, r in zip(params, ref):
        assert p.grad is None  # the hook cleared it
        assert p.grad_added_to_main_grad is False
        torch.testing.assert_close(p.main_grad, r.grad)
        calls = ddp.calls(p)
        assert len(calls) == 3
        assert all(c.thread == threading.get_ident() and not c.grad_was_none for c in calls)
        torch.testing.assert_close(calls[-1].main_grad_after, r.grad)
    ddp.zero_grad_buffer()
    assert all(ddp.calls(p) == () and not p.main_grad.any() for p in params)


def test_flag_set_means_the_hook_adds_nothing() -> None:
    params = _model()
    ddp = MegatronStyleDDP(module_of(params))
    params[0].grad_added_to_main_grad = True
    _loss(params, torch.randn(2, 3, dtype=torch.float64)).backward()
    assert not params[0].main_grad.any() and params[1].main_grad.any()
    assert len(ddp.calls(params[0])) == 1


def test_zero_out_wgrad_makes_the_hook_add_despite_the_flag() -> None:
    params = _model()
    MegatronStyleDDP(module_of(params))
    params[0].grad_added_to_main_grad = True
    params[0].zero_out_wgrad = True
    _loss(params, torch.randn(2, 3, dtype=torch.float64)).backward()
    assert params[0].main_grad.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_main_grad_is_fp32_only_with_grad_reduce_in_fp32(dtype: torch.dtype) -> None:
    p, q = (
        torch.nn.Parameter(torch.randn(3, dtype=dtype)),
        torch.nn.Parameter(torch.randn(3, dtype=dtype)),
    )
    MegatronStyleDDP(module_of([p]))
    MegatronStyleDDP(module_of([q]), grad_reduce_in_fp32=True)
    assert p.main_grad.dtype == dtype
    assert q.main_grad.dtype == torch.float32  # fp64 too: Megatron's grad dtype is torch.float


def test_no_flag_unless_asked() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    MegatronStyleDDP(module_of([p]), grad_added_flag=False)
    assert not hasattr(p, "grad_added_to_main_grad")


def test_zero_grad_buffer_keeps_a_stale_grad() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    ddp = MegatronStyleDDP(module_of([p]))
    p.grad_added_to_main_grad = True
    p.grad = torch.ones(3)
    ddp.zero_grad_buffer()
    assert p.grad is not None and p.grad_added_to_main_grad is False and not p.main_grad.any()


def test_overlap_grad_reduce_asserts_on_grad_none() -> None:
    """A delayed weight hooked at AccumulateGrad (not routed) meets .grad None in B: Megatron's AssertionError."""
    from gradsafe.wgrad._hazards import repro_linear

    p, w = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 3))
    ddp = MegatronStyleDDP(module_of([p, w]), overlap_grad_reduce=True)
    (p * 2.0).sum().backward()
    assert len(ddp.calls(p)) == 1
    with pytest.raises(
        AssertionError,
        match="param.grad being None is not safe when overlap_grad_reduce is True",
    ):
        repro_linear(torch.randn(4, 3), w, fuse=False, store=WeightGradStore()).sum().backward()


@pytest.mark.parametrize("delay_wgrad_compute", [False, True])
@pytest.mark.parametrize("offers_method", [False, True])
@pytest.mark.parametrize("marked", [False, True])
def test_delayed_routing_needs_all_three_conditions(
    marked: bool, offers_method: bool, delay_wgrad_compute: bool
) -> None:
    """Module route only with skip_backward_post_hook, delay_wgrad_compute and a module offering the method."""
    store = WeightGradStore()
    p = torch.nn.Parameter(torch.randn(3))
    if marked:
        mark_delayed_wgrad(p)
    module = module_of([p], store) if offers_method else torch.nn.ParameterList([p])
    ddp = MegatronStyleDDP(module, delay_wgrad_compute=delay_wgrad_compute)
    (p * 2.0).sum().backward()
    routed_to_module = marked and delay_wgrad_compute
    if routed_to_module and not offers_method:
        assert ddp.calls(p) == () and p.grad is not None  # Megatron hooks nothing at all
    else:
        # AccumulateGrad's hook, or (module route) the undelayed gradient no W awaits
        # fires the module's hook from the post-accumulate-grad hook.
        assert len(ddp.calls(p)) == 1 and p.grad is None
    p.grad = None
    p.main_grad.zero_()  # only W's gradient counts below
    store.record(p, lambda mg: torch.ones(3), accumulate_into_main_grad=False)
    if routed_to_module and not offers_method:
        # Megatron hooks nothing at all: W's .grad would never reach main_grad. gradsafe refuses.
        with pytest.raises(RuntimeError, match="register_wgrad_accumulation_and_reduce_hooks"):
            store.seal().run()
        return
    if not routed_to_module:
        with pytest.raises(RuntimeError, match="delay_wgrad_compute=True"):
            store.seal().run()
        return
    store.seal().run()
    assert len(ddp.calls(p)) == 2 and p.grad is None
    torch.testing.assert_close(p.main_grad, torch.ones(3))


def test_a_tied_weight_in_two_modules_gets_one_delayed_hook() -> None:
    """Megatron registers per module that holds the weight; gradsafe keeps one hook per parameter."""
    store = WeightGradStore()
    p = torch.nn.Parameter(torch.randn(3))
    mark_delayed_wgrad(p)
    two_modules = torch.nn.ModuleList([module_of([p], store), module_of([p], store)])
    ddp = MegatronStyleDDP(two_modules, delay_wgrad_compute=True, overlap_grad_reduce=True)
    store.record(p, lambda mg: torch.ones(3), accumulate_into_main_grad=False)
    store.record(p, lambda mg: torch.ones(3), accumulate_into_main_grad=False)
    store.seal().run()
    assert len(ddp.calls(p)) == 1
    torch.testing.assert_close(p.main_grad, torch.full((3,), 2.0))


def test_remove_unhooks() -> None:
    params = _model()
    ddp = MegatronStyleDDP(module_of(params))
    ddp.remove()
    _loss(params, torch.randn(2, 3, dtype=torch.float64)).backward()
    assert all(p.grad is not None and not p.main_grad.any() for p in params)


class _DelayedAffine(torch.autograd.Function):
    """``x @ w.T + b``; ``w``'s gradient delayed unfused (W adds it into ``.grad``), ``b``'s fused or not delayed."""

    @staticmethod
    def forward(ctx, x, w, b, store, delay_bias):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        ctx.w, ctx.b, ctx.store, ctx.delay_bias = w, b, store, delay_bias
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        ctx.store.record(ctx.w, lambda _: g.t() @ x, accumulate_into_main_grad=False)
        if not ctx.delay_bias:
            return g @ ctx.w, None, g.sum(0), None, None

        def bias_into_main_grad(main_grad: torch.Tensor | None) -> None:
            assert main_grad is not None
            main_grad.add_(g.sum(0))

        ctx.store.record(ctx.b, bias_into_main_grad, accumulate_into_main_grad=True)
        return g @ ctx.w, None, None, None, None


class _DelayedLinear(torch.nn.Module):
    """docs/wgrad.md's module recipe, copied literally; ``delay_bias``: the bias is delayed too."""

    def __init__(self, store: WeightGradStore, *, delay_bias: bool) -> None:
        super().__init__()
        self.weight, self.bias = _model()
        self.wgrad_store = store
        self.delay_bias = delay_bias
        mark_delayed_wgrad(self.weight)
        if delay_bias:
            mark_delayed_wgrad(self.bias)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):  # type: ignore[no-untyped-def]
        register_megatron_hook(self.wgrad_store, self.weight, hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DelayedAffine.apply(x, self.weight, self.bias, self.wgrad_store, self.delay_bias)


def _delayed_linear_main_grads(delay_bias: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two microbatches (W after each B) under MegatronStyleDDP, and plain fp64 autograd."""
    store = WeightGradStore()
    module = _DelayedLinear(store, delay_bias=delay_bias)
    MegatronStyleDDP(module, delay_wgrad_compute=True)
    ref = [p.detach().clone().requires_grad_() for p in (module.weight, module.bias)]
    for _ in range(2):
        x = torch.randn(2, 3, dtype=torch.float64)
        torch.tanh(module(x)).pow(2).sum().backward()
        store.seal().run()
        _loss(ref, x).backward()
    return [module.weight.main_grad, module.bias.main_grad], [r.grad for r in ref]


def test_a_module_delaying_its_bias_too_is_refused_at_w() -> None:
    # DDP hands the module one hook per delayed parameter; the recipe registers
    # both for the weight, the bias's replacing the weight's. Silently, the
    # weight's W gradient then stayed in .grad (main_grad 100 % off, fp64).
    with pytest.raises(RuntimeError, match="a delayed bias next to its weight"):
        _delayed_linear_main_grads(delay_bias=True)


class _RegistersFor(torch.nn.Module):
    """Holds ``own`` and offers Megatron's method, but registers the hook it gets for ``other``."""

    def __init__(self, own: torch.nn.Parameter, store: WeightGradStore) -> None:
        super().__init__()
        self.own, self.store = own, store
        self.other: torch.Tensor | None = None
        mark_delayed_wgrad(own)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):  # type: ignore[no-untyped-def]
        assert self.other is not None
        register_megatron_hook(self.store, self.other, hook)


def test_a_megatron_hook_serving_another_parameter_is_refused_at_w() -> None:
    """Two modules registering each other's hook: every delayed parameter has one, each the wrong one."""
    store = WeightGradStore()
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    a, b = _RegistersFor(p, store), _RegistersFor(q, store)
    a.other, b.other = q, p
    MegatronStyleDDP(torch.nn.ModuleList([a, b]), delay_wgrad_compute=True)
    store.record(p, lambda _: torch.ones(3), accumulate_into_main_grad=False)
    with pytest.raises(RuntimeError, match="serves another parameter"):
        store.seal().run()


def test_one_delayed_parameter_per_module_is_exact() -> None:
    got, expected = _delayed_linear_main_grads(delay_bias=False)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


class _TiedHead(torch.autograd.Function):
    """``h @ w.T`` whose weight gradient W computes unfused; ``fail`` makes that computation raise."""

    @staticmethod
    def forward(ctx, h, w, store, fail):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(h, w)
        ctx.store, ctx.fail = store, fail
        return h @ w.t()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        h, w = ctx.saved_tensors

        def compute(_: torch.Tensor | None) -> torch.Tensor:
            if ctx.fail:
                raise MemoryError("W ran out of memory")
            return g.t() @ h

        ctx.store.record(w, compute, accumulate_into_main_grad=False)
        return g @ w, None, None, None


@pytest.mark.parametrize("recovery", ["as named", "zero_grad_buffer only"])
def test_a_failed_pass_names_a_recovery_that_clears_grad(recovery: str) -> None:
    # A tied weight: the embedding's undelayed gradient waits in .grad for W's
    # hook; W fails. Megatron's zero_grad_buffer() keeps that .grad, so the
    # redone step would add it again: the retry error names clearing .grad.
    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    mark_delayed_wgrad(w)
    store = WeightGradStore()
    ddp = MegatronStyleDDP(module_of([w], store), delay_wgrad_compute=True)
    x = torch.randn(2, 4, dtype=torch.float64)

    def step(fail: bool) -> PendingWeightGrads:
        _TiedHead.apply(torch.tanh(x @ w.t()), w, store, fail).pow(2).sum().backward()
        return store.seal()

    failed = step(True)
    with pytest.raises(MemoryError):
        failed.run()
    with pytest.raises(RuntimeError, match=r"set every parameter's \.grad to None"):
        failed.run()
    if recovery == "as named":
        w.grad = None
    ddp.zero_grad_buffer()
    step(False).run()
    ref = w.detach().clone().requires_grad_()
    (torch.tanh(x @ ref.t()) @ ref.t()).pow(2).sum().backward()
    error = (w.main_grad - ref.grad).abs().max().item()
    assert (error < 1e-12) if recovery == "as named" else (error > 1.0)
