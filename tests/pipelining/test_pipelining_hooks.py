"""Parameter hooks fire in W exactly as in a fused backward: once, complete, never in B."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _hook_split import PassThrough
from _hook_split import assert_same as _assert_same
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight


class Sandwich(nn.Module):
    """A Linear reused around another Linear, plus a tied head: overlapping uses."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4, bias=False)
        self.ln = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.outer(torch.tanh(self.inner(self.outer(x))))
        return self.ln(h) @ self.inner.weight.t() + self.outer.bias


def _reference(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    out = model(x)
    grads = torch.autograd.grad(out, list(model.parameters()), g)
    return {n: gr for (n, _), gr in zip(model.named_parameters(), grads)}


def _split(model: nn.Module, x: torch.Tensor, g: torch.Tensor, phase: list[str]) -> None:
    phase[0] = "B"
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    phase[0] = "W"
    stage_backward_weight(model.parameters(), handoff)
    phase[0] = "after"


def test_tensor_post_accumulate_and_node_hooks_fire_once_in_w_with_complete_grads() -> None:
    torch.manual_seed(0)
    model = Sandwich().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    want = _reference(model, x, g)
    phase = ["setup"]
    events: list[tuple[str, str, str]] = []
    seen_tensor: dict[str, torch.Tensor] = {}
    grad_accs = []
    for name, p in model.named_parameters():

        def tensor_hook(grad: torch.Tensor, name: str = name) -> None:
            events.append(("tensor", name, phase[0]))
            seen_tensor[name] = grad.clone()

        def post_acc(p: torch.Tensor, name: str = name) -> None:
            events.append(("post_accumulate", name, phase[0]))
            torch.testing.assert_close(p.grad, want[name], atol=1e-9, rtol=1e-9)

        def node_hook(grad_inputs: Any, grad_outputs: Any, name: str = name, p: Any = p) -> None:
            events.append(("node", name, phase[0]))
            torch.testing.assert_close(p.grad, want[name], atol=1e-9, rtol=1e-9)

        p.register_hook(tensor_hook)
        p.register_post_accumulate_grad_hook(post_acc)
        grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]  # Megatron style
        grad_acc.register_hook(node_hook)
        grad_accs.append(grad_acc)  # the node lives only while referenced, as in Megatron

    _split(model, x, g, phase)
    names = [n for n, _ in model.named_parameters()]
    for kind in ("tensor", "post_accumulate", "node"):
        fired = sorted(n for k, n, _ in events if k == kind)
        assert fired == sorted(names), f"{kind} hooks: {fired}"
    assert {ph for _, _, ph in events} == {"W"}, "a parameter hook fired outside W"
    for name in names:
        torch.testing.assert_close(seen_tensor[name], want[name], atol=1e-9, rtol=1e-9)


def test_megatron_style_main_grad_over_microbatches_with_tied_weight() -> None:
    """Node post-hook on AccumulateGrad moves .grad into main_grad and clears it (Megatron DDP)."""
    torch.manual_seed(0)
    model = Sandwich().double()
    params = list(model.named_parameters())
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    gs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
    want = {n: torch.zeros_like(p) for n, p in params}
    for x, g in zip(xs, gs):
        for n, gr in _reference(model, x, g).items():
            want[n] += gr

    calls = {n: 0 for n, _ in params}
    handles, grad_accs = [], []
    for name, p in params:
        p.main_grad = torch.zeros_like(p)  # type: ignore[attr-defined]

        def ready(grad_inputs: Any, grad_outputs: Any, name: str = name, p: Any = p) -> None:
            assert p.grad is not None, "AccumulateGrad hook fired without a gradient"
            p.main_grad.add_(p.grad)
            p.grad = None
            calls[name] += 1

        grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
        handles.append(grad_acc.register_hook(ready))
        grad_accs.append(grad_acc)

    # Interleave like a zero-bubble schedule: B0 B1 W0 B2 W1 W2.
    handoffs = {}
    order = [("B", 0), ("B", 1), ("W", 0), ("B", 2), ("W", 1), ("W", 2)]
    for kind, i in order:
        if kind == "B":
            before = dict(calls)
            _, handoffs[i] = stage_backward_input(
                [model(xs[i])], [gs[i]], [xs[i]], model.parameters()
            )
            assert calls == before, "a hook fired during B"
        else:
            stage_backward_weight(model.parameters(), handoffs.pop(i))
    assert all(c == 3 for c in calls.values()), calls
    for name, p in params:
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, want[name], atol=1e-9, rtol=1e-9)  # type: ignore[attr-defined]
    for handle in handles:
        handle.remove()


