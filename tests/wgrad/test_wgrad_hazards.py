"""The wrong approaches the policy avoids: each one fails the same end-to-end check."""

from __future__ import annotations

import pytest
import torch

from gradsafe.wgrad import WeightGradStore, wgrad_return
from gradsafe.wgrad._hazards import (
    TE_KERNEL,
    Config,
    TEStyleStore,
    check_config,
    compare,
    kernel_with,
    reference,
    repro_linear,
    run_config,
)

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke

NOW_FUSED_FLAG = Config(delayed=False, fused=True, has_flag=True)
NOW_FUSED_NO_FLAG = Config(delayed=False, fused=True, has_flag=False)
DELAYED_UNFUSED = Config(delayed=True, fused=False, has_flag=False)
DELAYED_FUSED_FLAG = Config(delayed=True, fused=True, has_flag=True)


@pytest.fixture(scope="module")
def ref():  # type: ignore[no-untyped-def]
    return reference(microbatches=4)


def _return_main_grad_view(param, wgrad, *, accumulate_into_main_grad, delayed):  # type: ignore[no-untyped-def]
    if accumulate_into_main_grad and not delayed:
        return param.main_grad.view_as(param.main_grad)
    return wgrad_return(
        param, wgrad, accumulate_into_main_grad=accumulate_into_main_grad, delayed=delayed
    )


def _return_none_when_fused(param, wgrad, *, accumulate_into_main_grad, delayed):  # type: ignore[no-untyped-def]
    if accumulate_into_main_grad:
        return None
    return wgrad_return(
        param, wgrad, accumulate_into_main_grad=accumulate_into_main_grad, delayed=delayed
    )


def _wrong(problems: list[str], name: str) -> bool:
    return any(p.startswith(f"{name}: main_grad wrong") for p in problems)


def test_live_view_of_main_grad_double_accumulates(ref) -> None:  # type: ignore[no-untyped-def]
    problems = check_config(NOW_FUSED_NO_FLAG, ref=ref, kernel=kernel_with(_return_main_grad_view))
    assert _wrong(problems, "w1")


def test_none_despite_the_flag_leaves_the_hook_without_grad(ref) -> None:  # type: ignore[no-untyped-def]
    # Megatron asserts here ("param.grad being None is not safe").
    problems = check_config(NOW_FUSED_FLAG, ref=ref, kernel=kernel_with(_return_none_when_fused))
    assert "w1: hook saw .grad None" in problems


def test_delayed_w_that_assigns_grad_loses_a_tied_use(ref) -> None:  # type: ignore[no-untyped-def]
    problems = check_config(DELAYED_UNFUSED, ref=ref, kernel=TE_KERNEL, store_factory=TEStyleStore)
    assert _wrong(problems, "w2 (tied)")
    assert not _wrong(problems, "w1")  # untied weights hide the bug


def test_te_policy_is_right_elsewhere(ref) -> None:  # type: ignore[no-untyped-def]
    for config in (NOW_FUSED_FLAG, DELAYED_FUSED_FLAG):
        assert check_config(config, ref=ref, kernel=TE_KERNEL, store_factory=TEStyleStore) == []


@pytest.mark.parametrize("config", [DELAYED_UNFUSED, DELAYED_FUSED_FLAG], ids=str)
def test_hooking_accumulategrad_of_delayed_params_fires_early(config: Config, ref) -> None:  # type: ignore[no-untyped-def]
    """The weight slot returns None in B, yet AccumulateGrad's hooks run there: too early."""
    run = run_config(config, mark_before_ddp=False)
    problems = compare(run, ref, hooks_see_grad=(True, True, True))
    assert "w1: hook saw .grad None" in problems
    assert any(p.startswith("w2 (tied): ") for p in problems)


def test_post_accumulate_grad_hook_on_delayed_param_fires_in_b_with_none() -> None:
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(3, 2))
    seen: list[bool] = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is None))
    repro_linear(torch.randn(4, 2), w, fuse=False, store=store).sum().backward()
    assert seen == [True]  # fired in B, gradient not there: an optimizer step here is lost
    store.seal().run()
    assert seen == [True]  # and never again when the gradient arrives


def test_shared_buffer_as_grad_leaks_into_other_params() -> None:
    """Why W sets a fresh zero .grad for hooks, not a cached one."""
    shared = torch.zeros(2, 2)
    p, q = torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(torch.randn(2, 2))
    p.grad, q.grad = shared, shared  # the wrong approach
    (p * 3.0).sum().backward()  # AccumulateGrad adds in place into p.grad
    assert bool((q.grad == 3.0).all())  # q received p's gradient

    store = WeightGradStore()
    for param in (p, q):
        param.grad = None
        store.register_grad_ready_hook(param, lambda _: None)  # a hook that keeps .grad
        store.record(param, lambda mg: None, accumulate_into_main_grad=True)
        param.main_grad = torch.zeros(2, 2)
    store.seal().run()
    (p * 3.0).sum().backward()
    assert bool((q.grad == 0.0).all())


def test_running_accumulategrad_again_at_w_fires_its_hooks_twice() -> None:
    """Why W fires store-registered hooks instead of re-running AccumulateGrad (GradientEdge)."""
    from torch.autograd.graph import get_gradient_edge

    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(3, 2))
    node = w.expand_as(w).grad_fn.next_functions[0][0]
    saw_grad: list[bool] = []
    node.register_hook(lambda _gi, _go: saw_grad.append(w.grad is not None))
    x = torch.randn(4, 2)
    repro_linear(x, w, fuse=False, store=store).sum().backward()  # B: slot returns None
    store.seal()  # (W's closures are not needed for this demonstration)
    torch.autograd.backward([get_gradient_edge(w)], [torch.ones(4, 3).t() @ x])
    assert saw_grad == [False, True]  # once in B without a gradient, once more at W
