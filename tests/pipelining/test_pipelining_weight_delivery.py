"""W delivers each parameter's gradient as soon as it is final: what a failure part-way leaves.

Misuse is refused before anything changes (validation needs no gradient: hand-off
state, parameters, saved tensors freed by another backward). Once delivery has
begun, a failure (a hook's exception, torch's error) leaves the parameters W had
delivered with their new gradient and the others unchanged, the hand-off FAILED,
and the exception says how many; a hook's exception keeps its type.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
from _w_failures import HookError, linear_stage
from _w_failures import notes as notes_of

from gradsafe.pipelining import (
    HandoffState,
    SplitBackwardError,
    _weight_pass,
    stage_backward_input,
    stage_backward_weight,
)


def test_a_hook_raising_part_way_leaves_earlier_parameters_delivered() -> None:
    model, x, g = linear_stage()
    held = [torch.randn_like(p) for p in model.parameters()]
    model(x).backward(g)  # the fused gradients, for comparison
    fused = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    for p, h in zip(model.parameters(), held):
        p.grad = h.clone()

    def bad(grad: torch.Tensor) -> None:
        raise HookError("from a user hook")

    model[2].weight.register_hook(bad)  # the middle layer: W delivers the last layer first
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    with pytest.raises(HookError) as info:
        stage_backward_weight(model.parameters(), handoff)
    if sys.version_info >= (3, 11):  # exception notes
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "delivered 2 of the 6 parameters" in notes, notes
        assert "2 more were being delivered" in notes, notes
    assert handoff.state is HandoffState.FAILED
    grads = dict(zip(("w0", "b0", "w1", "b1", "w2", "b2"), (p.grad for p in model.parameters())))
    start = dict(zip(grads, held))
    want = dict(zip(grads, fused))
    for name in ("w2", "b2"):  # delivered before the failure
        torch.testing.assert_close(grads[name], start[name] + want[name])
    assert torch.equal(grads["w1"], start["w1"])  # its own hook raised before accumulation
    for name in ("w0", "b0"):  # never reached
        assert torch.equal(grads[name], start[name])
    with pytest.raises(SplitBackwardError, match="already failed"):
        stage_backward_weight(model.parameters(), handoff)


def test_misuse_is_refused_before_any_gradient_changes() -> None:
    model, x, g = linear_stage()
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    with pytest.raises(SplitBackwardError, match="lack 2 of the 6 parameters"):
        stage_backward_weight(list(model.parameters())[:4], handoff)
    assert all(p.grad is None for p in model.parameters())
    assert handoff.state is HandoffState.FAILED


def test_a_node_gradsafe_cannot_call_is_worded_as_gradsafes_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, x, g = linear_stage()
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())

    def refuse(node: object, grads: object) -> None:
        raise RuntimeError("this node cannot be called directly")

    monkeypatch.setattr(_weight_pass, "call_node", refuse)
    with pytest.raises(
        SplitBackwardError, match="limit of gradsafe's split backward.*not a misuse"
    ) as info:
        stage_backward_weight(model.parameters(), handoff)
    assert "hook" not in str(info.value)
    assert "No parameter gradient has changed" in str(info.value)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("held", [False, True], ids=["grad None", "grad held"])
def test_a_post_accumulate_hook_raising_leaves_each_gradient_whole_or_untouched(
    held: bool,
) -> None:
    """A post-accumulate-grad hook raising during delivery: every parameter's ``.grad`` is
    exactly as before W or exactly as a fused backward leaves it, never part of it; the
    raising parameter holds its gradient (its hook runs after accumulation); how many hold
    it lies within the counts the exception's note gives; the hand-off is FAILED and a retry
    refused. With ``.grad`` None every gradient is delivered in W's last engine backward, so
    the note counts them all as under way."""
    model, x, g = linear_stage()
    start = [torch.randn_like(p) if held else None for p in model.parameters()]
    model(x).backward(g)
    fused = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    want = [f if s is None else s + f for s, f in zip(start, fused)]
    for p, s in zip(model.parameters(), start):
        p.grad = None if s is None else s.clone()
    raising = model[2].weight
    raising.register_post_accumulate_grad_hook(lambda p: (_ for _ in ()).throw(HookError()))
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    with pytest.raises(HookError) as info:
        stage_backward_weight(model.parameters(), handoff)
    assert handoff.state is HandoffState.FAILED
    whole = 0
    for p, s, w in zip(model.parameters(), start, want):
        if p.grad is None or (s is not None and torch.equal(p.grad, s)):
            assert p is not raising
            continue
        torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-6)
        whole += 1
    assert raising.grad is not None
    if sys.version_info >= (3, 11):  # exception notes
        found = re.search(
            r"delivered (\d+) of the 6 .*?(?:(\d+) more were being delivered|$)",
            notes_of(info.value),
        )
        assert found, notes_of(info.value)
        delivered, under_way = int(found[1]), int(found[2] or 0)
        assert delivered <= whole <= delivered + under_way, (delivered, under_way, whole)
        if not held:
            assert (delivered, under_way) == (0, 6)
    with pytest.raises(SplitBackwardError, match="already failed"):
        stage_backward_weight(model.parameters(), handoff)
