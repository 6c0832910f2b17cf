"""Findings of a hostile review of c381e72 (W runs the weight-only side through the engine;
B refuses node post hooks on intermediates and multi-grad hooks spanning an input and a
parameter), each a minimal reproduction against a fused backward in fp64; the docstring states
its severity. Fixed ones are plain regression tests; open ones stay strict xfails.

Fixed: #1 and #14, #18, #10, #15 (B computes the weight side that checkpointed/offloaded ops
and custom Functions reach, closed over everything else sending into it, whole and once: its
tensor hooks and retain_grad run once, in B, and nothing is refused); #3, #13 (B's
torch-internal multi-grad error becomes a SplitBackwardError); #9 (a hook's non-RuntimeError
passes through W unchanged); #11 (reentrant checkpoint on the weight side refused at B); #17
(hooks are silenced by swapping in no-ops, so a removal sticks); #19 (donated buffers on the weight side: refused at B naming the fix, before anything runs;
exact with donated_buffer=False).

Open (documented in docs/pipelining.md, Hooks and Limitations): #2, #4, #5, #6 multi-grad hooks
over a non-leaf tensor and an input/parameter; #7, #8 hooks registered by hooks during B/W; #12
B's dx aliases a W root (a weight-only hook mutating in place changes it); #16 callbacks queued
from W's weight-only pass run before delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight


pytestmark = pytest.mark.usefixtures("fp64")


Forward = Callable[[nn.Parameter, nn.Parameter, torch.Tensor, list[Any]], torch.Tensor]


def _run(forward: Forward, split: bool) -> list[Any]:
    """One microbatch through ``forward`` (fused or B then W); the parameters' and input's
    grads, and what the hooks recorded."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    calls: list[Any] = []
    out = forward(w, u, x, calls)
    if split:
        _, handoff = stage_backward_input([out], [g], [x], [w, u])
        stage_backward_weight([w, u], handoff)
    else:
        out.backward(g)
    return [x.grad, w.grad, u.grad, calls]


def _assert_same(forward: Forward) -> None:
    fused = _run(forward, split=False)
    split = _run(forward, split=True)
    assert len(split[3]) == len(fused[3]), f"hook calls: fused {len(fused[3])}, split {len(split[3])}"
    for f, s in zip(fused[:3], split[:3]):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)
    for f, s in zip(fused[3], split[3]):
        for ft, st in zip(f, s):
            assert (ft is None) == (st is None), "a hook saw None where a fused backward gives a gradient"
            if ft is not None:
                torch.testing.assert_close(st, ft, rtol=0, atol=1e-12)


def _record(calls: list[Any]) -> Callable[[Any], None]:
    def hook(grads: Any) -> None:
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        calls.append(tuple(None if t is None else t.detach().clone() for t in grads))

    return hook


# --- 1. checkpointed op consuming a weight-only non-leaf tensor -----------------------------


