"""The rank side of tests/_ranks.py's ``run_ranks``: join the gloo group, run, save the result."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def run_rank(rank: int, init_method: str, outdir: str, body: Callable[[], dict[str, Any]]) -> None:
    """Run ``body`` on a 2-rank gloo group and save what it returns as ``outdir/rank{rank}.pt``.

    A crash is saved as ``{"crash": message and traceback}`` and the process
    exits at once, so the peer fails at its own timeout instead of hanging.
    """
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=60),
        )
        result = body()
    except Exception as exc:  # report, don't hang the peer
        result = {"crash": f"{type(exc).__name__}: {exc}"[:2000] + "\n" + traceback.format_exc()}
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    if "crash" in result:
        os._exit(1)
    dist.destroy_process_group()
