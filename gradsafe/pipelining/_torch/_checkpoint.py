"""Non-reentrant activation checkpointing: the holders a node's saved tensors are packed as.

Private torch read here: ``torch.utils.checkpoint._Holder`` and its
``handles`` dict (one ``_Handle`` per graph task or ``GraphExecGroup``,
keying that group's recomputed tensor in the region's
``_CheckpointFrame.recomputed``), reached through a node's
``_raw_saved_*`` (``SavedTensor.data``, the packed value, and
``SavedTensor.unpack_hook``); the region's ``_CheckpointFrame``, read from
that unpack hook's closure (``frame``), its ``recompute_fn``'s closure
(``preserve_rng_state``, ``recompute_context``), and its saved inputs
(``saved_args``; on torch 2.11 its ``input_saver``'s node's
``_raw_saved_tensors``), which a region around it packs.

A checkpointed region recomputes on the first unpack of any of its holders
in a group, and each holder's unpack then sets its ``handles[group]`` to
None, which drops the recomputed tensor. :func:`unpack_twice` lets one
unpack under a group leave the handle in place, so a node's saved tensors
unpack once in B and once more in W, both under the microbatch's group:
the region recomputes once, and W reads the tensors B's recomputation made.

All of that is behaviour of torch's, not API: :mod:`._probe` checks it once
per process, on a tiny checkpointed region, the first time a policy relies on
it; where it differs, the policy falls back to ``CheckpointedWeights.IN_B``
(exact).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch.autograd.graph import Node

from gradsafe.pipelining._torch._nodes import first_modified, saved_names, version

__all__ = [
    "KeptRecomputed",
    "checkpoint_holders",
    "recomputes_alike",
    "unpack_saved",
    "unpack_twice",
]

#: The holder class non-reentrant checkpoint packs saved tensors as (read at call time).
HOLDER_NAME = "_Holder"


def _holder_class() -> type | None:
    """None on a torch without it: no saved tensor is a holder then."""
    found = getattr(torch.utils.checkpoint, HOLDER_NAME, None)
    return found if isinstance(found, type) else None


def checkpoint_holders(node: Node) -> tuple[tuple[Any, Any], ...] | None:
    """The holders non-reentrant ``torch.utils.checkpoint`` packed built-in ``node``'s saved
    tensors as, each with its region's ``_CheckpointFrame`` (None if not read here).

    None when some saved tensor came back through other saved-tensor hooks
    (offloading, a user's own): their unpack cannot be told to happen twice.
    Empty when no saved tensor went through hooks.
    """
    holders: list[tuple[Any, Any]] = []
    for name in saved_names(type(node)):
        saved = getattr(node, name)
        for item in saved if isinstance(saved, (list, tuple)) else (saved,):
            if getattr(item, "unpack_hook", None) is None:
                continue
            packed = item.data
            holder = _holder_class()
            if holder is None or not isinstance(packed, holder):
                return None
            holders.append((packed, _closure(item.unpack_hook).get("frame")))
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


class KeptRecomputed:
    """The tensors B's recomputation kept for W (held weakly), with their versions when B ended.

    Unpacking a checkpointed tensor checks no version, and a recomputed
    tensor is a view of any tensor from outside its region that an op saved
    (the region's input, a weight, a buffer): one of those modified in place
    between B and W changes what W reads. W refuses then (:meth:`modified`),
    as it does for a stage without checkpointing.
    """

    def __init__(self) -> None:
        self._seen: list[tuple[weakref.ref[torch.Tensor], int]] = []

    def record(self, holders: Sequence[tuple[Any, Any]], group: Any) -> None:
        for holder, frame in holders:
            handle = dict.get(holder.handles, group)
            by_handle = None if frame is None else frame.recomputed.get(group)
            tensor = None if handle is None or by_handle is None else by_handle.get(handle)
            if isinstance(tensor, torch.Tensor):
                self._seen.append((weakref.ref(tensor), version(tensor)))

    def modified(self) -> torch.Tensor | None:
        """A kept tensor changed in place since B (None: none did)."""
        return first_modified(self._seen)


@contextlib.contextmanager
def unpack_twice(holders: Sequence[tuple[Any, Any]], group: Any) -> Iterator[KeptRecomputed]:
    """While the ``with`` block (B's engine call) runs, unpacking a holder under ``group`` keeps it.

    Each holder's first unpack under ``group`` inside the block leaves its
    recomputed tensor in place; the next one (W's) takes it as usual and
    frees it. A holder unpacked no time in the block is left as torch
    made it (its tensor stays until its own unpack, as without gradsafe).
    The value is filled when the block ends: the tensors kept for W.
    """
    wrapped = []
    for holder, _ in holders:
        handles = _Handles(holder.handles, group)
        holder.handles = handles
        wrapped.append(handles)
    kept = KeptRecomputed()
    try:
        yield kept
    finally:
        for handles in wrapped:
            handles.in_b = False
        kept.record(holders, group)


def recomputes_alike(node: Node) -> bool:
    """Whether recomputing again the regions ``node``'s saved tensors come from gives the same tensors.

    True for a plain region (no ``context_fn``: selective checkpointing's
    cache serves one recomputation only) that restores the RNG state
    (``preserve_rng_state=True``: dropout draws the forward's masks), inside
    only such regions: a nested region's inputs are saved by the region
    around it, which recomputes again too to give them. False for anything
    else, and wherever this torch's checkpoint is not built as read here.
    """
    hooks = _unpack_hooks(
        item for name in saved_names(type(node)) for item in _items(getattr(node, name))
    )
    seen: set[int] = set()
    while hooks:
        frame = _closure(hooks.pop()).get("frame")
        if id(frame) in seen:
            continue
        seen.add(id(frame))
        cells = _closure(getattr(frame, "recompute_fn", None))
        if cells.get("preserve_rng_state") is not True:
            return False
        if type(cells.get("recompute_context")) is not contextlib.nullcontext:
            return False
        inputs = _saved_inputs(frame)
        if inputs is None:
            return False
        hooks += _unpack_hooks(inputs)
    return True


def unpack_saved(node: Node) -> list[Any]:
    """Unpack built-in ``node``'s saved tensors once (``_saved_*``), in the order of :func:`saved_names`."""
    return [
        getattr(node, name.replace("_raw_saved_", "_saved_", 1)) for name in saved_names(type(node))
    ]


def _items(saved: Any) -> Sequence[Any]:
    return saved if isinstance(saved, (list, tuple)) else (saved,)


def _unpack_hooks(items: Iterable[Any]) -> list[Any]:
    found = []
    for item in items:
        hook = getattr(item, "unpack_hook", None)
        if hook is not None:
            found.append(hook)
    return found


def _saved_inputs(frame: Any) -> Sequence[Any] | None:
    """A region's saved inputs (``SavedTensor`` among other values); None if not readable here.

    torch 2.12+ keeps them on the frame (``saved_args``); 2.11 on the node
    of its ``input_saver`` output (``_raw_saved_tensors``).
    """
    saved = getattr(frame, "saved_args", None)
    if saved is not None:
        return list(saved)
    saver = getattr(getattr(frame, "input_saver", None), "grad_fn", None)
    raw = getattr(saver, "_raw_saved_tensors", None)
    return None if raw is None else list(raw)


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
