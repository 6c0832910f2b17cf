"""``register_multi_grad_hook``'s registrations, read from the closures it registers.

Private torch read here: the closures ``register_multi_grad_hook`` registers as
tensor hooks (which tensors one registration spans, its mode), and mode
``"any"``'s per-backward record of whether it fired, stood in for while a W
delivers its tensors in several engine backwards (:func:`fired_once_across`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch.autograd.graph import Node, get_gradient_edge

__all__ = [
    "MultiGradHook",
    "fired_once_across",
    "multi_grad_hook_codes",
    "multi_grad_hooks",
    "multi_grad_hook_spans",
]


@functools.cache
def multi_grad_hook_codes() -> frozenset[types.CodeType]:
    # The code objects of the functions register_multi_grad_hook defines
    # (its hooks): constants of its own code. Mode "any" copies the user's
    # names onto its hook, so names cannot tell.
    codes: set[types.CodeType] = set()
    stack = [torch.autograd.graph.register_multi_grad_hook.__code__]
    while stack:
        for const in stack.pop().co_consts:
            if isinstance(const, types.CodeType):
                codes.add(const)
                stack.append(const)
    return frozenset(codes)


class MultiGradHook(NamedTuple):
    """One ``register_multi_grad_hook`` registration, as a tensor's hook dict holds it."""

    #: Identity of the registration: the lock cell its hooks share.
    key: int
    #: ``"any"`` where its closure is mode "any"'s (a per-backward record of whether it
    #: fired), else ``"all"`` (also for a closure this torch shapes otherwise: the safe reading).
    mode: Literal["all", "any"]
    #: Mode "any": the cell holding that record; None for mode "all".
    fired: Any


def multi_grad_hooks(tensor: torch.Tensor) -> list[MultiGradHook]:
    """The ``register_multi_grad_hook`` registrations that include ``tensor``.

    One registration puts one hook per tensor (the same function in mode
    ``"any"``, closures over shared cells in mode ``"all"``); the lock cell
    they close over identifies the registration.
    """
    hooks = tensor._backward_hooks
    if not hooks:
        return []
    found = []
    for hook in hooks.values():
        if getattr(hook, "__code__", None) not in multi_grad_hook_codes():
            continue
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
        lock = cells.get("lock")
        if lock is None:
            continue
        fired = cells.get("ran_hook")
        found.append(MultiGradHook(id(lock), "all" if fired is None else "any", fired))
    return found


@contextlib.contextmanager
def fired_once_across(hooks: Sequence[MultiGradHook], marker: Node) -> Iterator[None]:
    """Make each mode-``"any"`` registration in ``hooks`` fire at most once across the engine
    backwards whose graphs hold ``marker``, as it fires once in one fused backward.

    Mode ``"any"`` records, per engine backward (graph task id), whether it
    fired. W delivers a parameter group per engine backward and puts
    ``marker`` (a node of its own) in each: for the duration, the record is a
    stand-in that answers "fired" in a backward holding ``marker`` once the
    registration fired in one of them, and is the registration's own record
    in every other backward (another thread's, a fused one meanwhile).
    Several W passes, on any threads, share one stand-in per registration;
    the last to leave puts the record back.
    """
    entered: list[_FiredOnce] = []
    state = _OnePass(marker)
    try:
        with _FIRED_LOCK:
            for hook in hooks:
                stand_in = _FIRED.get(hook.key)
                if stand_in is None:
                    stand_in = _FIRED[hook.key] = _FiredOnce(hook.key, hook.fired)
                stand_in.passes.append(state)
                entered.append(stand_in)
        yield
    finally:
        with _FIRED_LOCK:
            for stand_in in entered:
                stand_in.passes.remove(state)
                if not stand_in.passes:
                    del _FIRED[stand_in.key]
                    stand_in.cell.cell_contents = stand_in.own


class _OnePass:
    """One W's marker node, and the registrations that fired in one of its backwards (by stand-in)."""

    __slots__ = ("fired", "marker")

    def __init__(self, marker: Node) -> None:
        self.marker = marker
        self.fired: set[int] = set()

    def runs_now(self) -> bool:
        # True in a backward whose graph holds the marker (an accumulator W
        # roots every delivery at, no other backward reaches it).
        return bool(torch._C._will_engine_execute_node(self.marker))  # type: ignore[arg-type]