def _setup() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    return m, x, torch.randn(3, 4)


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_over_weight_and_input_is_refused_before_anything_changes(
    mode: str,
) -> None:
    """A fused backward fires it once; B + W would fire it in each pass (mode "any") or
    crash in torch's internals (mode "all", as torch's own B does). Refused at B instead."""
    m, x, g = _setup()
    calls: list[int] = []
    torch.autograd.graph.register_multi_grad_hook(
        (m.weight, x), lambda grads: calls.append(1), mode=mode
    )  # type: ignore[arg-type]
    out = m(m(x))
    with pytest.raises(SplitBackwardError, match="register_multi_grad_hook spans a stage input"):
        stage_backward_input([out], [g], [x], m.parameters())
    assert calls == [] and x.grad is None and m.weight.grad is None


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_over_parameters_only_fires_once(mode: str) -> None:
    m, x, g = _setup()
    calls: list[int] = []
    torch.autograd.graph.register_multi_grad_hook(
        (m.weight, m.bias), lambda grads: calls.append(1), mode=mode
    )  # type: ignore[arg-type]
    m(m(x)).backward(g)
    fused = len(calls)
    calls.clear()
    _, handoff = stage_backward_input([m(m(x))], [g], [x], m.parameters())
    assert calls == []
    stage_backward_weight(m.parameters(), handoff)
    assert len(calls) == fused == 1


@pytest.mark.usefixtures("fp64")
def test_node_post_hook_on_an_intermediate_is_refused_before_anything_changes() -> None:
    """A post hook on an activation's grad_fn that rescales grad_inputs scales the weight
    gradient in a fused backward; B cannot show it both halves at once, so B refuses it
    (before, the weight gradient came out unscaled, silently)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    calls: list[int] = []

    def scale(gi: tuple[torch.Tensor | None, ...], go: object) -> tuple[torch.Tensor | None, ...]:
        calls.append(1)
        return tuple(None if t is None else t * 3 for t in gi)

    h = x @ w
    assert h.grad_fn is not None
    h.grad_fn.register_hook(scale)
    out = torch.tanh(h) @ u
    with pytest.raises(SplitBackwardError, match="post hook is registered on MmBackward0"):
        stage_backward_input([out], [g], [x], [w, u])
    assert calls == [] and x.grad is None and w.grad is None and u.grad is None
    # Nothing of gradsafe's stays registered: a fused backward afterwards is plain.
    out.backward(g)
    assert len(calls) == 1


@pytest.mark.usefixtures("fp64")
def test_deprecated_module_backward_hook_is_refused() -> None:
    """Module.register_backward_hook puts a post hook on the module output's node."""
    m, x, g = _setup()
    inner = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some torch versions warn that it is deprecated
        inner.register_backward_hook(lambda mod, gi, go: None)
    out = m(inner(x))
    with pytest.raises(SplitBackwardError, match="register_full_backward_hook"):
        stage_backward_input([out], [g], [x], [*m.parameters(), *inner.parameters()])


@pytest.mark.usefixtures("fp64")
def test_node_post_hook_on_a_weight_only_node_fires_once_with_the_full_gradient() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    calls: list[int] = []

    def forward() -> torch.Tensor:
        wt = w.t()
        assert wt.grad_fn is not None
        wt.grad_fn.register_hook(
            lambda gi, go: (calls.append(1), tuple(None if t is None else t * 3 for t in gi))[1]
        )
        return x @ wt

    want = torch.autograd.grad(forward(), [w], g)[0]
    assert len(calls) == 1
    calls.clear()
    _, handoff = stage_backward_input([forward()], [g], [x], [w])
    assert calls == []
    stage_backward_weight([w], handoff)
    assert len(calls) == 1
    torch.testing.assert_close(w.grad, want)


