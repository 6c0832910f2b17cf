"""gradsafe.testing.MegatronStyleDDP: Megatron-style main_grad, flag and hooks, checked against plain autograd."""

from __future__ import annotations

import threading

import pytest
import torch

from gradsafe.testing import MegatronStyleDDP
from gradsafe.wgrad import WeightGradStore, mark_delayed_wgrad


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
    ddp = MegatronStyleDDP(params)
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
    ddp.zero_grad()
    assert all(ddp.calls(p) == () and not p.main_grad.any() for p in params)


def test_flag_set_means_the_hook_adds_nothing() -> None:
    params = _model()
    ddp = MegatronStyleDDP(params)
    params[0].grad_added_to_main_grad = True
    _loss(params, torch.randn(2, 3, dtype=torch.float64)).backward()
    assert not params[0].main_grad.any() and params[1].main_grad.any()
    assert len(ddp.calls(params[0])) == 1


def test_low_precision_parameters_get_fp32_main_grad() -> None:
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    MegatronStyleDDP([p])
    assert p.main_grad.dtype == torch.float32


def test_no_flag_unless_asked() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    MegatronStyleDDP([p], grad_added_flag=False)
    assert not hasattr(p, "grad_added_to_main_grad")


def test_delayed_parameters_are_hooked_through_the_store() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    mark_delayed_wgrad(p)
    with pytest.raises(ValueError, match="pass store="):
        MegatronStyleDDP([p])
    store = WeightGradStore()
    ddp = MegatronStyleDDP([p], store)
    (p * 2.0).sum().backward()  # not through the store: AccumulateGrad is not hooked
    assert ddp.calls(p) == () and p.grad is not None
    store.record(p, lambda mg: torch.ones(3), accumulate_into_main_grad=False)
    store.seal().run()
    assert len(ddp.calls(p)) == 1 and p.grad is None
    torch.testing.assert_close(p.main_grad, torch.full((3,), 3.0))


def test_remove_unhooks() -> None:
    params = _model()
    ddp = MegatronStyleDDP(params)
    ddp.remove()
    _loss(params, torch.randn(2, 3, dtype=torch.float64)).backward()
    assert all(p.grad is not None and not p.main_grad.any() for p in params)
