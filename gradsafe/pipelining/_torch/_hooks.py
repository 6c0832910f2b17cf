"""Hook dicts: silencing a leaf's or a module's gradient hooks, and reading what hooks are there.

Private torch read here: ``Tensor._backward_hooks`` and
``Tensor._post_accumulate_grad_hooks``, ``nn.Module``'s backward-hook dicts
(per module and global), ``RemovableHandle.hooks_dict_ref`` (a node's Python
post hooks), and the closures ``register_multi_grad_hook`` registers (a
mode-``"any"`` one's record of the backwards it fired in is stood in for while
a W delivers its tensors in several engine backwards: :func:`fired_once_across`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils.weak import WeakIdKeyDictionary

from gradsafe.pipelining._torch._engine import on_device_thread

__all__ = [
    "ACCUMULATOR_READS",
    "MultiGradHook",
    "delivering",
    "fired_once_across",
    "has_other_post_hooks",
    "module_backward_hook_dicts",
    "multi_grad_hook_codes",
    "multi_grad_hooks",
    "multi_grad_hook_spans",
    "silenced_gradient_hooks",
    "silenced_tensor_hooks",
    "tensor_hook_dicts",
]


@contextlib.contextmanager
def silenced_tensor_hooks(leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """Keep the leaves' tensor hooks from running while a gradient is captured at them.

    ``autograd.grad`` runs a captured input's tensor hooks; B's capture is not
    the leaf's gradient yet (W delivers it, and its hooks run then, once).
    The engine reads a leaf's hooks from the dict installed as its
    ``_backward_hooks`` (a snapshot of its values per call), so each leaf gets
    a stand-in for the duration: nothing runs at the capture, even a hook
    registered on the leaf meanwhile by another hook (``register_hook``
    writes into the stand-in, which holds it aside). Afterwards the leaf's own
    dict is back, with those hooks added, and the stand-in forwards their
    handles' ``remove()`` there. A hook removed meanwhile from the leaf's own
    dict stays removed.

    The stand-in is the leaf's for every thread, so it holds the leaf's hooks,
    each silent only in a backward that captures the leaf on a thread inside
    this context (or on one of autograd's device threads, which run its
    nodes): a W delivering the leaf meanwhile (another thread's over a tied
    weight, or one run from a hook inside the capture) runs them as usual.
    Threads whose captures overlap on a leaf share its stand-in; the last to
    leave puts the leaf's own dict back.

    Installing or removing a stand-in replaces the hook object autograd's
    engine iterates, which frees it: during a W's delivery of the leaf (this
    thread's, when B runs from one of the leaf's hooks, or another thread's)
    that crashed the process. So while some W delivers the leaf
    (:func:`delivering`) its hooks are silenced in place, in its own dict (a
    hook registered meanwhile is then not held aside), and a stand-in whose
    capture ends meanwhile stays until that delivery ends. Nothing waits.
    """
    me = threading.get_ident()
    entered: list[_Window] = []
    try:
        with _SWAPS:
            for leaf in leaves:
                window = _WINDOWS.get(id(leaf))
                if window is None:
                    window = _WINDOWS[id(leaf)] = _Window(leaf, in_place=id(leaf) in _DELIVERING)
                window.threads.append(me)
                entered.append(window)
        yield
    finally:
        with _SWAPS:
            for window in entered:
                window.threads.remove(me)
                _close_if_unused(window)


@contextlib.contextmanager
def delivering(leaves: Iterable[torch.Tensor]) -> Iterator[None]:
    """Mark the leaves as delivered by an engine call of this thread (W's) for the duration.

    Meanwhile no stand-in for their hooks is installed or removed
    (:func:`silenced_tensor_hooks`): the engine runs a leaf's hooks through one
    hook object, which replacing the leaf's ``_backward_hooks`` frees, mid-call
    (a segfault).
    """
    me = threading.get_ident()
    ids = [id(leaf) for leaf in leaves]
    with _SWAPS:
        for i in ids:
            _DELIVERING[i].append(me)
    try:
        yield
    finally:
        with _SWAPS:
            for i in ids:
                threads = _DELIVERING[i]
                threads.remove(me)
                if not threads:
                    del _DELIVERING[i]
                    window = _WINDOWS.get(i)
                    if window is not None:
                        _close_if_unused(window)


def _close_if_unused(window: _Window) -> None:
    """Close a window no capture is in, unless a W delivers its leaf (``delivering`` closes it
    then). Under ``_SWAPS``."""
    leaf_id = id(window.leaf)
    if window.threads or (not window.in_place and leaf_id in _DELIVERING):
        return
    del _WINDOWS[leaf_id]
    window.close()


class _Window:
    """One leaf's silenced span: its own hook dict, what silences it, and the threads capturing
    inside it (one entry per entry into :func:`silenced_tensor_hooks`).

    A stand-in dict installed as the leaf's ``_backward_hooks``, or (``in_place``, while a W
    delivers the leaf) its own dict's hooks wrapped where they are: no hook object changes.
    """

    def __init__(self, leaf: torch.Tensor, *, in_place: bool) -> None:
        self.leaf, self.own = leaf, leaf._backward_hooks
        self.in_place = in_place
        self.threads: list[int] = []
        self.stand_in = _HeldHooks()
        self.wrapped: dict[Any, tuple[Any, _SilentAtCapture]] = {}
        node = None
        if self.own:
            with ACCUMULATOR_READS:
                node = get_gradient_edge(leaf).node
        if in_place:
            # Wrapped where they are; a leaf with no dict has nothing to silence, and
            # installing one is what must not happen now.
            for key, hook in (self.own or {}).items():
                silent = _SilentAtCapture(hook, node, self.threads)  # type: ignore[arg-type]
                self.wrapped[key] = (hook, silent)
                self.own[key] = silent  # type: ignore[index]
            return
        for key, hook in (self.own or {}).items():
            collections.OrderedDict.__setitem__(
                self.stand_in,
                key,
                _SilentAtCapture(hook, node, self.threads),  # type: ignore[arg-type]
            )
        leaf._backward_hooks = self.stand_in

    def close(self) -> None:
        """Put the leaf's own dict back, with the hooks registered meanwhile."""
        if self.in_place:
            for key, (hook, silent) in self.wrapped.items():
                if self.own is not None and self.own.get(key) is silent:  # not removed meanwhile
                    self.own[key] = hook
            return
        own, stand_in = self.own, self.stand_in
        if stand_in.held:
            if own is None:
                own = collections.OrderedDict()
            own.update(stand_in.held)
            stand_in.home = own
            _STAND_INS.setdefault(self.leaf, []).append(stand_in)  # their handles refer to it
        self.leaf._backward_hooks = own