def test_hook_on_weight_only_tensor_consumed_by_a_checkpointed_op_runs_once() -> None:
    """Severity: SILENT WRONG GRADIENT (and wrong hook count), a regression of c381e72.

    ``wt = w * 2`` with a scaling tensor hook, used inside a non-reentrant checkpoint together
    with the stage input. The checkpointed MmBackward is an intermediate B must capture
    (``in_b``), so B passes ``GradientEdge(MulBackward0, 0)`` in ``autograd.grad(inputs=)``; the
    engine runs a captured node's tensor pre-hooks, so the hook scales B's kept gradient. W's new
    engine pass then roots at the same edge and MulBackward0's tensor hook runs again: w.grad is
    3x too large, the hook fires twice. B silences only *leaf* targets' hooks. Before c381e72 W
    called MulBackward0 directly (no hooks), so this was exact.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        wt = w * 2
        wt.register_hook(lambda t: (calls.append((t.clone(),)), t * 3)[1])
        return checkpoint(lambda a, b: torch.tanh(a @ b), x, wt, use_reentrant=False) @ u

    _assert_same(forward)


# --- 2. multi-grad hooks over tensors B's check does not look at ----------------------------


@pytest.mark.xfail(
    strict=True,
    reason="review2 #2: register_multi_grad_hook(mode='any') over a stage input and a weight-only "
    "non-leaf fires in B and again in W; not refused",
)
def test_multi_grad_hook_any_over_input_and_weight_only_nonleaf() -> None:
    """Severity: WRONG HOOK COUNT (2 instead of 1), silently.

    B refuses a multi-grad hook spanning a stage input and a *parameter*, but
    ``_refuse_multi_grad_hooks_across`` compares only against ``weights``: the same hook over
    the input and ``w * 2`` (weight-norm'd / cast / transposed weight) is accepted, fires in B
    (input) and again in W's engine pass (``w * 2``). docs/pipelining.md names only the
    parameter+activation case as unchecked.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        wt = w * 2
        torch.autograd.graph.register_multi_grad_hook((x, wt), _record(calls), mode="any")
        return torch.tanh(x @ wt) @ u

    _assert_same(forward)


def test_multi_grad_hook_all_over_input_and_weight_only_nonleaf_is_refused_cleanly() -> None:
    """Severity: CRASH with a MISLEADING ERROR (a fused backward works).

    B's ``autograd.grad(inputs=...)`` runs the hook's ``_will_engine_execute_node`` on the
    weight-only side and torch raises "A leaf node was passed to _will_engine_execute_node but
    we are currently running autograd.grad()". Promise: such hooks are refused with
    SplitBackwardError before anything runs (as for input + parameter), or honoured.
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


@pytest.mark.xfail(
    strict=True,
    reason="review2 #4: register_multi_grad_hook(mode='all') over a parameter and an activation "
    "fires twice, each time with half the gradients (docs mention only mode 'any')",
)
def test_multi_grad_hook_all_over_parameter_and_activation() -> None:
    """Severity: WRONG HOOK COUNT and WRONG HOOK ARGUMENTS, silently.

    Fused: once, with (grad_u, grad_h). Split: once in B with (None, grad_h) and once in W's
    delivery with (grad_u, None). A hook that, e.g., clips by the joint norm of its arguments
    computes a different result. docs/pipelining.md only says mode "any" fires twice here.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        h = torch.tanh(x @ w)
        torch.autograd.graph.register_multi_grad_hook((u, h), _record(calls), mode="all")
        return h @ u

    _assert_same(forward)


@pytest.mark.xfail(
    strict=True,
    reason="review2 #5: register_multi_grad_hook(mode='any') over a parameter and a weight-only "
    "non-leaf fires twice (W's engine pass, then W's delivery)",
)
def test_multi_grad_hook_any_over_parameter_and_weight_only_nonleaf() -> None:
    """Severity: WRONG HOOK COUNT (2 instead of 1), silently.

    Both tensors are on the weight side, but W uses two engine calls: the hook on ``w * 2``
    fires in the weight-only pass, the one on ``w`` (silenced there) in the delivery. The
    docs' hook table promises hooks on tensors computed from parameters alone and
    multi-grad hooks over parameters each fire once.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        wt = w * 2
        torch.autograd.graph.register_multi_grad_hook((w, wt), _record(calls), mode="any")
        return torch.tanh(x @ wt) @ u

    _assert_same(forward)


@pytest.mark.xfail(
    strict=True,
    reason="review2 #6: register_multi_grad_hook(mode='all') over a parameter and a weight-only "
    "non-leaf: B accepts it, W then fails (SplitBackwardError) -- a fused backward works",
)
def test_multi_grad_hook_all_over_parameter_and_weight_only_nonleaf() -> None:
    """Severity: CRASH (late: B accepted the microbatch, W fails it and the hand-off is FAILED).

    In W's weight-only pass the hook asks ``_will_engine_execute_node`` about the captured leaf
    and torch raises; W wraps it as "the weight pass failed ... a hook ... may have raised it".
    Fused: fires once with both gradients. Either honour it or refuse it in B.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        wt = w * 2
        torch.autograd.graph.register_multi_grad_hook((w, wt), _record(calls), mode="all")
        return torch.tanh(x @ wt) @ u

    _assert_same(forward)


# --- 3. hooks registering hooks ---------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="review2 #7: a hook registered on a parameter by a weight-only tensor's hook runs in "
    "W's capture (hooks dict emptied, new hook lands in it) and again in the delivery",
)
def test_parameter_hook_registered_by_a_weight_only_hook_runs_once() -> None:
    """Severity: SILENT WRONG GRADIENT (the new hook's scale applied twice) and wrong hook count.

    ``silenced_tensor_hooks`` clears ``w._backward_hooks`` during W's engine pass; the hook on
    ``w * 2`` runs there and registers a hook on ``w``, which lands in the emptied dict (or a
    new one, with its C++ pre-hook) and so runs on the capture; the dict is then restored with
    the new hook still in it and the delivery runs it again. Fused: once.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        wt = w * 2

        def register(t: torch.Tensor) -> None:
            w.register_hook(lambda gw: (calls.append((gw.clone(),)), gw * 3)[1])

        wt.register_hook(register)
        return torch.tanh(x @ wt) @ u

    _assert_same(forward)


@pytest.mark.xfail(
    strict=True,
    reason="review2 #8: a node post hook put on an intermediate while B runs (by a tensor hook) "
    "escapes B's refusal and sees no weight half",
)
def test_post_hook_registered_on_an_intermediate_during_b() -> None:
    """Severity: SILENT WRONG GRADIENT (low likelihood).

    B checks intermediates for user post hooks before its engine call. A tensor hook on the
    stage output that registers a grad_inputs-scaling post hook on ``(x @ w).grad_fn`` runs
    inside B's engine call; the post hook then fires in B with None for w's edge, so w.grad
    is unscaled while a fused backward scales it. Expected: refused, or honoured.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        pre = x @ w
        out = torch.tanh(pre) @ u

        def register(t: torch.Tensor) -> None:
            assert pre.grad_fn is not None
            pre.grad_fn.register_hook(
                lambda gi, go: (calls.append(()), tuple(None if a is None else a * 3 for a in gi))[1]
            )

        out.register_hook(register)
        return out

    _assert_same(forward)