class _FiredOnce:
    """Stands in for a mode-``"any"`` registration's ``ran_hook`` record; see :func:`fired_once_across`.

    The registration's hook reads ``ran_hook[graph task id]`` and sets it to
    True, under its lock, then calls the user's function only if the read
    was False.
    """

    def __init__(self, key: int, cell: Any) -> None:
        self.key, self.cell, self.own = key, cell, cell.cell_contents
        self.passes: list[_OnePass] = []
        cell.cell_contents = self

    def __getitem__(self, task: int) -> bool:
        for one in tuple(self.passes):
            if id(self) in one.fired and one.runs_now():
                return True
        return bool(self.own[task])

    def __setitem__(self, task: int, value: bool) -> None:
        for one in tuple(self.passes):
            if one.runs_now():
                one.fired.add(id(self))
        self.own[task] = value


# The stand-ins installed now, by registration (MultiGradHook.key).
_FIRED: dict[int, _FiredOnce] = {}
_FIRED_LOCK = threading.Lock()


def multi_grad_hook_spans(tensors: Sequence[torch.Tensor]) -> dict[int, tuple[Node | None, ...]]:
    """Every ``register_multi_grad_hook`` registration on any of ``tensors``, with what it spans.

    Keyed by registration (the lock cell its hooks share); the value is the
    gradient-edge node of each tensor it spans (grad_fn, or the accumulator of
    a leaf), None for one that cannot be identified. Mode ``"all"`` keeps
    those nodes in its closure. Mode ``"any"`` keeps nothing: its one hook
    function sits in the hook dict of each tensor, so when more dicts hold it
    than ``tensors`` account for, the other holders are looked for through
    the garbage collector's referrers (costly: only then); a tensor autograd
    also holds (e.g. a leaf with a live gradient accumulator) is invisible to
    the collector, and counts as unidentified.
    """
    spans: dict[int, tuple[Node | None, ...]] = {}
    any_hooks: dict[int, Any] = {}
    for tensor in tensors:
        for hook in tuple(tensor._backward_hooks.values()) if tensor._backward_hooks else ():
            if getattr(hook, "__code__", None) not in multi_grad_hook_codes():
                continue
            cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
            if "lock" not in cells:
                continue
            key = id(cells["lock"])
            if "grad_fns" in cells:  # mode "all"
                spans[key] = tuple(n for n in cells["grad_fns"].cell_contents if n is not None)
            else:
                any_hooks[key] = hook
    if not any_hooks:
        return spans
    del hook, cells  # count only the hook dicts' references
    holders = _count_holders(any_hooks)
    nodes = {id(t): get_gradient_edge(t).node for t in tensors if t.requires_grad}
    for key, hook in any_hooks.items():
        known = [t for t in tensors if t._backward_hooks and _holds(t._backward_hooks, hook)]
        if holders[key] == len(known):
            spans[key] = tuple(nodes[id(t)] for t in known)
        else:
            known_dicts = {id(t._backward_hooks): nodes[id(t)] for t in known}
            spans[key] = _holder_nodes(hook, any_hooks, known_dicts)
    return spans


def _holds(hooks: dict[Any, Any], hook: Any) -> bool:
    return any(h is hook for h in hooks.values())


def _count_holders(hooks: dict[int, Any]) -> dict[int, int]:
    """For each hook, how many references beyond ``hooks`` and this call's own hold it."""
    return {key: sys.getrefcount(hook) - _REF_OVERHEAD for key, hook in hooks.items()}


def _ref_overhead() -> int:
    _REF_OVERHEAD_PROBE[0] = object()  # held by that dict only, like a hook by one tensor's dict
    return _count_holders({0: _REF_OVERHEAD_PROBE[0]})[0] - 1


_REF_OVERHEAD = 0
_REF_OVERHEAD_PROBE: dict[int, object] = {}
_REF_OVERHEAD = _ref_overhead()
_REF_OVERHEAD_PROBE.clear()


def _holder_nodes(
    hook: Any, ignore: dict[int, Any], known: dict[int, Node]
) -> tuple[Node | None, ...]:
    """The node of each tensor whose hook dict holds ``hook`` (``known``: by dict id), None where unidentified."""
    import gc

    found: list[Node | None] = []
    for holder in gc.get_referrers(hook):
        if holder is ignore or not isinstance(holder, dict) or not _holds(holder, hook):
            continue
        if id(holder) in known:
            found.append(known[id(holder)])
            continue
        if "__builtins__" in holder:
            continue  # a module's globals, not a tensor's hook dict
        owners = [
            t
            for t in gc.get_referrers(holder)
            if isinstance(t, torch.Tensor) and t._backward_hooks is holder
        ]
        found.extend(get_gradient_edge(t).node if t.requires_grad else None for t in owners)
        if not owners:
            found.append(None)
    return tuple(found)
