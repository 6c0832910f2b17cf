"""One rank of a 2-rank zero-bubble schedule run on gloo (run by test_pipelining_schedule.py).

argv: rank port mode(gradsafe|upstream) schedule(ZBV|InterleavedZB) outdir. Writes outdir/rank{r}.pt with the
stages' parameter grads and post-accumulate hook counts, or a crash message.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from gradsafe.pipelining._hazards import ReusedAroundOther

MICROBATCHES = 4
STAGES = 4
DIM = 8


def build_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    # One nn.Linear applied at two nested sites with another Linear between them.
    return [ReusedAroundOther(DIM).double() for _ in range(STAGES)]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(8, DIM, dtype=torch.float64), torch.randn(8, DIM, dtype=torch.float64)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def main() -> None:
    rank, port, mode, kind, outdir = (int(sys.argv[1]), *sys.argv[2:6])
    result: dict[str, object] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=60),
        )
        from torch.distributed.pipelining import (
            PipelineStage,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        if mode == "gradsafe":
            import gradsafe

            gradsafe.patch("pipelining")
        modules = build_stages()
        if kind == "ZBV":
            indices = [rank, STAGES - 1 - rank]  # V shape: rank 0 holds stages 0 and 3
            schedule_cls = ScheduleZBVZeroBubble
        else:
            indices = [rank, rank + 2]  # loop: rank 0 holds stages 0 and 2
            schedule_cls = ScheduleInterleavedZeroBubble
        counts: dict[str, int] = {}
        for index in indices:
            for name, p in modules[index].named_parameters():
                key = f"{index}.{name}"
                counts[key] = 0

                def hook(p: torch.Tensor, key: str = key) -> None:
                    counts[key] += 1

                p.register_post_accumulate_grad_hook(hook)
        stages = [
            PipelineStage(modules[i], i, STAGES, torch.device("cpu"), group=dist.group.WORLD)
            for i in indices
        ]
        schedule = schedule_cls(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
        x, y = batch()
        has_first, has_last = 0 in indices, STAGES - 1 in indices
        schedule.step(
            *((x,) if has_first else ()), **({"target": y} if has_last else {})
        )
        result["grads"] = {
            f"{i}.{n}": p.grad.clone() for i in indices for n, p in modules[i].named_parameters()
        }
        result["hooks"] = counts
    except Exception as exc:  # the upstream run is expected to fail; report, don't hang
        result["crash"] = f"{type(exc).__name__}: {exc}"[:2000] + "\n" + traceback.format_exc()[-2000:]
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    if "crash" in result:
        os._exit(1)  # close the sockets so the peer fails fast instead of waiting on a recv
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