# --- 4. exceptions from weight-only hooks -----------------------------------------------------


class _UserError(Exception):
    pass


def test_weight_only_hook_exception_keeps_its_type() -> None:
    """Severity: MISLEADING ERROR (low). The transactional part holds: the hand-off is FAILED,
    no parameter .grad changes, a retry is refused (asserted below, passing). But a fused
    backward raises the hook's exception as is, and docs/pipelining.md ("A user hook's own
    exception (any type) can only come from the delivery step and propagates unchanged") still
    says so; ``except _UserError`` around the schedule misses it under the patch, and the message
    suggests freed saved tensors as an alternative cause.
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


# --- 5. checkpointing and the weight-only side ------------------------------------------------


def test_checkpointed_stage_with_an_l2_term_on_its_weights() -> None:
    """Severity: CRASH (false refusal) with a MISLEADING ERROR; predates c381e72.

    ``loss = checkpoint(block)(x).pow(2).sum() + 1e-2 * (w ** 2).sum()``: the checkpointed
    MmBackward's weight edge goes straight to w's AccumulateGrad (a B capture target) and the
    non-checkpointed PowBackward0 also sends there, so ``_weight_parts_in_b`` raises for *every*
    weight-only node feeding a target, calling it "a checkpointed PowBackward0". The same for
    ``nn.Linear`` inside the checkpoint (bias edge) and for a tied head ``h @ w.t()``.
    docs/pipelining.md limits the refusal to a *checkpointed* weight-only op. A fused backward
    works; weight decay in the loss with activation checkpointing is common.
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


