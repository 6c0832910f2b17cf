"""An exception raised inside W reaches the caller with the type its ``except`` clause names.

gradsafe words the failures it diagnoses (saved tensors freed or modified in
place, a node it cannot call) as ``SplitBackwardError``, a ``RuntimeError``,
where torch raises a plain ``RuntimeError``. Anything more specific keeps its
type, with gradsafe's context in a note: torch's ``OutOfMemoryError`` from a
node W calls (``except torch.OutOfMemoryError`` catches it, as from torch's
own W), a ``ValueError`` from one, a ``KeyboardInterrupt``, a hook's own error.
"""

from __future__ import annotations

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


def _failing_from_call(monkeypatch: pytest.MonkeyPatch, exc: BaseException, call: int) -> None:
    """W's ``call``-th direct node call raises ``exc`` (the calls before it run)."""
    calls = []
    original = _weight_pass.call_node

    def failing(node: object, grads: object) -> object:
        calls.append(node)
        if len(calls) == call:
            raise exc
        return original(node, grads)  # type: ignore[arg-type]

    monkeypatch.setattr(_weight_pass, "call_node", failing)


@pytest.mark.parametrize("call", [1, 2], ids=["first call", "second call"])
def test_an_out_of_memory_error_inside_w_stays_an_out_of_memory_error(
    monkeypatch: pytest.MonkeyPatch, call: int
) -> None:
    model, x, g = linear_stage()
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    _failing_from_call(monkeypatch, oom, call)
    with pytest.raises(torch.OutOfMemoryError) as info:
        stage_backward_weight(model.parameters(), handoff)
    assert info.value is oom
    assert handoff.state is HandoffState.FAILED
    if sys.version_info >= (3, 11):  # exception notes
        notes = notes_of(info.value)
        assert "gradsafe: raised while W computed the weight gradients of" in notes, notes
        assert "limit of gradsafe" not in notes
        if call == 1:
            assert "No parameter gradient has changed" in notes, notes
    with pytest.raises(SplitBackwardError, match="already failed.*OutOfMemoryError"):
        stage_backward_weight(model.parameters(), handoff)


@pytest.mark.parametrize("exc", [ValueError("bad shape"), KeyboardInterrupt()], ids=type)
def test_a_specific_exception_from_a_node_w_calls_keeps_its_type(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    model, x, g = linear_stage()
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    _failing_from_call(monkeypatch, exc, 1)
    with pytest.raises(type(exc)) as info:
        stage_backward_weight(model.parameters(), handoff)
    assert info.value is exc
    assert all(p.grad is None for p in model.parameters())
    assert handoff.state is HandoffState.FAILED


@pytest.mark.parametrize("exc", [HookError("from a hook"), KeyboardInterrupt()], ids=type)
def test_a_hook_raising_inside_w_keeps_its_type(exc: BaseException) -> None:
    model, x, g = linear_stage()

    def hook(grad: torch.Tensor) -> None:
        raise exc

    model[2].weight.register_hook(hook)
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    with pytest.raises(type(exc)) as info:
        stage_backward_weight(model.parameters(), handoff)
    assert info.value is exc
    assert handoff.state is HandoffState.FAILED


def test_a_plain_runtime_error_from_a_node_is_still_worded_by_gradsafe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, x, g = linear_stage()
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    _failing_from_call(monkeypatch, RuntimeError("cannot be called directly"), 1)
    with pytest.raises(SplitBackwardError, match="limit of gradsafe"):
        stage_backward_weight(model.parameters(), handoff)