# The leaves whose hooks are silenced now, across threads, by id (a window holds its
# leaf, so the id is not reused while it is open; it is dropped when it closes).
_WINDOWS: dict[int, _Window] = {}
# The leaves a W of some thread delivers now, by id (W holds them), with those threads.
_DELIVERING: collections.defaultdict[int, list[int]] = collections.defaultdict(list)
# Guards both; stand-ins are installed and removed only under it.
_SWAPS = threading.Lock()
#: Held while gradsafe reads a leaf's gradient accumulator with the GIL held (W's helper node)
#: or beside such a read (a window's lookup): torch 2.13 takes the accumulator's lock, then the
#: GIL, so the two on two threads deadlock.
ACCUMULATOR_READS = threading.Lock()


class _SilentAtCapture:
    """A leaf's hook in its stand-in: nothing in a backward of one of ``threads`` (or of a
    device thread) that captures the leaf at ``node``, the hook itself in any other."""

    __slots__ = ("hook", "node", "threads")

    def __init__(self, hook: Any, node: Node, threads: list[int]) -> None:
        self.hook, self.node, self.threads = hook, node, threads

    def __call__(self, grad: torch.Tensor) -> Any:
        if threading.get_ident() in self.threads or on_device_thread():
            try:
                torch._C._will_engine_execute_node(self.node)  # type: ignore[arg-type]
            except RuntimeError:  # the engine's answer for a leaf autograd.grad captures
                return None
        return self.hook(grad)


