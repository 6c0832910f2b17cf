"""Activation checkpointing turned off for one run: the reference of ``--work``'s W-share flag.

``torch.utils.checkpoint.checkpoint`` looks up, at call time, a module
global per path: the non-reentrant generator (``use_reentrant=False``,
selective AC too; ``_checkpoint_without_reentrant_generator`` on torch 2.11
to 2.13, ``_checkpoint_without_reentrant_generator_impl`` from 2.14) and
``CheckpointFunction`` (reentrant). Wrappers that captured ``checkpoint``
itself when they wrapped a block (torch's ``checkpoint_wrapper``,
torchtitan's) still call it, so replacing those two globals runs every such
region as a plain call. Which generator ``checkpoint`` calls is read from its
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


def _plain_generator(*args: Any, **kwargs: Any) -> Iterator[None]:
    """What ``checkpoint`` drives around the region's forward (before, after): nothing."""
    yield


class _PlainFunction:
    """``CheckpointFunction.apply(function, preserve_rng_state, *args)``: just the call."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        return function(*args)


@contextlib.contextmanager
def checkpointing_off(names: tuple[str, str]) -> Iterator[None]:
    """Inside, ``torch.utils.checkpoint.checkpoint`` runs its function without checkpointing;
    ``names`` are :func:`globals_to_replace`'s. Restored on leaving, also on an exception."""
    generator, reentrant = names
    saved = {name: getattr(torch_checkpoint, name) for name in names}
    setattr(torch_checkpoint, generator, _plain_generator)
    setattr(torch_checkpoint, reentrant, _PlainFunction)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch_checkpoint, name, value)
