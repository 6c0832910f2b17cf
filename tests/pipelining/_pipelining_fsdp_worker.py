"""One gloo rank: B and W on an FSDP2 module whose parameters are swapped between them.

Run by test_pipelining_fsdp.py. argv: init_method outfile. Writes a dict of findings.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    init_method, outfile = sys.argv[1:3]
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    model.load_state_dict(reference.state_dict())
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=True)
    _flags_as_stage(model)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
    found: dict[str, Any] = {}

    out = model(x)
    found["B sees"] = type(next(model.parameters())).__name__  # resharded after the forward
    g = torch.ones(3, 4, dtype=torch.float64)
    _, handoff = stage_backward_input([out], [g], [x], model.parameters())
    model.unshard()  # W is handed the unsharded parameters this time
    found["W sees"] = type(next(model.parameters())).__name__
    stage_backward_weight(model.parameters(), handoff)
    state = fully_shard.state(model)  # type: ignore[attr-defined]
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    fsdp_params = [p for group in groups for p in group.fsdp_params]
    got = [p._unsharded_param.grad for p in fsdp_params]
    found["max error"] = max((a - b).abs().max().item() for a, b in zip(got, want))

    stray = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    try:
        stage_backward_input([model(x) @ stray], [g], [x], model.parameters())
        found["stray"] = "accepted"
    except SplitBackwardError as exc:
        found["stray"] = str(exc)
    found["resharded before W"] = _resharded_before_w(fully_shard, init_device_mesh)
    for step in (False, True):
        found[f"recompute in W, step={step}"] = _recompute_in_w(fully_shard, init_device_mesh, step)
    torch.save(found, outfile)
    dist.destroy_process_group()


def _flags_as_stage(model: Any) -> None:
    """FSDP2's flags as torch's PipelineStage sets them around B and W: no gradient sync (the
    stage reduces after the step), no reshard after backward."""
    if hasattr(model, "set_manual_backward_finalization"):  # 2.15: stage.py finalizes by hand
        model.set_manual_backward_finalization(True)
    else:
        model.set_is_last_backward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)


class _Squared(nn.Module):
    """``x @ (w * w)``: its weight-only node reads the parameter's value in W."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.w * self.w)


def _resharded_before_w(fully_shard: Any, init_device_mesh: Any) -> str:
    """B, then a forward of the stage (which reshards, freeing the unsharded parameters the graph
    holds), then W, with stage.py's flags: W's answer (it read freed memory before: a crash)."""
    from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight

    model = nn.Sequential(_Squared(), nn.Tanh(), _Squared())
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=True)
    _flags_as_stage(model)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.ones(3, 4, dtype=torch.float64)
    out = model(x)
    _, handoff = stage_backward_input([out], [g], [x], model.parameters())
    model(x)  # the next microbatch's forward, before this one's W
    try:
        stage_backward_weight(model.parameters(), handoff)
    except SplitBackwardError as exc:
        return str(exc)
    return "accepted"


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._region, x, use_reentrant=False)


def _recompute_in_w(fully_shard: Any, init_device_mesh: Any, step: bool) -> Any:
    """RECOMPUTE_IN_W on a checkpointed FSDP2 stage, re-gathered between B and W: W's max error,
    or (``step``: an optimizer step on the sharded parameters before the re-gather) its refusal."""
    from gradsafe.pipelining import (
        CheckpointedWeights,
        SplitBackwardError,
        checkpointed_weights,
        stage_backward_input,
        stage_backward_weight,
    )

    torch.manual_seed(1)
    reference = nn.Sequential(_Checkpointed(), _Checkpointed()).double()
    model = nn.Sequential(_Checkpointed(), _Checkpointed()).double()
    model.load_state_dict(reference.state_dict())
    mesh = init_device_mesh("cpu", (1,))
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    # As torch's PipelineStage sets them: FSDP2 reduces after the last W, not in B.
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
    out = model(x)
    g = torch.ones(3, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with checkpointed_weights(CheckpointedWeights.RECOMPUTE_IN_W):
            _, handoff = stage_backward_input([out], [g], [x], model.parameters())
    if step:
        with torch.no_grad():
            for p in model.parameters():  # the sharded parameters, as an optimizer steps them
                p.mul_(0.5)
    for block in model:  # resharded, then re-gathered: the unsharded parameters keep their version
        block.reshard()
        block.unshard()
    try:
        stage_backward_weight(model.parameters(), handoff)
    except SplitBackwardError as exc:
        return str(exc)
    got = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in model.parameters()]
    return max((a - b).abs().max().item() for a, b in zip(got, want))


if __name__ == "__main__":
    main()
