"""One rank of a 2-rank zero-bubble schedule run on gloo (run by test_pipelining_schedule.py).

argv: rank init_method mode(gradsafe|upstream) schedule(ZBV|InterleavedZB)
wrapper(none|ddp|fsdp|fsdp_mp|fsdp_dp2) outdir. Each pipeline rank holds two of the four
stages, optionally wrapped: DDP, or FSDP2 over the rank's own one-rank mesh (parameters are
still swapped between sharded and unsharded around every forward/backward), or, for fsdp_dp2,
FSDP2 sharded over 2 data-parallel ranks (4 ranks: PP 2 x DP 2, each DP rank on half the
batch). Trains STEPS SGD steps. Writes outdir/rank{r}.pt with the final
parameters, post-accumulate hook counts, and whether a microbatch's activation outlived the
step, or a crash message.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsafe.pipelining._hazards import ReusedAroundOther

MICROBATCHES = 4
STAGES = 4
STEPS = 3
DIM = 8
LR = 0.1


class TiedStage(ReusedAroundOther):
    """H1's overlapping groups, plus ``outer.weight`` tied as a head at a third site."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h + torch.tanh(h @ self.outer.weight.t())


def build_stages() -> list[nn.Module]:
    # The same initial values whatever the caller's default dtype (pytest's is fp64).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(0)
        return [TiedStage(DIM).double() for _ in range(STAGES)]
    finally:
        torch.set_default_dtype(previous)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [
        (torch.randn(8, DIM, dtype=torch.float64), torch.randn(8, DIM, dtype=torch.float64))
        for _ in range(STEPS)
    ]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def data_parallel(wrapper: str) -> int:
    return 2 if wrapper == "fsdp_dp2" else 1


def reference(dp: int = 1) -> dict[str, torch.Tensor]:
    """Single process: the same steps, each microbatch's loss divided by their number
    (the schedule's scaling) and by the data-parallel degree (FSDP2's average)."""
    modules = build_stages()
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    for x, y in batches():
        opt.zero_grad()
        for xd, yd in zip(x.chunk(dp), y.chunk(dp)):
            for xm, ym in zip(xd.chunk(MICROBATCHES), yd.chunk(MICROBATCHES)):
                h = xm
                for m in modules:
                    h = m(h)
                (loss_fn(h, ym) / (MICROBATCHES * dp)).backward()
        opt.step()
    return {
        f"{i}.{n}": p.detach().clone()
        for i, m in enumerate(modules)
        for n, p in m.named_parameters()
    }


def _wrap(module: nn.Module, wrapper: str, own_group: Any, allreduces: list[int]) -> nn.Module:
    if wrapper == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp = nn.parallel.DistributedDataParallel(module, process_group=own_group)
        slot = len(allreduces)
        allreduces.append(0)

        # Unannotated: DDP checks the annotations, which are strings in this module.
        def counting_allreduce(group, bucket):  # type: ignore[no-untyped-def]
            allreduces[slot] += 1
            return allreduce_hook(group, bucket)

        ddp.register_comm_hook(own_group, counting_allreduce)
        return ddp
    if wrapper in ("fsdp", "fsdp_mp", "fsdp_dp2"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(own_group, "cpu")
        if wrapper in ("fsdp", "fsdp_dp2"):
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
        else:
            policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
            fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return module


def _full(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)
    return (full() if full is not None else p).detach().clone()


def main() -> None:
    rank, init_method, mode, kind, wrapper, outdir = (int(sys.argv[1]), *sys.argv[2:7])
    dp = data_parallel(wrapper)
    pp_rank, dp_rank = divmod(rank, dp)
    result: dict[str, object] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=2 * dp,
            timeout=timedelta(seconds=60),
        )
        # Every rank creates every group, in the same order.
        pp_groups = [dist.new_group([d + dp * p for p in range(2)]) for d in range(dp)]
        dp_groups = [dist.new_group([dp * p + d for d in range(dp)]) for p in range(2)]
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
            indices = [pp_rank, STAGES - 1 - pp_rank]  # V shape: rank 0 holds stages 0 and 3
            schedule_cls = ScheduleZBVZeroBubble
        else:
            indices = [pp_rank, pp_rank + 2]  # loop: rank 0 holds stages 0 and 2
            schedule_cls = ScheduleInterleavedZeroBubble
        counts: dict[str, int] = {}
        for index in indices:
            for name, p in modules[index].named_parameters():
                key = f"{index}.{name}"
                counts[key] = 0

                def hook(p: torch.Tensor, key: str = key) -> None:
                    counts[key] += 1

                p.register_post_accumulate_grad_hook(hook)
        allreduces: list[int] = []  # per DDP stage: all-reduced buckets (one bucket each)
        wrapped = {i: _wrap(modules[i], wrapper, dp_groups[pp_rank], allreduces) for i in indices}
        stages = [
            PipelineStage(wrapped[i], i, STAGES, torch.device("cpu"), group=pp_groups[dp_rank])
            for i in indices
        ]
        schedule = schedule_cls(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
        opt = torch.optim.SGD([p for m in wrapped.values() for p in m.parameters()], lr=LR)
        has_first, has_last = 0 in indices, STAGES - 1 in indices
        probes: list[weakref.ref[torch.Tensor]] = []
        first = modules[indices[0]]
        # A saved activation of every microbatch: it must die with the step.
        first.inner.register_forward_hook(lambda m, args, out: probes.append(weakref.ref(out)))
        losses: list[torch.Tensor] = []
        for x, y in batches():
            x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
            opt.zero_grad()
            schedule.step(
                *((x,) if has_first else ()),
                **({"target": y, "losses": losses} if has_last else {}),
            )
            opt.step()
        gc.collect()
        # `losses` (kept, as a user would) must not keep any microbatch's graph alive.
        result["alive_activations"] = sum(ref() is not None for ref in probes)
        result["losses_with_graph"] = sum(loss.grad_fn is not None for loss in losses)
        result["params"] = {
            f"{i}.{n}": _full(p) for i in indices for n, p in modules[i].named_parameters()
        }
        result["hooks"] = counts
        result["allreduces"] = allreduces
    except Exception as exc:  # the upstream run is expected to fail; report, don't hang
        result["crash"] = (
            f"{type(exc).__name__}: {exc}"[:2000] + "\n" + traceback.format_exc()[-2000:]
        )
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    if "crash" in result:
        os._exit(1)  # close the sockets so the peer fails fast instead of waiting on a recv
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
