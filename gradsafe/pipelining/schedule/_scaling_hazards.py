"""H7's reproduction, written once: a weight two stages of one rank share, scaled at the end of a step.

The first stage embeds token ids with a table the last stage also uses as its
output head (tied embeddings; in a V-shaped schedule rank 0 holds both
stages). :func:`tied_stages_step` runs a real multi-stage schedule's step on
one gloo rank where the installed torch can (two stages there);
:func:`tied_stages_scaled` runs the same microbatches' backwards in this
process and then the step's end, every stage's ``perform_reduce_grad`` as the
schedules call it, which works on every supported torch (the doctor's row). Both are compared
with a fused backward of the averaged loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from gradsafe.checks import Outcome
from gradsafe.pipelining.schedule._one_rank import one_rank_world

__all__ = ["TiedStages", "tied_stages_reference", "tied_stages_scaled", "tied_stages_step"]

_VOCAB, _DIM, _TOKENS, _MICROBATCHES = 11, 6, 5, 4


class _Embed(nn.Module):
    def __init__(self, table: nn.Parameter) -> None:
        super().__init__()
        self.table = table
        self.mix = nn.Linear(_DIM, _DIM, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.table[ids]))


class _Head(nn.Module):
    def __init__(self, table: nn.Parameter) -> None:
        super().__init__()
        self.table = table

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.table.t()


@dataclasses.dataclass(frozen=True)
class TiedStages:
    """The two stage modules; ``table`` is the parameter both hold."""

    first: _Embed
    last: _Head

    @property
    def table(self) -> nn.Parameter:
        return self.first.table

    def grads(self) -> dict[str, torch.Tensor]:
        named = {**dict(self.first.named_parameters()), "head.table": self.last.table}
        # Every parameter here gets a gradient; a dropped one reads as zeros and fails the comparison.
        return {
            k: torch.zeros_like(p) if p.grad is None else p.grad.clone() for k, p in named.items()
        }


def _stages() -> TiedStages:
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(_VOCAB, _DIM, dtype=torch.float64))
    return TiedStages(_Embed(table), _Head(table))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, _VOCAB, (_MICROBATCHES, _TOKENS), generator=gen)
    return ids, torch.randint(0, _VOCAB, (_MICROBATCHES, _TOKENS), generator=gen)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), target.reshape(-1))


def tied_stages_reference() -> dict[str, torch.Tensor]:
    """One fused backward of the loss averaged over the microbatches."""
    model = _stages()
    ids, target = _data()
    losses = [_loss(model.last(model.first(i)), t) for i, t in zip(ids, target)]
    (torch.stack(losses).sum() / _MICROBATCHES).backward()
    return model.grads()


def tied_stages_scaled() -> dict[str, torch.Tensor]:
    """Each microbatch's backward in this process, then the step's end as a multi-stage schedule runs it.

    The schedule (``ScheduleInterleaved1F1B`` over both stages) is built but
    not stepped, so this runs on every supported torch: the backwards run
    here, then each stage's ``perform_reduce_grad``, the last stage's first
    (its last backward comes first), as a multi-stage step ends. Needs a process group
    (:func:`~gradsafe.pipelining.schedule._one_rank.one_rank_world`).
    """
    from torch.distributed.pipelining import PipelineStage, schedules

    model = _stages()
    cpu = torch.device("cpu")
    stages: list[Any] = [
        PipelineStage(model.first, 0, 2, cpu),
        PipelineStage(model.last, 1, 2, cpu),
    ]
    schedules.ScheduleInterleaved1F1B(stages, n_microbatches=_MICROBATCHES, loss_fn=_loss)
    ids, target = _data()
    for i, t in zip(ids, target):
        _loss(model.last(model.first(i)), t).backward()
    for stage in reversed(stages):
        stage.perform_reduce_grad(_MICROBATCHES)
    return model.grads()


def tied_stages_step(schedule: str) -> dict[str, torch.Tensor]:
    """One real ``schedule.step`` with both stages on this rank (torch 2.13+; needs a process group)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    model = _stages()
    cpu = torch.device("cpu")
    stages = [PipelineStage(model.first, 0, 2, cpu), PipelineStage(model.last, 1, 2, cpu)]
    runner = getattr(schedules, schedule)(stages, n_microbatches=_MICROBATCHES, loss_fn=_loss)
    ids, target = _data()
    runner.step(ids.reshape(-1, _TOKENS), target=target.reshape(-1, _TOKENS))
    return model.grads()


def shared_weight_scaled_once() -> Outcome:
    """H7: the step's end divides the tied weight once, as a fused backward of the averaged loss."""
    reference = tied_stages_reference()
    try:
        with one_rank_world():
            got = tied_stages_scaled()
    except RuntimeError as exc:
        if "process group exists" in str(exc):
            return Outcome(None, f"not measured: {exc}")
        raise
    want, have = reference["table"], got["table"]
    ratio = float(have.norm() / want.norm())
    others = max(float((got[k] - v).abs().max()) for k, v in reference.items() if k != "table")
    if abs(ratio - 1) > 1e-12 or others > 1e-12:
        return Outcome(
            False,
            f"tied weight's gradient is {ratio:.3g}x the fused one ({_MICROBATCHES} microbatches, "
            "2 stages on one rank)",
        )
    return Outcome(True, "tied weight's gradient equals the fused one (2 stages on one rank)")
