"""Bytes of tensor storage alive, counted operator by operator (device-independent, no allocator).

torch's own memory statistics exist for CUDA only; a dispatch mode sees every
operator's outputs on every device. ``verify(memory=True)`` counts with it;
tests and benchmarks use it as :class:`gradsafe.testing.LiveStorage`.

Private torch read here: ``TorchDispatchMode`` (``torch.utils._python_dispatch``),
``UntypedStorage._cdata`` and ``_new_with_weak_ptr`` (a storage's identity and
its present size through a weak reference), and a sparse tensor's
``_indices``/``_values``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveStorage"]


class LiveStorage(TorchDispatchMode):
    """Counts the storages operators create while the mode is active, as long as they live.

    Every storage an operator's output uses is counted once, from the
    operator that created it until the last tensor using it is freed;
    storages of ``existing`` tensors (parameters, inputs) are never counted,
    nor views of them. The count is read after every operator, so
    :attr:`peak` is the most alive after any operator (a transient inside one
    operator is not seen). A storage counts at its size when read: FSDP2
    frees and re-allocates its unsharded parameters by resizing their
    storages in place (``UntypedStorage.resize_``, which no dispatch mode
    sees), so a resize shows from the next operator on. Like any dispatch
    mode it sees operators run on the thread that entered it, which
    includes the autograd engine's CPU work.

    Example::

        with LiveStorage(model.parameters()) as live:
            loss = model(x).sum()
            live.mark()
            loss.backward()
            print(live.live(), live.peak_since_mark)
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._storages: dict[int, StorageWeakRef] = {}
        self._existing = {storage_key(t) for t in existing}
        #: The most bytes alive after any operator since the mode was entered.
        self.peak = 0
        #: The most bytes alive after any operator since the last :meth:`mark`.
        self.peak_since_mark = 0

    def live(self) -> int:
        """Bytes of counted storages alive now, at their present sizes."""
        alive: dict[int, StorageWeakRef] = {}
        total = 0
        for key, ref in self._storages.items():
            nbytes = live_nbytes(ref)
            if nbytes is not None:
                alive[key] = ref
                total += nbytes
        self._storages = alive
        return total

    def mark(self) -> int:
        """Start a new :attr:`peak_since_mark` window; returns the bytes alive now."""
        now = self.live()
        self.peak_since_mark = now
        return now

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                for storage in storages_of(t):
                    self._track(storage)
        now = self.live()
        self.peak = max(self.peak, now)
        self.peak_since_mark = max(self.peak_since_mark, now)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage_key(storage)
        if key not in self._storages and key not in self._existing:
            self._storages[key] = StorageWeakRef(storage)


def storages_of(t: torch.Tensor) -> tuple[torch.UntypedStorage, ...]:
    """The storages ``t``'s data lives in: its own, or a sparse COO tensor's indices and values."""
    if t.is_sparse:  # uncoalesced too, which the public indices()/values() refuse
        return (t._indices().untyped_storage(), t._values().untyped_storage())
    return (t.untyped_storage(),)


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """An identity of a storage (``t``'s, shared by its views), valid while the storage lives."""
    storage = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    return storage._cdata


def live_nbytes(ref: StorageWeakRef) -> int | None:
    """The present size in bytes of the storage ``ref`` refers to weakly, None once it is freed.

    Read now, not at creation: FSDP2 frees and re-gathers its unsharded
    parameters by resizing their storages in place.
    """
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return None if storage is None else storage.nbytes()
