"""Live tensor memory on any device, CPU included: the storages operators create, while they live.

torch's own memory statistics exist for CUDA only; a dispatch mode sees every
operator's outputs on every device. Used by ``verify(memory=True)`` and by
benchmarks/pipelining_memory.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gradsafe.pipelining._torch import TorchDispatchMode, storage_key

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """While active, tracks every tensor storage an operator creates: ``live()`` bytes and ``peak``.

    Storages of ``existing`` tensors (parameters, inputs) are never counted, so
    a view of a parameter is not new memory. ``peak`` is the largest live total
    seen after any operator; storages created outside the mode are not seen.
    Thread-local like every dispatch mode: operators run on other threads are
    not counted (CPU autograd runs on the calling thread).
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self._existing = {storage_key(t) for t in existing}
        self.peak = 0

    def live(self) -> int:
        """Bytes of the counted storages still alive."""
        self._storages = {k: v for k, v in self._storages.items() if not v[0].expired()}
        return sum(n for _, n in self._storages.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key not in self._storages and key not in self._existing:
                    storage = t.untyped_storage()
                    self._storages[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.live())
        return out
