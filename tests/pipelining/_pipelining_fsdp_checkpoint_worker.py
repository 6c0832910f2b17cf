"""One gloo rank: FSDP2 stages of checkpointed blocks under a real zero-bubble schedule, every policy.

Run by test_pipelining_fsdp.py. argv: init_method outfile. Two stages on this rank
(``ScheduleZBVZeroBubble`` and ``ScheduleInterleavedZeroBubble``), each a
``fully_shard``-ed module of ``fully_shard``-ed blocks (LayerNorm, Linear,
tanh) run under ``torch.utils.checkpoint``, with ``reshard_after_forward``
on and off; then a hand-written B/W loop with FSDP2's defaults (gradient
sync on). Writes, per case, the largest difference from the fused schedule's
gradients, or the refusal's message.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

D = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def _sharded(reshard: bool) -> list[nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    stages = [Stage().double() for _ in range(2)]
    mesh = init_device_mesh("cpu", (1,))
    for stage in stages:
        for block in stage.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(stage, mesh=mesh, reshard_after_forward=reshard)
    return stages


def _grads(stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": p.grad.full_tensor()  # type: ignore[union-attr]
        for i, stage in enumerate(stages)
        for name, p in stage.named_parameters()
        if p.grad is not None
    }


def _step(schedule: str, reshard: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = _sharded(reshard)
    pipeline = [PipelineStage(s, i, 2, torch.device("cpu")) for i, s in enumerate(stages)]
    runner = getattr(schedules, schedule)(
        pipeline, n_microbatches=4, loss_fn=lambda y, t: (y - t).square().mean()
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, D, dtype=torch.float64, generator=gen)
    target = torch.randn(8, 3, D, dtype=torch.float64, generator=gen)
    runner.step(x, target=target)
    return _grads(stages)


def _hand_written(policy: Any) -> str:
    """B then W on one FSDP2 stage left at its defaults (gradient sync on): refused or exact."""
    from gradsafe.pipelining import (
        SplitBackwardError,
        checkpointed_weights,
        stage_backward_input,
        stage_backward_weight,
    )

    stage = _sharded(True)[0]
    x = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, D, dtype=torch.float64)
    try:
        with checkpointed_weights(policy):
            _, handoff = stage_backward_input([stage(x)], [g], [x], stage.parameters())
            stage_backward_weight(stage.parameters(), handoff)
    except SplitBackwardError as exc:
        return f"refused: {exc}"
    return "accepted"


def main() -> None:
    init_method, outfile = sys.argv[1:3]
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    import gradsafe
    from gradsafe.pipelining import CheckpointedWeights, SplitBackwardError, checkpointed_weights

    found: dict[str, Any] = {}
    warnings.simplefilter("ignore", UserWarning)  # RECOMPUTE_IN_W's warning, chosen here
    try:
        for reshard in (True, False):
            fused = _step("ScheduleInterleaved1F1B", reshard)
            for schedule in ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"):
                for policy in CheckpointedWeights:
                    case = f"{schedule}, reshard_after_forward={reshard}, {policy.name}"
                    try:
                        with gradsafe.patch("pipelining"), checkpointed_weights(policy):
                            split = _step(schedule, reshard)
                    except SplitBackwardError as exc:
                        found[case] = f"refused: {exc}"
                        continue
                    if split.keys() != fused.keys():
                        found[case] = f"gradients of {sorted(fused.keys() - split.keys())} missing"
                        continue
                    found[case] = max((split[k] - fused[k]).abs().max().item() for k in fused)
        for policy in CheckpointedWeights:
            found[f"hand-written B/W, sync on, {policy.name}"] = _hand_written(policy)
    except Exception as exc:  # reported, not hung on
        found["crash"] = f"{type(exc).__name__}: {exc}"
    torch.save(found, outfile)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
