"""Python's cyclic garbage collector, paused while a split backward's B or W runs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Keep the cyclic collector from running inside the block; re-enable it after, if it was on.

    B and W allocate a few objects per autograd node but make no garbage
    cycles; a collection triggered mid-pass re-traverses the whole heap
    (graph-sized), which made B's time erratic and superlinear in the nodes
    (a third of B on a 23 k-node stage). Cycles that hooks make meanwhile are
    collected at the next collection after the block.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
