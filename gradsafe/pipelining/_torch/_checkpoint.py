"""Non-reentrant activation checkpointing: the holders a node's saved tensors are packed as.

Private torch read here: ``torch.utils.checkpoint._Holder`` and its
``handles`` dict (one ``_Handle`` per graph task or ``GraphExecGroup``,
keying that group's recomputed tensor in the region's
``_CheckpointFrame.recomputed``), reached through a node's
``_raw_saved_*`` (``SavedTensor.data``, the packed value, and
``SavedTensor.unpack_hook``); the region's ``_CheckpointFrame``, read from
that unpack hook's closure (``frame``), and its ``recompute_fn``'s closure
(``preserve_rng_state``, ``recompute_context``).

A checkpointed region recomputes on the first unpack of any of its holders
in a group, and each holder's unpack then sets its ``handles[group]`` to
None, which drops the recomputed tensor. :func:`unpack_twice` lets one
unpack under a group leave the handle in place, so a node's saved tensors
unpack once in B and once more in W, both under the microbatch's group:
the region recomputes once, and W reads the tensors B's recomputation made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch.utils.checkpoint
from torch.autograd.graph import Node

from gradsafe.pipelining._torch._nodes import saved_names

__all__ = ["checkpoint_holders", "recomputes_alike", "unpack_twice"]

# None on a torch without non-reentrant checkpoint holders: no saved tensor is one.
_HOLDER: type | None = getattr(torch.utils.checkpoint, "_Holder", None)


def checkpoint_holders(node: Node) -> tuple[Any, ...] | None:
    """The holders non-reentrant ``torch.utils.checkpoint`` packed built-in ``node``'s saved tensors as.

    None when some saved tensor came back through other saved-tensor hooks
    (offloading, a user's own): their unpack cannot be told to happen twice.
    Empty when no saved tensor went through hooks.
    """
    holders: list[Any] = []
    for name in saved_names(type(node)):
        saved = getattr(node, name)
        for item in saved if isinstance(saved, (list, tuple)) else (saved,):
            if getattr(item, "unpack_hook", None) is None:
                continue
            packed = item.data
            if _HOLDER is None or not isinstance(packed, _HOLDER):
                return None
            holders.append(packed)
    return tuple(holders)


class _Handles(dict[Any, Any]):
    """A holder's ``handles`` while B runs: B's unpack under ``group`` leaves the handle in place."""

    __slots__ = ("group", "in_b")

    def __init__(self, handles: dict[Any, Any], group: Any) -> None:
        super().__init__(handles)
        self.group = group
        self.in_b = True

    def __setitem__(self, key: Any, value: Any) -> None:
        if value is None and key is self.group and self.in_b:
            # B's unpack: keep the handle (and with it the recomputed tensor)
            # for W's unpack of the same saved tensor.
            self.in_b = False
            if dict.get(self, key) is not None:
                return
        dict.__setitem__(self, key, value)


@contextlib.contextmanager
def unpack_twice(holders: Sequence[Any], group: Any) -> Iterator[None]:
    """While the ``with`` block (B's engine call) runs, unpacking a holder under ``group`` keeps it.

    Each holder's first unpack under ``group`` inside the block leaves its
    recomputed tensor in place; the next one (W's) takes it as usual and
    frees it. A holder unpacked no time in the block is left as torch
    made it (its tensor stays until its own unpack, as without gradsafe).
    """
    wrapped = []
    for holder in holders:
        handles = _Handles(holder.handles, group)
        holder.handles = handles
        wrapped.append(handles)
    try:
        yield
    finally:
        for handles in wrapped:
            handles.in_b = False


def recomputes_alike(node: Node) -> bool:
    """Whether recomputing again the regions ``node``'s saved tensors come from gives the same tensors.

    True for a plain region (no ``context_fn``: selective checkpointing's
    cache serves one recomputation only) that restores the RNG state
    (``preserve_rng_state=True``: dropout draws the forward's masks). False
    for anything else, and wherever this torch's checkpoint is not built as
    read here.
    """
    for name in saved_names(type(node)):
        saved = getattr(node, name)
        for item in saved if isinstance(saved, (list, tuple)) else (saved,):
            hook = getattr(item, "unpack_hook", None)
            if hook is None:
                continue
            frame = _closure(hook).get("frame")
            cells = _closure(getattr(frame, "recompute_fn", None))
            if cells.get("preserve_rng_state") is not True:
                return False
            if type(cells.get("recompute_context")) is not contextlib.nullcontext:
                return False
    return True


def _closure(fn: Any) -> dict[str, Any]:
    """The variables ``fn`` closes over that hold a value (empty for anything else)."""
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    found: dict[str, Any] = {}
    for name, cell in zip(getattr(code, "co_freevars", ()), cells):
        try:
            found[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return found
