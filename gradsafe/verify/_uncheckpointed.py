"""Activation checkpointing turned off for one run: the reference of ``--work``'s W-share flag.

``torch.utils.checkpoint.checkpoint`` looks up, at call time, a module
global per path: the non-reentrant generator (``use_reentrant=False``,
selective AC too; ``_checkpoint_without_reentrant_generator`` on torch 2.11
to 2.13, ``_checkpoint_without_reentrant_generator_impl`` from 2.14) and
``CheckpointFunction`` (reentrant). Wrappers that captured ``checkpoint``
itself when they wrapped a block (torch's ``checkpoint_wrapper``,
torchtitan's) still call it, so replacing those two globals runs every such
region as a plain call. The replacements are
process-wide but act only on threads inside :func:`checkpointing_off` (a
training loop, or another verify's checkpointed runs, on other threads keep
checkpointing), and concurrent entries share one replacement, which the last
to leave restores. Which generator ``checkpoint`` calls is read from its
code and that of the module's functions it calls (a feature of the installed
torch, not its version); where neither is there, the reference is not
measured and the report says why.

Not turned off: regions that imported the generator themselves (torch's
composable ``torch.distributed._composable.checkpoint``), and compiled regions
(``torch.compile`` traces ``checkpoint`` into its graph). The reference run's
recompute count shows what stayed checkpointed.

Private torch read here: ``torch.utils.checkpoint``'s generator and
``CheckpointFunction`` globals.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

__all__ = ["checkpointing_off", "globals_to_replace"]

_GENERATORS = (
    "_checkpoint_without_reentrant_generator_impl",
    "_checkpoint_without_reentrant_generator",
)
_REENTRANT = "CheckpointFunction"


@functools.cache
def globals_to_replace() -> tuple[str, str] | str:
    """The names of the non-reentrant generator and the reentrant Function ``checkpoint`` calls
    on the installed torch, or why checkpointing cannot be turned off on it."""
    called = _called_names()
    generators = [n for n in _GENERATORS if n in called and hasattr(torch_checkpoint, n)]
    if len(generators) != 1 or _REENTRANT not in called:
        return (
            "torch.utils.checkpoint.checkpoint on this torch calls none of "
            f"{', '.join((*_GENERATORS, _REENTRANT))} as verify expects, so verify cannot "
            "run the stage without its checkpoints"
        )
    return generators[0], _REENTRANT


def _called_names() -> set[str]:
    """The globals ``checkpoint``'s code looks up, and those of the module's functions it calls
    (from torch 2.14 its body is ``_checkpoint_impl``, shared with the decorator form)."""
    code = inspect.unwrap(torch_checkpoint.checkpoint).__code__
    names = set(code.co_names)
    for name in code.co_names:
        callee = getattr(torch_checkpoint, name, None)
        if inspect.isfunction(callee) and callee.__module__ == torch_checkpoint.__name__:
            names.update(callee.__code__.co_names)
    return names


# Threads inside ``checkpointing_off`` now (a count per thread: verify's run may nest), the
# globals' originals while replaced, and how many entries share the replacement.
_OFF = threading.local()
_LOCK = threading.Lock()
_originals: dict[str, Any] = {}
_entered = 0


def _off() -> bool:
    return getattr(_OFF, "depth", 0) > 0


def _generator(*args: Any, **kwargs: Any) -> Iterator[None]:
    """What ``checkpoint`` drives around the region's forward (before, after): nothing on a
    thread inside ``checkpointing_off``, the original generator on any other."""
    if _off():
        yield
        return
    yield from _originals["generator"](*args, **kwargs)


class _Function:
    """``CheckpointFunction.apply(function, preserve_rng_state, *args)``: just the call on a
    thread inside ``checkpointing_off``, the original Function on any other."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        if _off():
            return function(*args)
        return _originals["reentrant"].apply(function, preserve_rng_state, *args)


@contextlib.contextmanager
def checkpointing_off(names: tuple[str, str]) -> Iterator[None]:
    """Inside, ``torch.utils.checkpoint.checkpoint`` runs its function without checkpointing
    on this thread; ``names`` are :func:`globals_to_replace`'s. The globals are replaced
    process-wide (other threads' calls go to the originals), once for concurrent entries; the
    last to leave restores them, also on an exception."""
    global _entered
    generator, reentrant = names
    with _LOCK:
        if _entered == 0:
            _originals.update(
                generator=getattr(torch_checkpoint, generator),
                reentrant=getattr(torch_checkpoint, reentrant),
            )
            setattr(torch_checkpoint, generator, _generator)
            setattr(torch_checkpoint, reentrant, _Function)
        _entered += 1
    _OFF.depth = getattr(_OFF, "depth", 0) + 1
    try:
        yield
    finally:
        _OFF.depth -= 1
        with _LOCK:
            _entered -= 1
            if _entered == 0:
                setattr(torch_checkpoint, generator, _originals["generator"])
                setattr(torch_checkpoint, reentrant, _originals["reentrant"])
                _originals.clear()