def test_reentrant_checkpoint_on_the_weight_only_side_is_refused_in_b() -> None:
    """Severity: CRASH (late: B ran, returned input gradients the schedule sends on, then W
    fails and the hand-off is FAILED, so the microbatch's weight gradient is lost); predates
    c381e72 but now every weight-only node runs under W's ``autograd.grad(inputs=...)``.
    ``checkpoint(f, w, use_reentrant=True)`` computed from parameters alone: B never runs it,
    W's engine pass does and torch refuses ("incompatible with .grad() or passing an `inputs`
    parameter"). Expected: refused in B before anything changes (as documented for the
    input side), or honoured.
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    wt = checkpoint(lambda a: torch.sin(a) * 2, w, use_reentrant=True)
    out = torch.tanh(x @ wt)
    try:
        _, handoff = stage_backward_input([out], [torch.randn(3, 4)], [x], [w])
    except SplitBackwardError:
        assert x.grad is None and w.grad is None  # refused in B, nothing changed: fine
        return
    stage_backward_weight([w], handoff)


# --- 6. gradients aliased between B's result and W --------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="review2 #12: B's input gradient (and x.grad) is the very tensor W later hands to a "
    "weight-only hook; a hook mutating its argument in place changes dx after B returned it",
)
def test_input_gradient_returned_by_b_is_not_changed_by_w() -> None:
    """Severity: SILENT WRONG INPUT GRADIENT, low (needs a hook that mutates its argument in
    place, which torch's docs discourage; a fused backward gives x.grad unchanged here because
    AccumulateGrad clones a shared gradient). ``out = x + w * 2``: AddBackward passes the same
    tensor to both edges, B returns it as dx (and as x.grad, no copy), W calls AddBackward on the
    recorded gradient and roots its engine pass at it, so ``wt``'s hook ``t.mul_(3)`` triples
    the dx the schedule may not have sent yet.
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


# --- 7. multi-grad hooks torch's own tools register -------------------------------------------


