"""Delayed weight-gradient work outside wgrad's stores, and the parameters a DDP step guard covers.

A guarded DDP (:func:`gradsafe.wgrad.guard_ddp_step`) must refuse its
reduction while any W of its parameters is outstanding. wgrad's
``WeightGradStore`` counts its own passes; a pipelining B whose W has not run
(a ``WeightGradHandoff``) reports here, since pipelining imports wgrad and not
the other way round. The guard reads both.

The guard also says here which parameters it covers, so that delayed work
meeting parameters with a ``main_grad`` (Megatron-core DDP's gradient buffer)
no guard covers warns once (:class:`UnguardedDDPWarning`): an unguarded DDP
would reduce whatever is outstanding, silently.
"""

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "PendingSource",
    "UnguardedDDPWarning",
    "cover",
    "forget_lost",
    "outstanding",
    "report_lost",
    "track",
    "uncover",
    "warn_if_unguarded",
]


class PendingSource(Protocol):
    def pending_leaves(self) -> Sequence[torch.Tensor]:
        """The parameters (each under every name a caller may give it) its W has yet to deliver to; empty once done."""
        ...


class _Lost:
    """Delayed work that will deliver nothing more: its parameters (weakly), their shapes, and why."""

    def __init__(self, params: Iterable[torch.Tensor], why: str) -> None:
        unique = {id(p): p for p in params}.values()
        self.params = tuple(weakref.ref(p) for p in unique)
        self.shapes = tuple(tuple(p.shape) for p in unique)
        self.why = why

    def touches(self, ids: set[int]) -> bool:
        return any(id(p) in ids for p in (r() for r in self.params) if p is not None)


_sources: weakref.WeakSet[PendingSource] = weakref.WeakSet()
_lost: collections.deque[_Lost] = collections.deque()
_lock = threading.Lock()


def track(source: PendingSource) -> None:
    """Count ``source`` as outstanding while its :meth:`~PendingSource.pending_leaves` are not empty (held weakly)."""
    _sources.add(source)


def report_lost(params: Iterable[torch.Tensor], why: str) -> None:
    """Delayed work of ``params`` will deliver nothing (dropped, or failed): outstanding until :func:`forget_lost`.

    Kept only for parameters a guard covers (only a guard reads it, and only
    its ``zero_grad_buffer()`` forgets it: nothing piles up without one).
    """
    covered = [p for p in params if p in _covered]
    if covered:
        with _lock:
            _lost.append(_Lost(covered, why))


def outstanding(ids: set[int]) -> tuple[int, list[str], list[tuple[int, ...]]]:
    """For the parameters ``ids``: the sources not yet run, why each lost one is lost, and the shapes concerned."""
    unrun = 0
    shapes: list[tuple[int, ...]] = []
    for source in list(_sources):
        hit = [p for p in source.pending_leaves() if id(p) in ids]
        if hit:
            unrun += 1
            shapes += [tuple(p.shape) for p in hit]
    with _lock:
        lost = [entry for entry in _lost if entry.touches(ids)]
    for entry in lost:
        shapes += entry.shapes
    return unrun, [entry.why for entry in lost], shapes


def forget_lost(ids: set[int]) -> None:
    """A new step starts for the parameters ``ids``: work lost in the last one no longer counts."""
    with _lock:
        kept = [e for e in _lost if not e.touches(ids) and any(r() is not None for r in e.params)]
        _lost.clear()
        _lost.extend(kept)


class UnguardedDDPWarning(UserWarning):
    """Delayed weight gradients met parameters with a ``main_grad`` that no ``guard_ddp_step`` covers."""


_covered: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> number of guards covering it
_warned = False


def cover(params: Iterable[torch.Tensor]) -> None:
    """A DDP step guard now covers ``params``."""
    for p in params:
        _covered[p] = _covered.get(p, 0) + 1


def uncover(params: Iterable[torch.Tensor]) -> None:
    """A DDP step guard no longer covers ``params``."""
    for p in params:
        count = _covered.get(p, 0) - 1
        if count > 0:
            _covered[p] = count
        else:
            _covered.pop(p, None)


def warn_if_unguarded(params: Iterable[torch.Tensor], what: str) -> None:
    """Warn once per process if delayed work (``what``) meets a parameter with a ``main_grad`` no guard covers."""
    global _warned
    if _warned:
        return
    for p in params:
        if hasattr(p, "main_grad") and p not in _covered:
            _warned = True
            warnings.warn(
                f"{what} delays the weight gradient of a parameter of shape {tuple(p.shape)} that "
                "has a main_grad (Megatron-core DDP's gradient buffer), and no "
                "gradsafe.wgrad.guard_ddp_step covers it: that DDP's reduction "
                "(finish_grad_sync, finalize_model_grads) would reduce main_grad while a W is "
                "still outstanding, silently short, and the late W would add its gradient "
                "unreduced. Call guard_ddp_step(ddp) on each DDP model chunk (docs/wgrad.md); "
                "it refuses such a reduction. (Warned once per process; filter "
                "gradsafe.wgrad.UnguardedDDPWarning where main_grad is not Megatron's.)",
                UnguardedDDPWarning,
                stacklevel=3,
            )
            return
