"""One of 2 gloo ranks: live storage around every B and W of real ScheduleZBVZeroBubble steps.

Run by test_pipelining_memory_zbv.py. argv: rank init_method outdir. Writes outdir/rank{r}.pt:
``{"points": {(stage, impl): {point: bytes}}}`` or ``{"crash": ...}``.

4 stages of Linear + tanh layers (rank 0 holds stages 0 and 3, rank 1 stages 1
and 2), weight- and activation-dominated, 4 microbatches, 2 steps without
zeroing the gradients (the second step's W add into ``.grad`` held from the
start); torch's split and gradsafe's run one after the other in the same
processes, each on a fresh copy of the same stages. The schedule's order is
static, so the k-th B (W) call of one run is the k-th of the other: for each,
the peak during it and what is alive right after it; then what is alive after
each step (the returned losses kept) and the peak of both steps.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch
from torch import nn

from tests._rank_worker import run_rank

MICROBATCHES = 4
STEPS = 2
# (layers per stage, dim, tokens per microbatch)
STAGES = {"weight-dominated": (2, 256, 8), "activation-dominated": (2, 32, 512)}


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def measure(rank: int, stage: str, impl: str) -> dict[str, int]:
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble
    from torch.distributed.pipelining import _backward as torch_split
    from torch.distributed.pipelining import stage as stage_module

    from gradsafe.pipelining import stage_backward_input, stage_backward_weight
    from gradsafe.testing import LiveStorage

    b, w = (
        (stage_backward_input, stage_backward_weight)
        if impl == "gradsafe"
        else (torch_split.stage_backward_input, torch_split.stage_backward_weight)
    )
    layers, dim, tokens = STAGES[stage]
    torch.manual_seed(0)
    modules = [
        nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())))
        for _ in range(4)
    ]
    indices = [rank, 3 - rank]
    stages = [PipelineStage(modules[i], i, 4, torch.device("cpu")) for i in indices]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=MICROBATCHES, loss_fn=_mse)
    x = torch.randn(tokens * MICROBATCHES, dim)
    y = torch.randn(tokens * MICROBATCHES, dim)
    existing = [p for i in indices for p in modules[i].parameters()] + [x, y]
    points: dict[str, int] = {}
    calls = {"B": 0, "W": 0}
    with LiveStorage(existing) as live:

        def recorded(kind: str, run: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                live.mark()
                result = run(*args, **kwargs)
                name = f"{kind}{calls[kind]}"
                calls[kind] += 1
                points[f"peak during {name}"] = live.peak_since_mark
                points[f"after {name}"] = live.live()
                return result

            return call

        saved = stage_module.stage_backward_input, stage_module.stage_backward_weight
        stage_module.stage_backward_input = recorded("B", b)  # type: ignore[assignment]
        stage_module.stage_backward_weight = recorded("W", w)  # type: ignore[assignment]
        try:
            losses: list[torch.Tensor] = []
            for step in range(STEPS):
                losses.clear()
                schedule.step(x, target=y, losses=losses) if rank == 0 else schedule.step()
                gc.collect()
                points[f"after step {step} (losses kept)"] = live.live()
        finally:
            stage_module.stage_backward_input, stage_module.stage_backward_weight = saved
        points["peak of both steps"] = live.peak
    return points


def main() -> None:
    rank, init_method, outdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]

    def body() -> dict[str, Any]:
        points = {
            (stage, impl): measure(rank, stage, impl)
            for stage in STAGES
            for impl in ("torch", "gradsafe")
        }
        return {"points": points}

    run_rank(rank, init_method, outdir, body)


if __name__ == "__main__":
    main()
