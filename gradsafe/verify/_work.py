"""W's share of the backward work: matmul FLOPs counted per backward step, per stage.

A zero-bubble schedule fills its bubbles with W, so a split is only as useful
as the share of the backward it leaves to W. The FLOPs are those of
``torch.utils.flop_counter.flop_registry`` (matmuls, convolutions, attention),
counted by a dispatch mode of verify's own: ``FlopCounterMode`` also hooks
every module's forward, and the ops those hooks add abort a checkpointed
block's recomputation. The mode is thread-local: a CUDA backward, which
autograd runs on a device thread, is not counted (``verify`` refuses it).
"""

from __future__ import annotations

import collections
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["MatmulFlops"]


class MatmulFlops(TorchDispatchMode):
    """FLOPs of the ops ``flop_registry`` knows, summed under the key ``at`` names at the time."""

    def __init__(self) -> None:
        super().__init__()
        self.by_key: collections.Counter[tuple[str, int]] = collections.Counter()
        self.at: tuple[str, int] | None = None  # (event kind, stage) while a backward step runs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None and self.at is not None:
            self.by_key[self.at] += count(*args, **kwargs, out_val=out)
        return out