def test_flop_counter_mode_around_a_split_stage() -> None:
    """Severity: CRASH with a MISLEADING ERROR (torch's own split fails the same way; a fused
    backward works). ``torch.utils.module_tracker.ModuleTracker`` -- used by
    ``FlopCounterMode``, a common way to measure MFU -- registers
    ``register_multi_grad_hook(module inputs, mode="all")``; for the first module that is the
    leaf stage input, which B's ``autograd.grad(inputs=...)`` captures, and torch raises "A leaf
    node was passed to _will_engine_execute_node but we are currently running autograd.grad()"
    from inside B's engine call. Neither refused with SplitBackwardError nor documented; any
    mode-"all" multi-grad hook over a leaf stage input alone does the same.
    """
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    params = list(seq.parameters())
    with FlopCounterMode(display=False) as fused_counter:
        seq(x).backward(g)  # autograd.grad would hit the same torch error
    want = [t.grad for t in (x, *params)]
    for t in (x, *params):
        t.grad = None
    with FlopCounterMode(display=False) as counter:
        out = seq(x)
        try:
            _, handoff = stage_backward_input([out], [g], [x], params)
        except SplitBackwardError:
            assert x.grad is None and all(p.grad is None for p in params)
            return
        stage_backward_weight(params, handoff)
    for got, ref in zip([x.grad, *(p.grad for p in params)], want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert counter.get_total_flops() == fused_counter.get_total_flops()


# --- 8. saved-tensor hooks (activation offloading) take the checkpoint path ------------------


def test_hooked_weight_only_tensor_under_save_on_cpu() -> None:
    """Severity: SILENT WRONG GRADIENT and wrong hook count. Same mechanism as #1, but the
    trigger is activation offloading (``save_on_cpu``, torchtune-style offloading, any
    ``saved_tensors_hooks``): ``has_hooked_saved`` is true for every built-in intermediate, so
    all go to ``in_b``, B captures at ``(MulBackward0, 0)`` running ``wt``'s tensor hook, and
    W's engine pass runs it again. A weight-norm'd / fake-quantized weight with a gradient hook
    in an offloaded stage gets a wrong gradient.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            wt = w * 2
            wt.register_hook(lambda t: (calls.append((t.clone(),)), t * 3)[1])
            return torch.tanh(x @ wt) @ u

    _assert_same(forward)


def test_tied_weight_under_save_on_cpu() -> None:
    """Severity: CRASH (false refusal) with a MISLEADING ERROR. Finding #10's refusal, reached
    without checkpointing: with activation offloading every intermediate is "checkpointed" to
    gradsafe, so any weight-only op sending into a parameter another op uses directly (tied
    embedding/head, ``w.t()``, an L2 term) is refused, and the message tells the user about
    checkpointed regions they do not have. A fused backward works.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            return torch.tanh(x @ w) @ w.t() @ u

    _assert_same(forward)


# --- 9. end-of-backward callbacks queued by weight-only hooks ---------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="review2 #16: a callback queued (queue_callback) by a hook that runs in W's engine "
    "pass runs when that pass ends, before W delivers any parameter gradient",
)
def test_callback_queued_by_a_weight_only_hook_sees_the_parameter_gradients() -> None:
    """Severity: WRONG STATE seen by end-of-backward callbacks, silently.

    ``Variable._execution_engine.queue_callback`` runs a callback when the current backward
    ends -- what reducers and FSDP1-style "post-backward final callbacks" use to act on the
    finished ``.grad``. A module full backward pre-hook on a first stage (inputs need no grad,
    so it is all weight-only and runs in W's engine pass since c381e72) queues one; it runs at
    the end of W's weight-only ``autograd.grad``, where no parameter has its gradient yet
    (delivery is a second engine call). Fused: it sees ``lin.weight.grad``.
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


# --- 10. hooks removed while gradsafe has a leaf's hooks set aside ----------------------------


@pytest.mark.parametrize("where", ["weight-only hook in W", "activation hook in checkpointed B"])
def test_parameter_hook_removed_by_another_hook_stays_removed(where: str) -> None:
    """Severity: SILENT WRONG GRADIENT and a leaked hook. ``silenced_tensor_hooks`` saves the
    leaf's hook items, clears the dict and ``update``s it back afterwards; a ``remove()`` done
    in between (a one-shot hook, a hook that unregisters another) is undone. Fused: the removed
    hook never fires. W's engine pass (c381e72) runs weight-only hooks inside that window; B
    does too for activation hooks when it captures at a checkpointed op's weight edge.
    """

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: list[Any]) -> torch.Tensor:
        handle = w.register_hook(lambda t: (calls.append((t.clone(),)), t * 5)[1])
        if where == "weight-only hook in W":
            wt = w * 2
            wt.register_hook(lambda t: handle.remove())
            return torch.tanh(x @ wt) @ u
        out = checkpoint(lambda a, b: torch.tanh(a @ b), x, w, use_reentrant=False) @ u
        out.register_hook(lambda t: handle.remove())
        return out

    _assert_same(forward)


def test_retain_grad_on_weight_only_tensor_under_save_on_cpu() -> None:
    """Severity: SILENT WRONG (retained) GRADIENT, no user hook needed. Same mechanism as #1 and
    #14: the retains-grad hook is a tensor pre-hook of ``MulBackward0``, run by B's capture at
    ``(MulBackward0, 0)`` and by W's engine pass. Parameters' gradients stay right (found by a
    400-program differential fuzz under ``save_on_cpu``: 48 programs falsely refused (#15),
    every other mismatch traced to #14/#18).
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autograd.graph.save_on_cpu():
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


# --- 11. compiled weight-only blocks ----------------------------------------------------------


def test_compiled_weight_only_block_with_donated_buffers() -> None:
    """Severity: CRASH (late: after B) with a MISLEADING ERROR; a regression of c381e72.

    A compiled weight transform (weight-norm, fake-quant, a LoRA merge ``w + a @ b``) computed
    from parameters alone is a weight-only ``CompiledFunctionBackward``. B never runs it, so B's
    donated-buffer check (which names ``torch._functorch.config.donated_buffer = False``) never
    fires; W's new engine pass runs it with ``retain_graph=True`` and torch refuses ("compiled
    with non-empty donated buffers which requires ... retain_graph=False"), wrapped as "the
    weight pass failed ... saved tensors ... gone: redo the microbatch's forward and backward".
    Before c381e72 W applied the node directly and this was exact. A fused backward works.
    """
    transform = torch.compile(
        lambda w: torch.sin(torch.cos(w) * 3) @ torch.tanh(w * 2), backend="aot_eager"
    )

    def stage(w: nn.Parameter, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ transform(w))

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    stage(w, x).backward(g)  # compiles the backward (buffers donated from now on)
    want = torch.autograd.grad(stage(w, x), [x, w], g)
    w.grad = None
    x.grad = None
    with pytest.raises(SplitBackwardError, match="donated_buffer = False"):
        stage_backward_input([stage(w, x)], [g], [x], [w])
    assert w.grad is None and x.grad is None
    torch._dynamo.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        stage(w, x).backward(g)
        w.grad = None
        x.grad = None
        _, handoff = stage_backward_input([stage(w, x)], [g], [x], [w])
        stage_backward_weight([w], handoff)
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=1e-12)
