"""A torch whose autograd internals the split relies on changed: the patch is skipped with
the reason and gradsafe's B refuses before any gradient changes (issue 36, "torch 2.16").

Each test simulates one plausible change with ``monkeypatch`` at torch's side (a renamed
method, an engine object without its entry point, an engine that ignores ``inputs=``),
then asserts what a user gets: ``plan()`` is a ``Skip`` naming it, and a direct
``stage_backward_input`` raises :class:`SplitBackwardError` with no ``.grad`` written.
docs/architecture.md ("Private torch internals") lists each entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.hooks

from gradsafe.patching import Skip
from gradsafe.pipelining import SplitBackwardError, _patch, _refusals, stage_backward_input


@pytest.fixture(autouse=True)
def _fresh_probe() -> Iterator[None]:
    _refusals._missing_feature.cache_clear()
    yield
    _refusals._missing_feature.cache_clear()


def _hooks_dict_renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The handle keeps its hook dict under another name (and removes through it).
    handle = torch.utils.hooks.RemovableHandle
    init, remove = handle.__init__, handle.remove

    def renamed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.dict_refs = self.__dict__.pop("hooks_dict_ref")

    def renamed_remove(self: Any) -> None:
        self.hooks_dict_ref = self.dict_refs
        try:
            remove(self)
        finally:
            del self.hooks_dict_ref

    monkeypatch.setattr(handle, "__init__", renamed_init)
    monkeypatch.setattr(handle, "remove", renamed_remove)


class _EngineWithoutEntry:
    """An engine object whose entry point moved (``run_backward`` renamed)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward_v2(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine.run_backward(*args, **kwargs)

    def queue_callback(self, callback: Callable[[], None]) -> None:
        self._engine.queue_callback(callback)


def _engine_entry_renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", _EngineWithoutEntry(engine))


def _engine_ignores_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A sparing wrapper's inputs= no longer keeps the engine off a parameter.
    from gradsafe.pipelining._torch import _engine

    monkeypatch.setattr(_engine, "_unspared_inputs", lambda roots, inputs, spared: None)


def _hooks_read_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine keeps the hook dict it was given first: replacing a leaf's
    # _backward_hooks afterwards no longer changes which hooks run.
    slot = torch._C.TensorBase._backward_hooks  # type: ignore[attr-defined]

    def get(self: torch.Tensor) -> Any:
        return self.__dict__.get("_shadow_hooks", slot.__get__(self))

    def set_(self: torch.Tensor, hooks: Any) -> None:
        if slot.__get__(self) is None:
            slot.__set__(self, hooks)
        self.__dict__["_shadow_hooks"] = hooks

    monkeypatch.setattr(torch.Tensor, "_backward_hooks", property(get, set_))


def _engine_says_it_executes_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    # The query answers True for any node: B could no longer tell which hooks a capture runs.
    monkeypatch.setattr(torch._C, "_will_engine_execute_node", lambda node: True)


def _custom_function_mark_renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Custom Functions' nodes derive from another base class: they would read as built-in.
    from gradsafe.pipelining._torch import _nodes

    monkeypatch.setattr(_nodes.torch._C, "_FunctionBase", type("_Renamed", (), {}))


def _version_counter_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    # In-place changes no longer bump it: W could not see a tensor B recorded change.
    from gradsafe.pipelining._torch import _nodes

    monkeypatch.setattr(_nodes, "version", lambda tensor: 0)
    monkeypatch.setattr("gradsafe.pipelining._torch._probe.version", lambda tensor: 0)


def _engine_query_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")


DRIFTS = {
    "a leaf's hook dict read from elsewhere": (
        _hooks_read_elsewhere,
        "tensor hooks run at a capture",
    ),
    "RemovableHandle.hooks_dict_ref renamed": (_hooks_dict_renamed, "hook"),
    "the engine's run_backward renamed": (_engine_entry_renamed, "GradientEdge roots"),
    "inputs= no longer spares a parameter": (_engine_ignores_inputs, "reaches the parameter"),
    "_will_engine_execute_node answers True for any node": (
        _engine_says_it_executes_every_node,
        "what it executes",
    ),
    "_will_engine_execute_node missing": (_engine_query_missing, "what it executes"),
    "the version counter no longer counts in-place changes": (
        _version_counter_frozen,
        "version counter",
    ),
    "custom Functions' node base class renamed": (
        _custom_function_mark_renamed,
        "not told from a built-in one",
    ),
}


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_a_drifted_autograd_internal_skips_the_patch_and_b_refuses_before_any_gradient(
    drift: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    simulate, said = DRIFTS[drift]
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(3, requires_grad=True)
    out = (x * w).sin()
    simulate(monkeypatch)
    plan = _patch.plan()
    assert isinstance(plan, Skip) and said in plan.reason, plan
    with pytest.raises(SplitBackwardError, match="split backward cannot run on torch"):
        stage_backward_input([out], [torch.ones(3)], [x], [w])
    assert x.grad is None and w.grad is None
