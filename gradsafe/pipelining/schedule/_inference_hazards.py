"""H6's reproduction, written once: a schedule's start-up leaves no trace of its metadata inference.

It runs a real schedule (2 stages on one gloo rank) whose loss runs a
backward inside itself, against gradient accumulation in one process. The
doctor's row (in ``pipelining/_hazards.py``'s ``CHECKS``), the tests and the
benchmarks use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from gradsafe.checks import Outcome
from gradsafe.pipelining.schedule._one_rank import one_rank_world

__all__ = [
    "INFERENCE_FIGURE_VARIES",
    "ChunkedHeadLoss",
    "PipelineRun",
    "accumulation_reference",
    "inference_leaves_no_trace",
    "norm_and_dropout",
    "one_rank_world",
    "pipeline_step",
    "worst_relative_error",
]


class ChunkedHeadLoss:
    """A loss that runs a backward inside itself, like torchtitan's chunked loss.

    The last stage returns hidden states; this loss applies the stage's
    ``head`` per sequence chunk and backwards each chunk's loss at once (the
    head's gradient accumulates there), then returns a loss whose backward
    feeds the collected hidden-state gradient into the stage. ``calls``
    counts its calls.
    """

    def __init__(self, head: nn.Module, chunks: int = 2) -> None:
        self.head = head
        self.chunks = chunks
        self.calls = 0

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        training = hidden.requires_grad
        total = hidden.new_zeros(())
        grads: list[torch.Tensor] = []
        for piece, goal in zip(hidden.detach().chunk(self.chunks, 1), target.chunk(self.chunks, 1)):
            piece.requires_grad_(training)
            loss = (self.head(piece) - goal).square().mean()
            total = total + loss.detach()
            if training:
                loss.backward()
                grads.append(piece.grad if piece.grad is not None else torch.zeros_like(piece))
        if not training:
            return total
        return _RouteGradient.apply(hidden, torch.cat(grads, 1), total)  # type: ignore[no-any-return]


class _RouteGradient(torch.autograd.Function):
    """Returns ``loss``; its backward gives ``hidden`` the gradient already computed."""

    @staticmethod
    def forward(ctx, hidden, grad, loss):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def, override]
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


class _Block(nn.Module):
    def __init__(self, dim: int, inner: nn.Module | None) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.inner = inner if inner is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(self.lin(x)))


class _LastBlock(_Block):
    """A block with a head its forward skips: the loss applies it (torchtitan's ``_skip_lm_head``)."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__(dim, None)
        self.head = nn.Linear(dim, vocab, bias=False)


_DIM, _VOCAB, _SEQ, _MICROBATCHES, _PER_MICROBATCH = 8, 6, 4, 4, 2


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """One step's results: every parameter's gradient, and what ran."""

    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    loss_calls: int
    hook_firings: int


def _build(inner: Callable[[], nn.Module] | None) -> tuple[nn.Module, _LastBlock]:
    torch.manual_seed(0)
    first = _Block(_DIM, None if inner is None else inner()).double()
    return first, _LastBlock(_DIM, _VOCAB).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    batch = _MICROBATCHES * _PER_MICROBATCH
    x = torch.randn(batch, _SEQ, _DIM, dtype=torch.float64, generator=gen)
    return x, torch.randn(batch, _SEQ, _VOCAB, dtype=torch.float64, generator=gen)


def _count_firings(modules: Sequence[nn.Module]) -> list[int]:
    fired = [0]

    def count(_: torch.Tensor) -> None:
        fired[0] += 1

    for module in modules:
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(count)
    return fired


def _result(modules: Sequence[nn.Module], loss: ChunkedHeadLoss, fired: list[int]) -> PipelineRun:
    grads = {
        f"stage{i}.{name}": None if p.grad is None else p.grad.clone()
        for i, m in enumerate(modules)
        for name, p in m.named_parameters()
    }
    buffers = {
        f"stage{i}.{name}": b.clone()
        for i, m in enumerate(modules)
        for name, b in m.named_buffers()
    }
    return PipelineRun(grads, buffers, loss.calls, fired[0])


def accumulation_reference(inner: Callable[[], nn.Module] | None = None) -> PipelineRun:
    """The step in one process: each microbatch through both stages and its loss, gradients averaged."""
    modules = _build(inner)
    loss = ChunkedHeadLoss(modules[1].head)
    fired = _count_firings(modules)
    x, target = _data()
    for xs, goal in zip(x.chunk(_MICROBATCHES), target.chunk(_MICROBATCHES)):
        loss(modules[1](modules[0](xs)), goal).backward()
    with torch.no_grad():
        for module in modules:
            for param in module.parameters():
                if param.grad is not None:
                    param.grad /= _MICROBATCHES
    return _result(modules, loss, fired)


def pipeline_step(
    schedule: str, inner: Callable[[], nn.Module] | None = None, stages: int = 2
) -> PipelineRun:
    """One ``schedule.step`` on this rank (needs :func:`one_rank_world`).

    Two stages (a multi-stage schedule), or with ``stages=1`` both blocks in
    one stage (a single-stage schedule such as ``Schedule1F1B``).
    """
    from torch.distributed.pipelining import PipelineStage, schedules

    modules = _build(inner)
    loss = ChunkedHeadLoss(modules[1].head)
    fired = _count_firings(modules)
    device = torch.device("cpu")
    stage: object
    if stages == 1:
        stage = PipelineStage(nn.Sequential(*modules), 0, 1, device)
    else:
        stage = [PipelineStage(m, i, 2, device) for i, m in enumerate(modules)]
    runner = getattr(schedules, schedule)(stage, n_microbatches=_MICROBATCHES, loss_fn=loss)
    x, target = _data()
    runner.step(x, target=target)
    return _result(modules, loss, fired)


def worst_relative_error(run: PipelineRun, reference: PipelineRun) -> tuple[str, float]:
    """The parameter whose gradient is furthest from the reference's, and how far (relative, max norm)."""
    worst = ("", 0.0)
    for name, expected in reference.grads.items():
        got = run.grads[name]
        if expected is None or got is None:
            error = 0.0 if expected is got else float("inf")
        else:
            scale = expected.abs().max().item() or 1.0
            error = (got - expected).abs().max().item() / scale
            error = float("inf") if math.isnan(error) else error
        if error > worst[1] or not worst[0]:
            worst = (name, error)
    return worst


def norm_and_dropout() -> nn.Module:
    """The first stage's extra layers in the doctor's H6 row: running statistics and RNG draws."""
    return nn.Sequential(nn.BatchNorm1d(_SEQ), nn.Dropout(0.5)).double()


INFERENCE_FIGURE_VARIES = (
    "upstream's figure changes from run to run: torch's metadata inference runs every stage after "
    "the first on empty tensors (allocated, never initialised), so the gradient it leaves behind "
    "depends on whatever that memory held; any value other than 0 is the hazard"
)


def inference_leaves_no_trace(schedule: str = "ScheduleInterleaved1F1B") -> Outcome:
    """H6: one step against accumulation: gradients, BatchNorm statistics, hook firings.

    The loss runs a backward inside itself (torch >= 2.13 runs it in the
    inference), the first stage has a BatchNorm (whose statistics the
    inference forward updates) and a dropout (whose masks shift if the
    inference draws from the RNG).
    """
    reference = accumulation_reference(norm_and_dropout)
    note = ""
    try:
        with one_rank_world():
            run = pipeline_step(schedule, norm_and_dropout)
    except RuntimeError as exc:
        if "process group exists" in str(exc):
            return Outcome(None, f"not measured: {exc}")
        if _SELF_SEND not in str(exc):
            raise
        # torch 2.11 sends between two stages of one rank over gloo, which
        # gloo refuses; one stage holding both blocks runs the same inference.
        note = " (one stage: this torch cannot run two on one gloo rank)"
        with one_rank_world():
            run = pipeline_step("Schedule1F1B", norm_and_dropout, stages=1)
    name, error = worst_relative_error(run, reference)
    moved = [k for k, v in reference.buffers.items() if not torch.equal(run.buffers[k], v)]
    if error > 1e-12 or moved or run.hook_firings != reference.hook_firings:
        statistics = ", BatchNorm statistics moved" if moved else ""
        return Outcome(
            False,
            f"{name} grad {error:.2g} relative off{statistics}, {run.hook_firings} hook "
            f"firings (accumulation: {reference.hook_firings}){note}",
        )
    return Outcome(
        True, f"grads, statistics and {run.hook_firings} hook firings equal accumulation{note}"
    )


_SELF_SEND = "Pair is not connected"
