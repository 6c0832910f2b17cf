"""Hooks a split backward cannot run as a fused one would: exact, or refused at B before anything
changes (a message naming the fix). Each case against a fused fp64 backward on an identical model.

Multi-grad hooks on a stage input or a parameter that span anything else; hooks registered by
hooks while B or W runs; weight-only hooks mutating their gradient in place; callbacks queued
from W's weight-only pass; saved-tensor hooks that pack a tensor as itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _hook_split import Forward
from _hook_split import assert_same as _assert_same
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import (
    CheckpointedWeights,
    SplitBackwardError,
    checkpointed_weights,
    stage_backward_input,
    stage_backward_weight,
)

pytestmark = pytest.mark.usefixtures("fp64")


def _assert_refused_at_b(forward: Forward, match: str) -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    calls: list[Any] = []
    out = forward(w, u, x, calls)
    with pytest.raises(SplitBackwardError, match=match) as info:
        stage_backward_input([out], [torch.randn(3, 4)], [x], [w, u])
    assert "stage_backward (fused)" in str(info.value)
    assert calls == [] and x.grad is None and w.grad is None and u.grad is None


def _record(calls: list[Any]) -> Callable[[Any], None]:
    def hook(grads: Any) -> None:
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        calls.append(tuple(None if t is None else t.detach().clone() for t in grads))

    return hook


# --- multi-grad hooks ------------------------------------------------------------------------


_SPANS: dict[
    str,
    Callable[
        [nn.Parameter, nn.Parameter, torch.Tensor], tuple[torch.Tensor, tuple[torch.Tensor, ...]]
    ],
] = {
    # (stage output, tensors the hook spans)
    "input and weight-only non-leaf": lambda w, u, x: (
        lambda wt: (torch.tanh(x @ wt) @ u, (x, wt))
    )(w * 2),
    "parameter and activation": lambda w, u, x: (lambda h: (h @ u, (u, h)))(torch.tanh(x @ w)),
    "parameter and weight-only non-leaf": lambda w, u, x: (
        lambda wt: (torch.tanh(x @ wt) @ u, (w, wt))
    )(w * 2),
    "input and parameter": lambda w, u, x: (torch.tanh(x @ w) @ u, (x, w)),
}


@pytest.mark.parametrize("mode", ["any", "all"])
@pytest.mark.parametrize("span", sorted(_SPANS))
def test_multi_grad_hook_on_an_input_or_parameter_spanning_anything_else_is_refused_at_b(
    span: str, mode: str
) -> None:
    """Fused: fires once with every gradient. Split: B, W's weight-only pass and W's delivery are
    separate engine passes, so it would fire twice (any) or with part of its gradients (all)."""

    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        out, tensors = _SPANS[span](w, u, x)
        torch.autograd.graph.register_multi_grad_hook(tensors, _record(calls), mode=mode)
        return out

    _assert_refused_at_b(forward, "register_multi_grad_hook spans")


@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_over_parameters_and_another_stages_parameter_is_exact(mode: str) -> None:
    """Leaves only (one of another stage, which this stage's graph never reaches): W's delivery
    runs every accumulator in one pass, as a fused backward of this stage does."""
    other = nn.Parameter(torch.randn(2))

    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        torch.autograd.graph.register_multi_grad_hook((w, u, other), _record(calls), mode=mode)
        return torch.tanh(x @ w) @ u

    _assert_same(forward)


@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_over_non_leaf_stage_inputs_only_is_exact(mode: str) -> None:
    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        return torch.tanh(x @ w) @ u

    results = []
    for split in (False, True):
        torch.manual_seed(0)
        w, u = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
        leaf = torch.randn(3, 4, requires_grad=True)
        x1, x2 = leaf * 2, leaf * 3  # non-leaf inputs (from a previous stage)
        calls: list[Any] = []
        torch.autograd.graph.register_multi_grad_hook((x1, x2), _record(calls), mode=mode)
        out = forward(w, u, x1, calls) + forward(w, u, x2, calls)
        g = torch.ones(3, 4)
        if split:
            dxs, handoff = stage_backward_input([out], [g], [x1, x2], [w, u])
            stage_backward_weight([w, u], handoff)
        else:
            dxs = torch.autograd.grad(out, [x1, x2, w, u], g)[:2]
        results.append((dxs, calls))
    (fused_dx, fused_calls), (split_dx, split_calls) = results
    assert len(fused_calls) == len(split_calls) == 1
    for a, b in zip(fused_dx, split_dx):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    for a, b in zip(fused_calls[0], split_calls[0]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


# --- hooks registered by hooks ----------------------------------------------------------------


def test_post_hook_registered_on_an_intermediate_while_b_runs_is_refused_at_b() -> None:
    """A tensor hook on the stage output puts a grad_inputs-scaling post hook on ``(x @ w)``'s
    node while B runs: it fires in B without the weight half (which W computes in another pass).
    Refused right after B's engine pass, before B returns or changes any gradient."""
    torch.manual_seed(0)
    w, u = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    pre = x @ w
    out = torch.tanh(pre) @ u
    node = pre.grad_fn
    assert node is not None
    out.register_hook(
        lambda t: (
            node.register_hook(lambda gi, go: tuple(None if a is None else a * 3 for a in gi))
            and None
        )
    )
    with pytest.raises(SplitBackwardError, match="while B ran") as info:
        stage_backward_input([out], [torch.randn(3, 4)], [x], [w, u])
    assert "stage_backward (fused)" in str(info.value)
    assert x.grad is None and w.grad is None and u.grad is None


@pytest.mark.parametrize("pass_", ["W's weight-only pass", "B's capture (checkpointed op)"])
def test_parameter_hook_registered_by_another_hook_during_a_capture_runs_once_at_delivery(
    pass_: str,
) -> None:
    """A hook registered on a parameter while a gradient is being captured at it must not run on
    the capture (it would scale the captured value, then run again at delivery)."""
    from torch.utils.checkpoint import checkpoint

    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        def register(t: torch.Tensor) -> None:
            if not calls:
                calls.append(())
                w.register_hook(lambda gw: (calls.append((gw.clone(),)), gw * 3)[1])

        if pass_ == "W's weight-only pass":
            wt = w * 2
            wt.register_hook(register)
            return torch.tanh(x @ wt) @ u
        out = checkpoint(lambda a, b: torch.tanh(a @ b), x, w, use_reentrant=False) @ u
        out.register_hook(register)
        return out

    _assert_same(forward)


def test_removing_a_hook_registered_during_a_capture_removes_it() -> None:
    """The handle of a hook registered while the parameter's hooks are set aside still works."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    handles: list[Any] = []
    fired: list[int] = []
    wt = w * 2
    wt.register_hook(lambda t: handles.append(w.register_hook(lambda g: fired.append(1))) and None)
    _, handoff = stage_backward_input([torch.tanh(x @ wt)], [torch.ones(3, 4)], [x], [w])
    stage_backward_weight([w], handoff)
    assert fired == [1]
    handles[0].remove()
    torch.tanh(x @ (w * 2)).sum().backward()
    assert fired == [1] and not w._backward_hooks


# --- in-place mutation by weight-only hooks, end-of-backward callbacks --------------------------


def test_weight_only_hook_mutating_its_gradient_in_place_leaves_b_input_gradient_alone() -> None:
    """``out = x + w * 2``: AddBackward passes one tensor to both sides; B returned it as dx."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)

    def forward() -> torch.Tensor:
        wt = w * 2
        wt.register_hook(lambda t: (t.mul_(3), None)[1])
        return x + wt

    forward().backward(g.clone())
    want_w = w.grad.clone()
    w.grad = None
    x.grad = None
    (dx,), handoff = stage_backward_input([forward()], [g.clone()], [x], [w])
    before = dx.clone()
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(dx, before, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, g, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, want_w, rtol=0, atol=1e-12)


def test_callback_queued_in_the_weight_only_pass_runs_after_delivery_once() -> None:
    from torch.autograd import Variable

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)  # a first stage: the whole graph is weight-only
    seen: list[torch.Tensor | None] = []

    def pre(mod: nn.Module, grad_output: Any) -> None:
        Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            lambda: seen.append(None if lin.weight.grad is None else lin.weight.grad.clone())
        )

    lin.register_full_backward_pre_hook(pre)
    g = torch.randn(3, 4)
    _, handoff = stage_backward_input([torch.tanh(lin(x))], [g], [x], list(lin.parameters()))
    stage_backward_weight(list(lin.parameters()), handoff)
    assert len(seen) == 1 and seen[0] is not None
    torch.testing.assert_close(seen[0], lin.weight.grad, rtol=0, atol=0)
    assert type(Variable._execution_engine).__name__ != "_Engine"  # type: ignore[attr-defined]


