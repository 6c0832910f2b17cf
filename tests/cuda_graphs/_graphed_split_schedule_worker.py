"""One rank of a 2-rank zero-bubble schedule whose stages are graphed split stages (run by test_graphed_split_schedule.py).

argv: rank init_method schedule(ZBV|InterleavedZB) outdir. CUDA graphs are emulated on
the CPU. Each rank graphs its two stage modules with
make_graphed_split_callables in the order CaptureOrder derives for the
schedule, hands PipelineStage the graphed modules and their dw_builder, and
runs two schedule steps. Writes outdir/rank{r}.pt with the stages' parameter
grads after the second step, post-accumulate hook counts, and the capture order
(or a crash message).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

MICROBATCHES = 4
STAGES = 4
DIM = 8
ROWS = 8
STEPS = 2


class ReusedAroundOther(nn.Module):
    """One nn.Linear applied at two nested sites with another Linear between them."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.Linear(DIM, DIM, dtype=torch.float64)
        self.inner = nn.Linear(DIM, DIM, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.outer(torch.tanh(self.inner(self.outer(x)))))


def build_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [ReusedAroundOther() for _ in range(STAGES)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1 + step)
    return torch.randn(ROWS, DIM, dtype=torch.float64), torch.randn(ROWS, DIM, dtype=torch.float64)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def stage_indices(kind: str, rank: int) -> list[int]:
    # ZBV: a V (rank 0 holds stages 0 and 3); InterleavedZB: a loop (rank 0 holds 0 and 2).
    return sorted([rank, STAGES - 1 - rank] if kind == "ZBV" else [rank, rank + 2])


def run(rank: int, kind: str) -> dict[str, object]:
    result: dict[str, object] = {}
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    from gradsafe.cuda_graphs.capture_order import CaptureOrder
    from gradsafe.cuda_graphs.split_stages import make_graphed_split_callables
    from gradsafe.testing import emulate_cuda_graphs

    schedule_cls = ScheduleZBVZeroBubble if kind == "ZBV" else ScheduleInterleavedZeroBubble
    modules = build_stages()
    indices = stage_indices(kind, rank)
    rows = ROWS // MICROBATCHES
    with emulate_cuda_graphs():
        order = CaptureOrder.from_schedule_class(
            schedule_cls, rank=rank, ranks=2, microbatches=MICROBATCHES
        )
        graphed = make_graphed_split_callables(
            [modules[i] for i in indices],
            [(torch.randn(rows, DIM, dtype=torch.float64, requires_grad=i != 0),) for i in indices],
            order,
        )
        counts: dict[str, int] = {}
        for index in indices:
            for name, p in modules[index].named_parameters():
                key = f"{index}.{name}"
                counts[key] = 0

                def hook(p: torch.Tensor, key: str = key) -> None:
                    counts[key] += 1

                p.register_post_accumulate_grad_hook(hook)

        # Static stage metadata: the stage runs no forward to infer it (which would
        # replay a graph out of order). requires_grad says which gradients flow.
        def example(requires_grad: bool) -> torch.Tensor:
            return torch.empty(rows, DIM, dtype=torch.float64, requires_grad=requires_grad)

        stages = [
            PipelineStage(
                modules[i],
                i,
                STAGES,
                torch.device("cpu"),
                input_args=(example(i != 0),),
                output_args=(example(True),),
                group=dist.group.WORLD,
                dw_builder=graphed.dw_builder(chunk),
            )
            for chunk, i in enumerate(indices)
        ]
        schedule = schedule_cls(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
        ran = CaptureOrder.from_schedule(schedule, rank)
        result["order_matches"] = ran.entries == order.entries
        for step in range(STEPS):
            for i in indices:
                modules[i].zero_grad(set_to_none=True)
            x, y = batch(step)
            has_first, has_last = 0 in indices, STAGES - 1 in indices
            schedule.step(*((x,) if has_first else ()), **({"target": y} if has_last else {}))
        result["position"] = graphed.position
    result["grads"] = {
        f"{i}.{n}": p.grad.clone() for i in indices for n, p in modules[i].named_parameters()
    }
    result["hooks"] = counts
    return result


def main() -> None:
    rank, init_method, kind, outdir = (int(sys.argv[1]), *sys.argv[2:5])
    from tests._rank_worker import run_rank  # the workers' path has the repository root

    run_rank(rank, init_method, outdir, lambda: run(rank, kind))


if __name__ == "__main__":
    main()
