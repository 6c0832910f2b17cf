"""How a split divides a stage's backward: matmul FLOPs in B and in W, recomputation, memory between.

The measurement behind docs/pipelining.md's balance table, written once for
its tests (tests/pipelining/test_pipelining_balance.py, which load it by path)
and its benchmark (benchmarks/pipelining_balance.py, beside it); no part of the
package. FLOPs are counted with
``torch.utils.flop_counter``'s formulas (matmuls: ``mm``, ``addmm``, ``bmm``
...) by :class:`~gradsafe._shared.flops.MatmulFlops` (``FlopCounterMode``'s
module hooks break a split's B); FLOPs counted while a module's forward runs
during a backward are recomputation. Bytes are
:class:`~gradsafe._shared.live_storage.LiveStorage`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from gradsafe._shared.flops import MatmulFlops
from gradsafe._shared.live_storage import LiveStorage
from gradsafe.pipelining._policy import CheckpointedWeights, checkpointed_weights
from gradsafe.pipelining._torch import split_backward_module

__all__ = ["Balance", "Checkpointing", "Mlp", "Split", "measure", "save_matmuls"]

Checkpointing = Literal["none", "full", "selective"]
#: gradsafe's split under a policy, torch's own split, or a fused backward.
Split = CheckpointedWeights | Literal["torch", "fused"]


class _Block(nn.Module):
    """LayerNorm, Linear d->4d, GELU, Linear 4d->d, with a residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective-checkpoint policy saving the matmuls' outputs, recomputing the rest
    (as torchtitan's "op" SAC does for its matmuls)."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Mlp(nn.Module):
    """A stage of MLP blocks, each checkpointed (``use_reentrant=False``) as ``checkpointing`` says."""

    def __init__(self, d: int, blocks: int, checkpointing: Checkpointing) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing == "none":
                x = block(x)
            elif self.checkpointing == "full":
                x = checkpoint(block, x, use_reentrant=False)
            else:
                context = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
                x = checkpoint(block, x, use_reentrant=False, context_fn=context)
        return x


@dataclasses.dataclass(frozen=True)
class Balance:
    """One microbatch's backward, split (or fused), measured."""

    #: Matmul FLOPs of the forward.
    forward: int
    #: Matmul FLOPs run in B (a fused backward's all), recomputation included.
    b: int
    #: Matmul FLOPs run in W (0 for a fused backward).
    w: int
    #: Matmul FLOPs of checkpointed regions recomputed in B.
    b_recomputed: int
    #: Matmul FLOPs of checkpointed regions recomputed in W.
    w_recomputed: int
    #: Bytes of tensors alive between B and W (parameters, input and output
    #: gradient not counted; the input gradient and the output dropped, as a
    #: schedule sends and drops them); for a fused backward, 0.
    held: int

    @property
    def w_share(self) -> float:
        """W's fraction of the backward's own matmul FLOPs (recomputation not counted)."""
        w = self.w - self.w_recomputed
        grads = self.b - self.b_recomputed + w
        return w / grads if grads else 0.0

    @property
    def recomputes(self) -> float:
        """The forward's matmul FLOPs run again during the backward, in forwards.

        Below 1 for a full checkpoint: its recomputation stops early, before
        the region's last op (whose inputs, saved before it runs, are all it needs)."""
        recomputed = self.b_recomputed + self.w_recomputed
        return recomputed / self.forward if self.forward else 0.0


def _counted(run: Callable[[], Any]) -> tuple[Any, MatmulFlops]:
    with MatmulFlops(forwards=True) as flops:
        result = run()
    return result, flops


def measure(
    split: Split, checkpointing: Checkpointing, tokens: int, d: int = 128, blocks: int = 2
) -> Balance:
    """One microbatch of :class:`Mlp` (float64, seeded) through ``split``."""
    torch.manual_seed(0)
    stage = Mlp(d, blocks, checkpointing).double()
    x = torch.randn(tokens, d, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(tokens, d, dtype=torch.float64)
    with LiveStorage([*stage.parameters(), x, grad]) as live:
        y, forward = _counted(lambda: stage(x))
        if split == "fused":
            _, b = _counted(functools.partial(y.backward, grad))
            return Balance(forward.total, b.total, 0, b.in_forward, 0, 0)
        b_step, w_step = _steps(split)
        (dx, handoff), b = _counted(functools.partial(b_step, y, grad, x, stage))
        del dx, y  # sent upstream; the schedule drops the output
        held = live.live()
        _, w = _counted(functools.partial(w_step, stage, handoff))
    return Balance(forward.total, b.total, w.total, b.in_forward, w.in_forward, held)


def _steps(split: Split) -> tuple[Callable[..., Any], Callable[..., Any]]:
    if split == "torch":
        torch_split = split_backward_module()  # torch's own while gradsafe is not patched in

        def torch_b(y: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, stage: Mlp) -> Any:
            (dx,), groups = torch_split.stage_backward_input([y], [grad], [x], stage.parameters())
            return dx, groups

        def torch_w(stage: Mlp, groups: Any) -> Any:
            return torch_split.stage_backward_weight(stage.parameters(), groups)

        return torch_b, torch_w
    from gradsafe.pipelining._backward import stage_backward_input, stage_backward_weight

    def b(y: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, stage: Mlp) -> Any:
        with checkpointed_weights(split):  # type: ignore[arg-type]
            (dx,), handoff = stage_backward_input(y, grad, [x], stage.parameters())
        return dx, handoff

    def w(stage: Mlp, handoff: Any) -> Any:
        return stage_backward_weight(stage.parameters(), handoff)

    return b, w