# --- saved-tensor hooks that pack a tensor as itself -------------------------------------------


def _packs(hooks: str) -> Any:
    from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

    if hooks == "save_on_cpu":
        return save_on_cpu()  # on a CPU tensor, tensor.cpu() is the tensor itself
    if hooks == "identity":
        return saved_tensors_hooks(lambda t: t, lambda t: t)
    if hooks == "tuple holding itself":
        return saved_tensors_hooks(lambda t: ("held", t), lambda p: p[1])
    return saved_tensors_hooks(lambda t: t.clone(), lambda t: t)  # a copy: no cycle


def _stage_with_hooks(hooks: str) -> tuple[Any, torch.Tensor, nn.Parameter, torch.Tensor]:
    import weakref

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    a = torch.tanh(x * 2)
    alive = weakref.ref(a)
    with _packs(hooks):
        h = torch.tanh(a @ w)  # tanh saves its own output through the hooks
    return alive, x, w, h.pow(2).sum()


@pytest.mark.parametrize("hooks", ["save_on_cpu", "identity", "tuple holding itself"])
def test_hooks_packing_a_nodes_own_output_as_itself_are_refused_at_b(hooks: str) -> None:
    """The output and its node keep each other alive through C++ until the engine frees the
    saved tensors: a fused backward does, a split cannot (B and W keep the graph), so every
    activation of the microbatch would stay alive after W."""
    import gc

    alive, x, w, loss = _stage_with_hooks(hooks)
    with pytest.raises(SplitBackwardError, match="pack a tensor as itself") as info:
        stage_backward_input(loss, None, [x], [w])
    assert "stage_backward (fused)" in str(info.value)
    assert x.grad is None and w.grad is None
    loss.backward()  # the fused backward the message offers frees everything
    del loss
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("split", [False, True])
def test_hooks_packing_a_copy_leave_nothing_alive_after_w(split: bool) -> None:
    import gc

    alive, x, w, loss = _stage_with_hooks("copy")
    if split:
        _, handoff = stage_backward_input(loss, None, [x], [w])
        stage_backward_weight([w], handoff)
        del handoff, _
    else:
        loss.backward()
    del loss
    gc.collect()
    assert alive() is None
    assert w.grad is not None