@pytest.mark.usefixtures("fp64")
def test_tensor_hook_on_weight_only_nonleaf_is_applied() -> None:
    """A gradient-scaling hook on a tensor computed from parameters alone (w * 2, w.t(), a
    weight-norm'd / quantized weight) runs once in W, as in a fused backward (W used to
    call weight-only nodes directly and skip it, silently)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)

    def forward() -> torch.Tensor:
        w2 = w * 2
        w2.register_hook(lambda grad: grad * 3)
        return x @ w2

    want = torch.autograd.grad(forward(), [w], g)[0]
    out = forward()
    _, handoff = stage_backward_input([out], [g], [x], [w])
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(w.grad, want)


@pytest.mark.usefixtures("fp64")
def test_module_backward_hooks_fire_on_a_stage_whose_inputs_need_no_grad() -> None:
    """A stage whose inputs do not require grad (token ids / the first stage) is all
    weight-only: W runs it through the engine, so a full backward pre-hook that rescales
    grad_output fires as often as in a fused backward (it used to fire 0 times, silently)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    calls: list[str] = []

    def pre(mod: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        calls.append("pre")
        return (grad_output[0] * 3,)

    lin.register_full_backward_pre_hook(pre)
    x = torch.randn(3, 4)  # no grad: a first stage
    g = torch.randn(3, 4)
    want = torch.autograd.grad(lin(torch.tanh(lin(x))), [lin.weight, lin.bias], g)
    fused_calls = len(calls)
    calls.clear()
    _, handoff = stage_backward_input([lin(torch.tanh(lin(x)))], [g], [x], lin.parameters())
    stage_backward_weight(lin.parameters(), handoff)
    assert len(calls) == fused_calls == 2
    torch.testing.assert_close(lin.weight.grad, want[0])
    torch.testing.assert_close(lin.bias.grad, want[1])


def _offload() -> Any:
    """Activation offloading as ``save_on_cpu`` does it on a GPU: every saved tensor packed as a
    copy. (On a CPU tensor ``save_on_cpu`` packs the tensor itself, which keeps a node saving its
    own output alive after W; B refuses that: test_pipelining_hook_edges.py.)"""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def _record(calls: list[Any]) -> Callable[[Any], None]:
    def hook(grads: Any) -> None:
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        calls.append(tuple(None if t is None else t.detach().clone() for t in grads))

    return hook


@pytest.mark.usefixtures("fp64")
def test_hook_on_weight_only_tensor_consumed_by_a_checkpointed_op_runs_once() -> None:
    """A tensor hook on a weight-only tensor used inside a checkpoint fires once and scales ``w.grad`` once.

    ``wt = w * 2`` with a scaling hook is used inside a non-reentrant checkpoint together with
    the stage input, so B captures at ``GradientEdge(MulBackward0, 0)`` and the engine runs the
    captured node's tensor pre-hooks there. W rooting a second engine pass at the same edge would
    run the hook again (w.grad 3x too large).
    """

    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        wt = w * 2
        wt.register_hook(lambda t: (calls.append((t.clone(),)), t * 3)[1])
        return checkpoint(lambda a, b: torch.tanh(a @ b), x, wt, use_reentrant=False) @ u

    _assert_same(forward)


@pytest.mark.usefixtures("fp64")
@pytest.mark.usefixtures("fp64")
def test_multi_grad_hook_all_over_input_and_weight_only_nonleaf_is_refused_cleanly() -> None:
    """A mode-"all" multi-grad hook over a stage input and a weight-only tensor: SplitBackwardError before anything runs, or exact.

    B's ``autograd.grad(inputs=...)`` would run the hook's ``_will_engine_execute_node`` on the
    weight-only side, and torch raises "A leaf node was passed to _will_engine_execute_node but
    we are currently running autograd.grad()" (a fused backward works).
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    wt = w * 2
    calls: list[Any] = []
    torch.autograd.graph.register_multi_grad_hook((x, wt), _record(calls), mode="all")
    out = torch.tanh(x @ wt) @ u
    with pytest.raises(SplitBackwardError):
        stage_backward_input([out], [torch.randn(3, 4)], [x], [w, u])
    assert calls == [] and x.grad is None


@pytest.mark.usefixtures("fp64")
def test_parameter_hook_registered_by_a_weight_only_hook_runs_once() -> None:
    """A parameter hook registered by a weight-only tensor's hook during W runs once.

    The hook on ``w * 2`` runs in W's weight-only pass and registers a hook on ``w``; if that
    lands in ``w``'s hook dict while its hooks are silenced for the capture, it would run on the
    capture and again in the delivery, applying its scale twice.
    """

    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        wt = w * 2

        def register(t: torch.Tensor) -> None:
            w.register_hook(lambda gw: (calls.append((gw.clone(),)), gw * 3)[1])

        wt.register_hook(register)
        return torch.tanh(x @ wt) @ u

    _assert_same(forward)


@pytest.mark.usefixtures("fp64")
class _UserError(Exception):
    pass


@pytest.mark.usefixtures("fp64")
def test_weight_only_hook_exception_keeps_its_type() -> None:
    """A weight-only hook's own exception propagates from W with its type, and W stays transactional.

    The hand-off is FAILED, no parameter ``.grad`` changes and a retry is refused; as in a fused
    backward, ``except`` on the hook's exception type around the schedule catches it, and the
    message does not suggest freed saved tensors.
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    w.grad = torch.ones(4, 4)
    wt = w * 2

    def bad(t: torch.Tensor) -> None:
        raise _UserError("from a user hook")

    wt.register_hook(bad)
    _, handoff = stage_backward_input([torch.tanh(x @ wt)], [torch.randn(3, 4)], [x], [w])
    with pytest.raises(Exception) as info:
        stage_backward_weight([w], handoff)
    assert handoff.state.name == "FAILED"
    assert torch.equal(w.grad, torch.ones(4, 4))
    with pytest.raises(SplitBackwardError):
        stage_backward_weight([w], handoff)
    assert isinstance(info.value, _UserError), type(info.value).__name__


@pytest.mark.usefixtures("fp64")
def test_checkpointed_stage_with_an_l2_term_on_its_weights() -> None:
    """A checkpointed stage with an L2 term on its weights gets the fused backward's gradients.

    ``loss = checkpoint(block)(x).pow(2).sum() + 1e-2 * (w ** 2).sum()``: the checkpointed
    MmBackward's weight edge goes straight to w's AccumulateGrad, and the non-checkpointed
    PowBackward0 sends there too. Only a *checkpointed* weight-only op may be refused; the same
    holds for ``nn.Linear`` inside the checkpoint (bias edge) and a tied head ``h @ w.t()``.
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)

    def forward() -> torch.Tensor:
        out = checkpoint(lambda a, b: torch.tanh(a @ b), x, w, use_reentrant=False)
        return out.pow(2).sum() + 1e-2 * (w**2).sum()

    want = torch.autograd.grad(forward(), [x, w])
    _, handoff = stage_backward_input(forward(), None, [x], [w])
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=1e-12)


@pytest.mark.usefixtures("fp64")
def test_input_gradient_returned_by_b_is_not_changed_by_w() -> None:
    """The input gradient B returns is not changed by W, also when a weight-side hook mutates its argument in place.

    ``out = x + w * 2``: AddBackward passes one tensor to both edges; if B returned it as ``dx``
    (and ``x.grad``) and W rooted its pass at it, ``wt``'s hook ``t.mul_(3)`` would triple a
    ``dx`` the schedule may not have sent yet. A fused backward leaves ``x.grad`` unchanged
    (AccumulateGrad clones a shared gradient).
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    wt = w * 2
    wt.register_hook(lambda t: (t.mul_(3), None)[1])
    (dx,), handoff = stage_backward_input([x + wt], [g.clone()], [x], [w])
    assert dx is not None
    before = dx.clone()
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(dx, before, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, g, rtol=0, atol=0)


@pytest.mark.usefixtures("fp64")
def test_hooked_weight_only_tensor_under_offloading() -> None:
    """Under activation offloading a hooked weight-only tensor's hook fires once and ``w.grad`` is the fused one.

    With ``save_on_cpu`` (or any ``saved_tensors_hooks``) every built-in intermediate has hooked
    saved tensors, so B captures at ``(MulBackward0, 0)``, running ``wt``'s tensor hook there;
    W's engine pass must not run it again.
    """

    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        with _offload():
            wt = w * 2
            wt.register_hook(lambda t: (calls.append((t.clone(),)), t * 3)[1])
            return torch.tanh(x @ wt) @ u

    _assert_same(forward)


@pytest.mark.usefixtures("fp64")
def test_tied_weight_under_offloading() -> None:
    """Under activation offloading a tied weight (and any weight-only op feeding a parameter used directly) is exact, not refused.

    With ``save_on_cpu`` every intermediate has hooked saved tensors, as in a checkpoint; a tied
    embedding/head, ``w.t()`` or an L2 term must still get the fused backward's gradients, and no
    message may speak of checkpointed regions the user does not have.
    """

    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        with _offload():
            return torch.tanh(x @ w) @ w.t() @ u

    _assert_same(forward)


@pytest.mark.usefixtures("fp64")
def test_callback_queued_by_a_weight_only_hook_sees_the_parameter_gradients() -> None:
    """An end-of-backward callback queued during W runs after the parameters have their gradients.

    ``Variable._execution_engine.queue_callback`` (what reducers and FSDP1-style post-backward
    callbacks use) runs when the current backward ends. A module full backward pre-hook on a
    first stage (all weight-only, so it runs in W's pass) queues one; it must see
    ``lin.weight.grad``, as after a fused backward, not run at the end of W's weight-only pass
    before delivery.
    """
    from torch.autograd import Variable

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    seen: list[torch.Tensor | None] = []

    def pre(mod: nn.Module, grad_output: Any) -> None:
        Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            lambda: seen.append(None if lin.weight.grad is None else lin.weight.grad.clone())
        )

    lin.register_full_backward_pre_hook(pre)
    g = torch.randn(3, 4)
    _, handoff = stage_backward_input([torch.tanh(lin(x))], [g], [x], list(lin.parameters()))
    stage_backward_weight(list(lin.parameters()), handoff)
    assert len(seen) == 1
    assert seen[0] is not None, "the callback ran before W delivered the parameter gradients"
    torch.testing.assert_close(seen[0], lin.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_callback_queued_in_one_component_runs_after_every_component_is_delivered(
    split: bool,
) -> None:
    """A callback queued while W delivers one parameter sees every parameter's new gradient.

    With ``.grad`` already held, W delivers each parameter group in its own engine backward as
    soon as it is final (``w2``'s before ``w1``'s here). A callback queued by a hook in ``w2``'s
    delivery must still run after ``w1`` got its gradient, as at the end of a fused backward.
    """
    from torch.autograd import Variable

    torch.manual_seed(0)
    w1 = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    w2 = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    for w in (w1, w2):
        w.grad = torch.ones_like(w)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    seen: list[torch.Tensor] = []

    def hook(grad: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            lambda: seen.append(w1.grad.clone())  # type: ignore[union-attr]
        )

    wt2 = w2 * 2
    wt2.register_hook(hook)
    out = torch.tanh(torch.tanh(x @ (w1 * 2)) @ wt2)
    g = torch.randn(3, 4, dtype=torch.float64)
    if split:
        _, handoff = stage_backward_input([out], [g], [x], [w1, w2])
        stage_backward_weight([w1, w2], handoff)
    else:
        out.backward(g)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], w1.grad, rtol=0, atol=0)
    assert not torch.equal(seen[0], torch.ones_like(w1)), "the callback ran before w1's delivery"


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("where", ["weight-only hook in W", "activation hook in checkpointed B"])
def test_parameter_hook_removed_by_another_hook_stays_removed(where: str) -> None:
    """A parameter hook removed by another hook while W runs stays removed and never fires.

    W's engine pass (and B's capture at a checkpointed op's weight edge) silences a leaf's
    hooks for the capture and restores them after; a ``remove()`` done in between (a one-shot
    hook, a hook that unregisters another) must not be undone by the restore.
    """

    def forward(
        w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]
    ) -> torch.Tensor:
        handle = w.register_hook(lambda t: (calls.append((t.clone(),)), t * 5)[1])
        if where == "weight-only hook in W":
            wt = w * 2
            wt.register_hook(lambda t: handle.remove())
            return torch.tanh(x @ wt) @ u
        out = checkpoint(lambda a, b: torch.tanh(a @ b), x, w, use_reentrant=False) @ u
        out.register_hook(lambda t: handle.remove())
        return out

    _assert_same(forward)


