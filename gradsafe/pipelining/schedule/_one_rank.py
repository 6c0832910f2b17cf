"""A one-rank gloo process group in this process: what the schedule reproductions run on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["one_rank_world"]


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """A one-rank gloo process group in this process (refused where one exists already)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a default process group exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