def _nested_callbacks(split: bool) -> list[tuple[str, torch.Tensor]]:
    """Microbatch 1's backward run from a hook of microbatch 0's; a hook in it queues a callback."""
    from torch.autograd import Variable

    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    gs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    params = list(lin.parameters())
    seen: list[tuple[str, torch.Tensor]] = []
    inner = [False]

    def queue(p: torch.Tensor) -> None:
        if inner[0]:
            Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
                lambda: seen.append(("callback", lin.weight.grad.clone()))  # type: ignore[union-attr]
            )

    lin.weight.register_post_accumulate_grad_hook(queue)
    if split:
        handoffs = [
            stage_backward_input([torch.tanh(lin(x))], [g], [x], params)[1] for x, g in zip(xs, gs)
        ]
        outer, run_inner = (
            lambda: stage_backward_weight(params, handoffs[0]),
            lambda: stage_backward_weight(params, handoffs[1]),
        )
    else:
        outs = [torch.tanh(lin(x)) for x in xs]
        outer, run_inner = (
            lambda: torch.autograd.backward([outs[0]], [gs[0]], inputs=params),
            lambda: torch.autograd.backward([outs[1]], [gs[1]], inputs=params),
        )

    def on_bias(grad: torch.Tensor) -> None:
        if not inner[0]:
            inner[0] = True
            run_inner()
            seen.append(("inner done", lin.weight.grad.clone()))  # type: ignore[union-attr]

    lin.bias.register_hook(on_bias)
    outer()
    return seen