@pytest.mark.usefixtures("fp64")
def test_retain_grad_on_weight_only_tensor_under_offloading() -> None:
    """Under activation offloading a weight-only tensor's ``retain_grad()`` keeps the fused backward's gradient.

    The retains-grad hook is a tensor pre-hook of ``MulBackward0``: B's capture at
    ``(MulBackward0, 0)`` runs it, and W's engine pass must not add to it again. (Parameters'
    gradients stay right; found by a 400-program differential fuzz under ``save_on_cpu``.)
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        with _offload():
            wt = w * 2
            wt.retain_grad()
            return torch.tanh(x @ wt), wt

    out, wt = forward()
    out.backward(g)
    want = wt.grad
    out, wt = forward()
    _, handoff = stage_backward_input([out], [g], [x], [w])
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(wt.grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("where", ["tensor hook", "accumulator pre-hook"])
def test_kept_gradient_shared_with_b_input_gradient_is_not_changed_by_a_mutating_hook(
    where: str,
) -> None:
    """A gradient B keeps for W that is also the input gradient B returned stays B's.

    ``PassThrough``'s backward returns one tensor for ``x`` and ``w``: B returns it as
    ``dx`` (and ``x.grad``) and keeps it for W as ``w``'s gradient. A hook on ``w`` that
    multiplies its argument in place must not reach ``dx``, which the schedule may not
    have sent yet (a fused backward leaves ``x.grad`` as ``g``: AccumulateGrad copies a
    gradient someone else holds); ``w.grad`` is the fused one.
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    if where == "tensor hook":
        w.register_hook(lambda t: (t.mul_(3), None)[1])
    else:
        node = torch.autograd.graph.get_gradient_edge(w).node
        node.register_prehook(lambda grads: (grads[0].mul_(3), None)[1])
    g = torch.randn(3, 4)
    x = torch.randn(3, 4, requires_grad=True)
    PassThrough.apply(x, w).backward(g.clone())
    want_w, want_x = w.grad.clone(), x.grad.clone()  # type: ignore[union-attr]
    torch.testing.assert_close(want_x, g, rtol=0, atol=0)
    w.grad = x.grad = None
    (dx,), handoff = stage_backward_input([PassThrough.apply(x, w)], [g.clone()], [x], [w])
    assert handoff.num_kept == 1 and dx is not None
    before = dx.clone()
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(dx, before, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want_x, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, want_w, rtol=0, atol=0)


