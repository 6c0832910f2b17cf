"""A leaf's tensor hooks silenced while B captures a gradient at it, and W's deliveries marked.

Private torch read here: ``Tensor._backward_hooks`` (the dict the engine reads a
leaf's hooks from at call time, replaced by a stand-in during a capture, or its
hooks wrapped in place while a W delivers the leaf: :func:`silenced_tensor_hooks`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils.weak import WeakIdKeyDictionary

from gradsafe.pipelining._torch._engine import on_device_thread

__all__ = ["ACCUMULATOR_READS", "delivering", "silenced_tensor_hooks"]


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