def test_callback_queued_in_a_w_nested_in_a_hook_of_another_w_runs_when_the_nested_w_ends() -> None:
    """A W run from a hook of another W over the same parameters holds its own callbacks.

    They run when it ends, as those of a backward nested in a hook do; the outer W held them
    until its own end before, so a callback reading ``.grad`` saw the outer microbatch's too.
    """
    fused, split = _nested_callbacks(split=False), _nested_callbacks(split=True)
    assert [name for name, _ in split] == [name for name, _ in fused]
    assert [name for name, _ in fused] == ["callback", "inner done", "callback"]
    for (_, a), (_, b) in zip(split, fused):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_w_holds_its_own_callbacks_while_another_thread_runs_a_w_over_a_tied_weight() -> None:
    """Two stages sharing a weight, their Ws on two threads at once: each W runs its own callbacks.

    Stage B's W starts first and waits in a hook until stage A's W (on another thread, over the
    same tied weight) has started; the callback queued by the tied weight's hook in B's W must
    run when B's W ends, on B's thread, not be held by A's W until A ends.
    """
    import threading

    from torch.autograd import Variable

    torch.manual_seed(0)
    tied = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    lins = {name: nn.Linear(4, 4).double() for name in "AB"}
    params = {name: [tied, *lin.parameters()] for name, lin in lins.items()}
    for p in (tied, *lins["A"].parameters(), *lins["B"].parameters()):
        p.grad = torch.zeros_like(p)  # each component delivered as it is ready
    handoffs = {}
    for name, lin in lins.items():
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        out = lin(torch.tanh(x @ tied))
        handoffs[name] = stage_backward_input([out], [torch.randn_like(out)], [x], params[name])[1]
    ran: list[tuple[int, str]] = []
    current = threading.local()
    tied.register_post_accumulate_grad_hook(
        lambda p: Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            lambda name=current.name: ran.append((threading.get_ident(), name))
        )
    )
    b_waiting, a_waiting, b_done = threading.Event(), threading.Event(), threading.Event()
    returned: dict[str, list[tuple[int, str]]] = {}
    errors: list[BaseException] = []

    def block(mine: threading.Event, other: threading.Event) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            mine.set()
            if not other.wait(timeout=30):
                errors.append(TimeoutError("the other W never got there"))

        return hook

    lins["B"].weight.register_hook(block(b_waiting, a_waiting))  # delivered before the tied weight
    lins["A"].weight.register_hook(block(a_waiting, b_done))

    def w(name: str) -> None:
        current.name = name
        try:
            if name == "A" and not b_waiting.wait(timeout=30):
                raise TimeoutError("B's W never started")
            stage_backward_weight(params[name], handoffs[name])
            returned[name] = list(ran)
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)
        finally:
            if name == "B":
                b_done.set()

    threads = {name: threading.Thread(target=w, args=(name,)) for name in "BA"}
    for t in threads.values():
        t.start()
    for t in threads.values():
        t.join(timeout=60)
    assert not errors, errors
    b_thread = threads["B"].ident
    assert (b_thread, "B") in returned["B"], "B's callback had not run when B's W returned"
    assert ran.count((b_thread, "B")) == 1 and [n for _, n in ran].count("A") == 1


