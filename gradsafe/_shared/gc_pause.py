"""Python's cyclic garbage collector, paused while a split backward's B or W runs."""

from __future__ import annotations

import gc

__all__ = ["collector_paused"]


class collector_paused:  # noqa: N801 - used like the function it replaced: `with collector_paused():`
    """Keep the cyclic collector from running inside the block; re-enable it after, if it was on.

    B and W allocate a few objects per autograd node but make no garbage
    cycles; a collection triggered mid-pass re-traverses the whole heap
    (graph-sized), which made B's time erratic and superlinear in the nodes
    (a third of B on a 23 k-node stage). Cycles that hooks make meanwhile are
    collected at the next collection after the block.

    A class, not a generator-based context manager: B and W enter it once
    per call, and a generator's setup costs more than the rest of it. One
    instance per ``with`` (it remembers whether the collector was on).
    """

    __slots__ = ("_collecting",)

    def __enter__(self) -> None:
        self._collecting = gc.isenabled()
        if self._collecting:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._collecting:
            gc.enable()