def test_output_gradient_shared_with_b_input_gradient_is_not_changed_by_a_mutating_hook() -> None:
    """One tensor given as the gradient of an input-side view and of a weight-only output.

    B returns (a view of) it as ``dx``; W starts the weight-only output ``w.t()`` from it.
    A hook on ``w`` that multiplies its argument in place must not change ``dx`` after B
    returned it; ``w.grad`` is the fused one.
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    w.register_hook(lambda t: (t.mul_(3), None)[1])
    x = torch.randn(4, 4, requires_grad=True)
    g = torch.randn(4, 4)
    torch.autograd.backward([x.view(16).view(4, 4), w.t()], [g.clone(), g.clone()])
    want_w = w.grad.clone()  # type: ignore[union-attr]
    w.grad = x.grad = None
    shared = g.clone()
    (dx,), handoff = stage_backward_input(
        [x.view(16).view(4, 4), w.t()], [shared, shared], [x], [w]
    )
    assert dx is not None
    before = dx.clone()
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(dx, before, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, want_w, rtol=0, atol=0)


@pytest.mark.parametrize("shared", ["kept by B", "an output gradient"])
def test_gradient_w_reads_later_is_not_changed_by_a_hook_mutating_one_it_shares_memory_with(
    shared: str,
) -> None:
    """What arrived at an intermediate in B is what W calls it on, whatever a hook did to an alias.

    ``x @ w`` receives the same tensor as ``r``: through ``PassThrough`` (B keeps ``r``'s
    gradient for W), or as the output gradient also given for the weight-only output
    ``r.view(...)``. W delivers ``r``'s gradient (into a ``.grad`` it holds) before it calls
    ``x @ w``'s node, so a hook on
    ``r`` that multiplies its argument in place changed ``w``'s gradient (a fused backward lets
    it reach whichever branch its engine runs later; torch's hook contract forbids it). The
    split acts as if the hook returned the modified copy: the fused gradients with that hook.
    """

    def run(split: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(4, 4))
        r = nn.Parameter(torch.randn(3, 4))
        if split:
            r.register_hook(lambda t: (t.mul_(3), None)[1])
        else:
            r.register_hook(lambda t: t * 3)
        # .grad held: W delivers each parameter's gradient as soon as it is final.
        w.grad, r.grad = torch.zeros_like(w), torch.zeros_like(r)
        x = torch.randn(3, 4, requires_grad=True)
        g = torch.randn(3, 4)
        if shared == "kept by B":
            outs, grads = [PassThrough.apply(x @ w, r)], [g]
        else:
            outs, grads = [x @ w, r.view(12).view(3, 4)], [g, g]
        if not split:
            torch.autograd.backward(outs, grads)
            return [w.grad, r.grad, x.grad]  # type: ignore[list-item]
        (dx,), handoff = stage_backward_input(outs, grads, [x], [w, r])
        assert dx is not None
        before = dx.clone()
        stage_backward_weight([w, r], handoff)
        torch.testing.assert_close(dx, before, rtol=0, atol=0)
        return [w.grad, r.grad, dx]  # type: ignore[list-item]

    for got, want in zip(run(split=True), run(split=False)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