def _in_a_process_of_its_own(function: str) -> None:
    """Run this module's ``function()`` in a fresh interpreter: a crash there fails the test
    with its exit status instead of killing the suite.

    The child leaves with ``os._exit`` once the function has returned: torch 2.12's CUDA
    build, under load, once aborted in interpreter teardown after these threaded backwards
    ("terminate called without an active exception"), after the checks had passed; that
    teardown is not what these tests pin."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; "
        f"import faulthandler; faulthandler.dump_traceback_later(240, exit=True); "
        f"from test_pipelining_hook_edges import {function} as t; t(); "
        f"import os; print('returned', flush=True); os._exit(0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=here
    )
    assert done.returncode == 0 and "returned" in done.stdout, (
        f"exit status {done.returncode}\n{done.stdout}{done.stderr}"
    )


def test_w_on_another_thread_runs_a_tied_weights_hooks_while_b_captures_its_gradient() -> None:
    """:func:`tied_weights_hooks_while_b_captures`, in a process of its own."""
    _in_a_process_of_its_own("tied_weights_hooks_while_b_captures")


def test_b_capturing_a_tied_weight_while_another_threads_w_delivers_it_neither_crashes_nor_differs() -> (
    None
):
    """:func:`b_and_w_racing_over_a_tied_weight`, in a process of its own: it crashed (a
    segfault, or torch's ``vector::_M_range_check``) in 5 runs of 5 before B's hook stand-in
    waited for W's delivery."""
    _in_a_process_of_its_own("b_and_w_racing_over_a_tied_weight")


def b_and_w_racing_over_a_tied_weight(n: int = 800) -> None:
    """One thread runs B on checkpointed microbatches whose weight gradients B captures
    (``IN_B``), silencing the tied weight's hooks each time; the main thread meanwhile runs W on
    another stage's microbatches, delivering the tied weight through its hook. Every forward is
    made before the race (a forward on one thread beside W's delivery on another can deadlock in
    torch itself: docs/pipelining.md, Limitations). W's gradients equal those of the same W run
    with no B beside it."""
    import threading

    torch.manual_seed(0)
    tied = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    tied.register_hook(lambda g: g * 2)
    lin0, lin1 = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    one = torch.ones(3, 4, dtype=torch.float64)
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(n)]
    b_side = [
        (x, checkpoint(lambda t: torch.tanh(t @ tied), lin0(x), use_reentrant=False)) for x in xs
    ]

    def w_side() -> list[Any]:
        handoffs = []
        for x in xs:
            out = lin1(torch.tanh(x @ tied))
            handoffs.append(stage_backward_input([out], [one], [x], [tied, *lin1.parameters()])[1])
        return handoffs

    def run_w(handoffs: list[Any]) -> list[torch.Tensor]:
        grads = []
        for handoff in handoffs:
            stage_backward_weight([tied, *lin1.parameters()], handoff)
            grads.append(tied.grad.clone())  # type: ignore[union-attr]
            tied.grad = None
        return grads

    alone = run_w(w_side())
    racing_handoffs = w_side()
    errors: list[BaseException] = []

    def b_loop() -> None:
        try:
            with checkpointed_weights(CheckpointedWeights.IN_B):
                for x, out in b_side:
                    stage_backward_input([out], [one], [x], [tied, *lin0.parameters()])
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    thread = threading.Thread(target=b_loop)
    thread.start()
    try:
        racing = run_w(racing_handoffs)
    finally:
        thread.join(120)
    assert not errors, errors
    for got, want in zip(racing, alone):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def tied_weights_hooks_while_b_captures() -> None:
    """B silences the hooks of the parameters whose gradient it captures (checkpointed stage);
    another thread's W delivering one of them (a tied weight) meanwhile still runs them.

    Stage A's B blocks in a hook inside its engine call, where it captures the tied weight's
    gradient; stage B's W, run then on the main thread, delivers the tied weight: its tensor
    hook (x2) ran in neither, so ``.grad`` was half a fused backward's. (B captures weight
    gradients of checkpointed ops with ``CheckpointedWeights.IN_B``.)
    """
    import threading

    def run(concurrent: bool) -> tuple[torch.Tensor, int]:
        torch.manual_seed(0)
        tied = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
        calls: list[int] = []
        tied.register_hook(lambda g: (calls.append(1), g * 2)[1])
        lins = [nn.Linear(4, 4).double() for _ in range(2)]
        xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        gs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
        params = [[tied, *lin.parameters()] for lin in lins]
        plain = lins[1](torch.tanh(xs[1] @ tied))
        _, plain_handoff = stage_backward_input([plain], [gs[1]], [xs[1]], params[1])
        inside, release = threading.Event(), threading.Event()
        hidden = lins[0](xs[0])
        if concurrent:
            hidden.register_hook(lambda g: (inside.set(), release.wait(30), None)[2])
        out = checkpoint(lambda t: torch.tanh(t @ tied), hidden, use_reentrant=False)
        handoffs: list[Any] = []

        def b() -> None:
            with checkpointed_weights(CheckpointedWeights.IN_B):
                handoffs.append(stage_backward_input([out], [gs[0]], [xs[0]], params[0])[1])

        thread = threading.Thread(target=b)
        thread.start()
        if not concurrent:
            thread.join(30)  # alone: B has returned before W starts
        try:
            assert not concurrent or inside.wait(30), "B never reached its hook"
            stage_backward_weight(params[1], plain_handoff)  # while B captures, if concurrent
            delivered, hook_calls = tied.grad.clone(), len(calls)  # type: ignore[union-attr]
        finally:
            release.set()
            thread.join(30)
        assert handoffs and handoffs[0].num_kept > 0  # B kept the tied weight's gradient
        return delivered, hook_calls

    alone, calls_alone = run(concurrent=False)
    meanwhile, calls_meanwhile = run(concurrent=True)
    assert calls_meanwhile == calls_alone == 1
    torch.testing.assert_close(meanwhile, alone, rtol=0, atol=0)


