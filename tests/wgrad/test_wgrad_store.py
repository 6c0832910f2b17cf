"""End to end: six configurations under Megatron-style DDP, and the store's lifecycle."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gradsafe.wgrad import WeightGradStore, grad_lifetime_is_managed, mark_delayed_wgrad
from gradsafe.wgrad._hazards import CONFIGS, Config, check_config, reference, repro_linear


@pytest.fixture(scope="module")
def ref():  # type: ignore[no-untyped-def]
    return reference(microbatches=4)


def test_reference_is_not_trivial(ref) -> None:  # type: ignore[no-untyped-def]
    # Four microbatches: each hook fires four times, main_grad is nonzero.
    assert [len(calls) for calls in ref.calls] == [4, 4, 4]
    assert all(g.abs().sum() > 0 for g in ref.main_grads)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_six_configurations_match_plain_autograd(config: Config, ref) -> None:  # type: ignore[no-untyped-def]
    assert check_config(config, ref=ref) == []


def fused_linear(x, w, *, accumulate_into_main_grad=False, wgrad_store=None):  # type: ignore[no-untyped-def]
    return repro_linear(x, w, fuse=accumulate_into_main_grad, store=wgrad_store)


def test_w_on_another_thread_fires_hooks_there() -> None:
    """W may run on a side thread: the hooks run on the thread that ran W."""
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(3, 2))
    w.main_grad = torch.zeros_like(w)
    threads: list[int] = []
    store.register_grad_ready_hook(w, lambda p: threads.append(threading.get_ident()))
    fused_linear(
        torch.randn(4, 2), w, accumulate_into_main_grad=True, wgrad_store=store
    ).sum().backward()
    pending = store.seal()
    worker = threading.Thread(target=pending.run)
    worker.start()
    worker.join(timeout=60)
    assert threads == [worker.ident]


def test_w_accumulates_into_existing_grad_never_overwrites() -> None:
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(3, 2))
    x = torch.randn(4, 2)
    w.grad = torch.full_like(w, 5.0)
    fused_linear(x, w, wgrad_store=store).sum().backward()
    assert bool((w.grad == 5.0).all())  # B leaves .grad alone
    store.seal().run()
    expected = torch.ones(4, 3).t() @ x
    torch.testing.assert_close(w.grad, expected + 5.0)


def test_tied_weight_hook_fires_once_after_both_uses() -> None:
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(3, 3))
    seen: list[torch.Tensor] = []
    store.register_grad_ready_hook(w, lambda p: seen.append(p.grad.clone()))
    x = torch.randn(2, 3)
    fused_linear(fused_linear(x, w, wgrad_store=store), w, wgrad_store=store).sum().backward()
    pending = store.seal()
    assert len(pending) == 2 and seen == []  # nothing fires during B
    pending.run()
    w_ref = w.detach().clone().requires_grad_()
    ((x @ w_ref.t()) @ w_ref.t()).sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], w_ref.grad)


def test_removed_hook_does_not_fire() -> None:
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(2, 2))
    calls: list[int] = []
    handle = store.register_grad_ready_hook(w, lambda p: calls.append(1))
    handle.remove()
    fused_linear(torch.randn(1, 2), w, wgrad_store=store).sum().backward()
    store.seal().run()
    assert calls == []


def test_lifecycle_errors_name_the_cause() -> None:
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(2, 2))
    fused_linear(torch.randn(1, 2), w, wgrad_store=store).sum().backward()
    pending = store.seal()
    assert not pending.done
    pending.run()
    assert pending.done
    with pytest.raises(RuntimeError, match="runs exactly once"):
        pending.run()
    assert len(store.seal()) == 0  # the store was emptied by seal(), not by run()

    store.record(w, lambda mg: None, accumulate_into_main_grad=True)
    with pytest.raises(RuntimeError, match="no main_grad at W time"):
        store.seal().run()

    w.main_grad = torch.zeros(2, 2)
    store.record(w, lambda mg: torch.ones(2, 2), accumulate_into_main_grad=True)
    with pytest.raises(RuntimeError, match="return None"):
        store.seal().run()
    store.record(w, lambda mg: torch.ones(3), accumulate_into_main_grad=False)
    failed = store.seal()
    with pytest.raises(RuntimeError, match=r"of shape \(2, 2\)"):
        failed.run()
    with pytest.raises(RuntimeError, match="failed part-way"):
        failed.run()


def test_run_from_two_threads_runs_the_pass_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both threads used to pass the "not run yet" check (a W executor pool, a
    # retry from another thread): both ran the pass, adding its gradients twice or
    # overwriting one another, silently.
    # The pre-run check is slowed down to hold both threads in that window.
    from gradsafe.wgrad._store import PendingWeightGrads

    check = PendingWeightGrads._refuse_gradients_no_hook_would_take

    def slow_check(self: PendingWeightGrads) -> None:
        time.sleep(0.05)
        check(self)

    monkeypatch.setattr(PendingWeightGrads, "_refuse_gradients_no_hook_would_take", slow_check)
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    store = WeightGradStore()
    store.record(w, lambda _: torch.ones(2, dtype=torch.float64), accumulate_into_main_grad=False)
    pending = store.seal()
    start = threading.Barrier(2)
    refused: list[RuntimeError] = []

    def run() -> None:
        start.wait()
        try:
            pending.run()
        except RuntimeError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert w.grad is not None
    assert w.grad.tolist() == [1.0, 1.0]
    assert len(refused) == 1 and "runs exactly once" in str(refused[0])


def test_markers() -> None:
    store = WeightGradStore()
    te_param = torch.nn.Parameter(torch.randn(2))
    te_param.skip_backward_post_hook = True  # TransformerEngine's marker
    assert grad_lifetime_is_managed(te_param)
    p = torch.nn.Parameter(torch.randn(2))
    assert not grad_lifetime_is_managed(p)
    mark_delayed_wgrad(p)
    assert grad_lifetime_is_managed(p)
    q = torch.nn.Parameter(torch.randn(2, 2))
    store.record(q, lambda mg: torch.zeros(2, 2), accumulate_into_main_grad=False)
    assert grad_lifetime_is_managed(q)
    r = torch.nn.Parameter(torch.randn(2, 2))
    store.register_grad_ready_hook(r, lambda _: None)
    assert grad_lifetime_is_managed(r)


def test_fused_and_unfused_uses_in_one_b_pass_both_arrive() -> None:
    """One W pass: fused uses go into main_grad, unfused ones into .grad, and the flag says .grad is not in main_grad."""
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    w.main_grad = torch.zeros(2, 2, dtype=torch.float64)
    w.grad_added_to_main_grad = True  # stale, from an earlier fused-only microbatch

    def fused(main_grad):  # type: ignore[no-untyped-def]
        main_grad.add_(1.0)

    seen: list[tuple[float, float, bool]] = []
    store.register_grad_ready_hook(
        w,
        lambda p: seen.append(
            (p.main_grad[0, 0].item(), p.grad[0, 0].item(), p.grad_added_to_main_grad)
        ),
    )
    store.record(w, fused, accumulate_into_main_grad=True)
    store.record(
        w, lambda mg: torch.full((2, 2), 2.0, dtype=torch.float64), accumulate_into_main_grad=False
    )
    store.seal().run()
    assert seen == [(1.0, 2.0, False)]  # the hook adds .grad: nothing is counted twice or lost


def test_w_refuses_an_unfused_gradient_no_hook_would_move_into_main_grad() -> None:
    """Megatron-core without delay_wgrad_compute (or without the module's hook method) leaves W's .grad behind."""
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    w.main_grad = torch.zeros(2, 2, dtype=torch.float64)
    w.grad_added_to_main_grad = False
    store.record(
        w, lambda mg: torch.ones(2, 2, dtype=torch.float64), accumulate_into_main_grad=False
    )
    pending = store.seal()
    with pytest.raises(RuntimeError, match="delay_wgrad_compute=True"):
        pending.run()
    assert w.grad is None  # refused before anything was applied: the pass can still run
    store.register_grad_ready_hook(w, lambda p: p.main_grad.add_(p.grad))
    pending.run()
    assert bool((w.main_grad == 1.0).all())


def _sgd_step_in_backward(params, lr: float):  # type: ignore[no-untyped-def]
    optimizers = {p: torch.optim.SGD([p], lr=lr) for p in params}

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    return step


def _tied_params() -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    first = torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64) / 2)
    tied = torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64) / 2)
    return first, tied


def _forward(params, x, linear):  # type: ignore[no-untyped-def]
    first, tied = params
    return linear(torch.tanh(linear(torch.tanh(linear(x, first)), tied)), tied).pow(2).sum()


def _optimizer_in_backward(
    delayed: bool, use_post_accumulate_hook: bool
) -> tuple[torch.Tensor, ...]:
    store = WeightGradStore() if delayed else None
    params = _tied_params()
    step = _sgd_step_in_backward(params, lr=0.1)
    for p in params:
        if store is None:
            p.register_post_accumulate_grad_hook(step)
        else:
            store.register_grad_ready_hook(p, step)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(2, 3, generator=g, dtype=torch.float64)
        _forward(params, x, lambda a, w: fused_linear(a, w, wgrad_store=store)).backward()
        if store is not None:
            store.seal().run()
    return tuple(p.detach().clone() for p in params)


def _optimizer_after_backward() -> tuple[torch.Tensor, ...]:
    params = _tied_params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(2, 3, generator=g, dtype=torch.float64)
        _forward(params, x, lambda a, w: a @ w.t()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return tuple(p.detach().clone() for p in params)


def test_optimizer_in_backward_post_accumulate_grad_hook() -> None:
    """Undelayed: torch's post-accumulate-grad hook steps each weight once, tied included."""
    expected = _optimizer_after_backward()
    for got, want in zip(_optimizer_in_backward(False, True), expected):
        torch.testing.assert_close(got, want)


def test_optimizer_in_backward_delayed_uses_the_store_hook() -> None:
    """Delayed: the same optimizer step registered with the store runs at W."""
    expected = _optimizer_after_backward()
    for got, want in zip(_optimizer_in_backward(True, False), expected):
        torch.testing.assert_close(got, want)


def test_a_pass_failing_part_way_leaves_what_docs_wgrad_describes() -> None:
    """docs/wgrad.md, "When a W pass fails part-way": parameters before the failing one are
    complete (hooks fired), the failing one keeps the fused uses added before the failure and
    gets nothing into .grad, no hook of it fires, later parameters are untouched."""
    store = WeightGradStore()
    done, failing, later = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    for p in (done, failing, later):
        p.main_grad = torch.zeros(2)
    fired: list[str] = []
    for name, p in (("done", done), ("failing", failing), ("later", later)):
        store.register_grad_ready_hook(p, lambda _p, name=name: fired.append(name))

    def add(value: float):  # type: ignore[no-untyped-def]
        return lambda mg: (mg.add_(value), None)[1]

    def boom(mg: torch.Tensor | None) -> torch.Tensor:
        raise ValueError("kernel failed")

    store.record(done, add(1.0), accumulate_into_main_grad=True)
    store.record(failing, add(2.0), accumulate_into_main_grad=True)
    store.record(failing, boom, accumulate_into_main_grad=True)
    store.record(failing, lambda mg: torch.ones(2), accumulate_into_main_grad=False)
    store.record(later, add(3.0), accumulate_into_main_grad=True)
    pending = store.seal()
    with pytest.raises(ValueError, match="kernel failed"):
        pending.run()
    assert fired == ["done"]
    assert torch.equal(done.main_grad, torch.ones(2))
    assert torch.equal(failing.main_grad, torch.full((2,), 2.0)) and failing.grad is None
    assert torch.equal(later.main_grad, torch.zeros(2)) and later.grad is None
    with pytest.raises(RuntimeError, match="failed part-way"):
        pending.run()