class _HeldHooks(collections.OrderedDict):  # type: ignore[type-arg]
    """A leaf's stand-in hook dict during a capture; see :func:`silenced_tensor_hooks`.

    Its own storage (what the engine reads) holds the leaf's hooks, silent at
    the capture; Python sees it empty, as code that inspects a leaf's hooks
    did before. What ``register_hook`` and ``RemovableHandle.remove`` do goes
    to ``held``, then to ``home`` (the leaf's own dict) once the capture is over.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self.home: dict[Any, Any] | None = None

    def _target(self) -> dict[Any, Any]:
        return self.held if self.home is None else self.home

    def __setitem__(self, key: Any, value: Any) -> None:
        self._target()[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self._target()

    def __delitem__(self, key: Any) -> None:
        del self._target()[key]

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def keys(self) -> Any:
        return {}.keys()

    def values(self) -> Any:
        return {}.values()

    def items(self) -> Any:
        return {}.items()

    def get(self, key: Any, default: Any = None) -> Any:
        return default


# Stand-ins that held hooks, per leaf: those hooks' handles refer to them weakly.
_STAND_INS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def silenced_gradient_hooks(
    params: Sequence[torch.Tensor], modules: Sequence[torch.nn.Module]
) -> contextlib.AbstractContextManager[None]:
    """Silence every gradient hook a user can register on ``params`` and ``modules`` (and globally).

    Tensor hooks and post-accumulate-grad hooks (``Tensor._backward_hooks``,
    ``Tensor._post_accumulate_grad_hooks``: read when called), and module
    backward hooks and pre-hooks, per module and global (``_backward_hooks``,
    ``_backward_pre_hooks``: read when a forward runs, so silenced across the
    forward whose backward would fire them).
    """
    from torch.nn.modules import module as module_py

    dicts: list[Any] = [module_py._global_backward_hooks, module_py._global_backward_pre_hooks]
    for param in params:
        dicts += [param._backward_hooks, getattr(param, "_post_accumulate_grad_hooks", None)]
    for root in modules:
        for sub in root.modules():
            dicts += [sub._backward_hooks, sub._backward_pre_hooks]
    return _silenced(dicts)


@contextlib.contextmanager
def _silenced(dicts: Iterable[dict[Any, Any] | None]) -> Iterator[None]:
    # Each hook is swapped for a no-op in place, so a hook removed meanwhile
    # (its key deleted) stays removed and one added meanwhile stays.
    saved: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
    seen: set[int] = set()
    for hooks in dicts:
        if hooks and id(hooks) not in seen:
            seen.add(id(hooks))
            saved.append((hooks, list(hooks.items())))
            for key in hooks:
                hooks[key] = _no_hook
    try:
        yield
    finally:
        for hooks, items in saved:
            for key, hook in items:
                if hooks.get(key) is _no_hook:
                    hooks[key] = hook


def _no_hook(*args: object) -> None:
    return None


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


def has_other_post_hooks(handle: Any) -> bool:
    """Whether the node a hook was just registered on (``handle``) has other hooks of its kind.

    A node keeps all its Python post hooks (and all its pre-hooks) in one
    dict, which the handle of each of them refers to.
    """
    hooks = handle.hooks_dict_ref()
    return hooks is not None and len(hooks) > 1


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


def tensor_hook_dicts(t: torch.Tensor) -> tuple[dict[Any, Any] | None, dict[Any, Any] | None]:
    """``t``'s tensor-hook dict (``register_hook``) and post-accumulate-grad hook dict, None where it has none."""
    return t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)


def module_backward_hook_dicts(module: torch.nn.Module) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``module``'s full-backward hook dict and backward pre-hook dict (the objects themselves)."""
    return module._backward_hooks, module._backward_pre_hooks