def test_two_threads_capturing_a_tied_weight_at_once_leave_its_hooks_in_place() -> None:
    """Two checkpointed stages sharing a weight, their Bs on two threads, overlapping.

    Each B silences the weight's hooks while it captures its gradient. B on thread 1 starts,
    B on thread 2 starts, thread 1 ends first: the weight's hooks must be its own again once
    both are done (thread 2 put back what it found, thread 1's stand-in: the hook was gone
    for good), and each W runs the hook once, as two fused backwards do. (B captures weight
    gradients of checkpointed ops with ``CheckpointedWeights.IN_B``.)
    """
    import threading

    torch.manual_seed(0)
    tied = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    tied.register_hook(lambda g: g * 2)
    own_hooks = tied._backward_hooks
    lins = [nn.Linear(4, 4).double() for _ in range(2)]
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    gs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    params = [[tied, *lin.parameters()] for lin in lins]

    def forward(i: int) -> torch.Tensor:
        return checkpoint(lambda t: torch.tanh(t @ tied), lins[i](xs[i]), use_reentrant=False)

    for i in range(2):  # the fused reference
        forward(i).backward(gs[i])
    want = tied.grad.clone()  # type: ignore[union-attr]
    tied.grad = None
    for p in (*lins[0].parameters(), *lins[1].parameters()):
        p.grad = None

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    outs = [forward(0), forward(1)]
    hidden_hooks = [
        lambda g: (first_in.set(), second_in.wait(30), None)[2],
        lambda g: (second_in.set(), first_out.wait(30), None)[2],
    ]
    handoffs: dict[int, Any] = {}
    errors: list[BaseException] = []

    def b(i: int) -> None:
        try:
            if i == 1 and not first_in.wait(30):
                raise TimeoutError("the first B never started")
            outs[i].grad_fn.register_prehook(lambda grads: hidden_hooks[i](grads[0]))  # type: ignore[union-attr]
            with checkpointed_weights(CheckpointedWeights.IN_B):
                handoffs[i] = stage_backward_input([outs[i]], [gs[i]], [xs[i]], params[i])[1]
        except BaseException as exc:
            errors.append(exc)
        finally:
            if i == 0:
                first_out.set()

    threads = [threading.Thread(target=b, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert handoffs[0].num_kept > 0 and handoffs[1].num_kept > 0
    assert tied._backward_hooks is own_hooks
    for i in range(2):
        stage_backward_weight(params[i], handoffs[i])
    torch.testing.assert_close(tied.grad, want, rtol=0, atol=1e-12)


def test_b_run_from_a_tensor_hook_of_the_weight_w_delivers_captures_it_and_w_goes_on() -> None:
    """:func:`b_inside_ws_hook_of_the_same_weight`, in a process of its own (it crashed the
    process: B's stand-in freed the hook object the engine was running)."""
    _in_a_process_of_its_own("b_inside_ws_hook_of_the_same_weight")


def _checkpointed_b(tied: torch.Tensor, lin: nn.Module) -> Callable[[], Any]:
    """A checkpointed stage's forward now; its B (``IN_B``: it captures ``tied``'s gradient) later."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = checkpoint(lambda t: torch.tanh(t @ tied), lin(x), use_reentrant=False)
    g = torch.ones(3, 4, dtype=torch.float64)

    def b() -> Any:
        with checkpointed_weights(CheckpointedWeights.IN_B):
            return stage_backward_input([out], [g], [x], [tied, *lin.parameters()])[1]

    return b


def _plain_handoff(tied: torch.Tensor, lin: nn.Module) -> Any:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = lin(torch.tanh(x @ tied))
    g = torch.ones(3, 4, dtype=torch.float64)
    return stage_backward_input([out], [g], [x], [tied, *lin.parameters()])[1]


def b_inside_ws_hook_of_the_same_weight(n: int = 400) -> None:
    """W delivers a tied weight; its tensor hook (x2) runs B of another stage, which captures
    the same weight. The hooks run once each, in order, in W only; W's gradient and B's kept
    one equal the same calls made one after the other."""
    torch.manual_seed(0)
    tied = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    lin0, lin1 = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    for _ in range(n):
        _b_inside_ws_hook_once(tied, lin0, lin1)


def _b_inside_ws_hook_once(tied: nn.Parameter, lin0: nn.Module, lin1: nn.Module) -> None:
    state = torch.get_rng_state()
    pending = [_checkpointed_b(tied, lin0)]
    handoff = _plain_handoff(tied, lin1)
    calls: list[int] = []
    kept: list[Any] = []

    def first(g: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if pending:
            kept.append(pending.pop()())
        return g * 2

    handles = [tied.register_hook(first), tied.register_hook(lambda g: (calls.append(2), g)[1])]
    stage_backward_weight([tied, *lin1.parameters()], handoff)
    assert calls == [1, 2], calls
    inside = tied.grad.clone()  # type: ignore[union-attr]
    tied.grad = None
    stage_backward_weight([tied, *lin0.parameters()], kept[0])
    later = tied.grad.clone()  # type: ignore[union-attr]
    # The same calls, one after the other.
    torch.set_rng_state(state)
    b = _checkpointed_b(tied, lin0)
    handoff = _plain_handoff(tied, lin1)
    tied.grad = None
    stage_backward_weight([tied, *lin1.parameters()], handoff)
    assert torch.equal(tied.grad, inside)  # type: ignore[arg-type]
    tied.grad = None
    stage_backward_weight([tied, *lin0.parameters()], b())
    assert torch.equal(tied.grad, later)  # type: ignore[arg-type]
    for h in handles:
        h.remove()
    tied.grad = None


def test_ws_on_two_threads_whose_hooks_run_b_over_each_others_weight_both_finish() -> None:
    """:func:`crossed_hooks_running_b`, in a process of its own (B waited for the other
    thread's delivery, each thread for the other: a deadlock)."""
    _in_a_process_of_its_own("crossed_hooks_running_b")


def crossed_hooks_running_b() -> None:
    """Thread 1's W delivers X, whose hook runs B capturing Y; thread 2's W delivers Y, whose
    hook runs B capturing X; a barrier makes both hooks run at once."""
    import threading

    torch.manual_seed(0)
    xw, yw = (nn.Parameter(torch.randn(4, 4, dtype=torch.float64)) for _ in range(2))
    lin = nn.Linear(4, 4).double()
    barrier = threading.Barrier(2, timeout=30)
    kept: list[Any] = []

    def running_b(other: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        b = _checkpointed_b(other, lin)

        def hook(g: torch.Tensor) -> torch.Tensor:
            barrier.wait()
            kept.append(b())
            return g

        return hook

    xw.register_hook(running_b(yw))
    yw.register_hook(running_b(xw))
    stages = [(p, nn.Linear(4, 4).double()) for p in (xw, yw)]
    handoffs = [_plain_handoff(p, lin_) for p, lin_ in stages]
    errors: list[BaseException] = []

    def w(k: int) -> None:
        p, lin_ = stages[k]
        try:
            stage_backward_weight([p, *lin_.parameters()], handoffs[k])
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=w, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a W never finished"
    assert not errors, errors
    assert len(kept) == 2 and all(h.num_kept > 0 for h in kept)
    assert xw.grad is not None and yw.grad is not None
