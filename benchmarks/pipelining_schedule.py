"""What the B/W split buys a pipeline schedule: torch's real action orders, simulated with measured costs.

Run: PYTHONPATH=. python benchmarks/pipelining_schedule.py [--d 128] [--tokens 32 128 512]
     [--blocks 2] [--checkpoint none full sac] [--ranks 2 4] [--microbatches 8] [--latency 0] [--reps 15]

1. Costs. One pipeline stage (``--blocks`` pre-norm MLP blocks: LayerNorm, Linear d->4d, GELU,
   Linear 4d->d, residual; every block under ``torch.utils.checkpoint`` with ``--checkpoint
   full``, or selective AC saving the matmul outputs, torchtitan's "op" policy, with ``sac``)
   is measured per split policy: its forward F, the split's B (torch's I: input gradients)
   and W (weight gradients), and a fused backward. Once in matmul FLOPs (FlopCounterMode's
   formulas, ``torch.utils.flop_counter.flop_registry``, counted by
   ``gradsafe.testing.MatmulFlops``: FlopCounterMode's module hooks abort a checkpointed
   block's recomputation), once in thread CPU time (min and median
   over ``--reps`` repetitions, the policies interleaved in a rotating order, one intra-op
   thread, fp32). The policies (``split_policies``):

   * ``gradsafe``: ``gradsafe.pipelining.stage_backward_input`` / ``stage_backward_weight``
     as installed; if B takes a policy keyword, one column per policy it accepts;
   * ``torch``: ``torch.distributed.pipelining._backward``'s split (its crash is reported);
   * ``fused``: the whole backward in B, W empty;
   * ``ideal``: the fused backward split so that W does exactly the weight-gradient GEMMs
     (2 * tokens * in * out per Linear) and B the rest. It is a model, not code: its CPU
     time is the fused time split in the same proportion as its FLOPs.

2. Makespans. torch builds the per-rank action order of ScheduleInterleavedZeroBubble,
   ScheduleZBVZeroBubble, ScheduleDualPipeV and 1F1B (``SCHEDULES`` says why 1F1B's is
   ScheduleInterleaved1F1B's with one stage per rank) (``torch_order``:
   the schedule objects are made on stand-in stages, as torch's own test_schedule.py does, so
   no process group is needed), and ``simulate`` runs it: each rank runs its actions in order;
   an action starts when its rank is free and its dependency has finished, plus ``--latency``
   (in units of one stage's F) when that dependency ran on another rank: F of stage s waits for F of stage s-1 (same
   microbatch), B/I of stage s for B/I of stage s+1 (the last stage's for its own F), W for
   its own I. DualPipeV's overlapped F+B pairs run one after the other (CPU compute does not
   overlap). The model has ``2 * ranks`` stages' worth of blocks whatever the schedule: the
   two-stages-per-rank schedules run one measured stage per stage, 1F1B two per stage.
   Each makespan is printed relative to the ideal zero-bubble step (every rank busy all the
   time with F and a fused backward: microbatches * 2 * (F + fused)); 1F1B (fused B, so the
   same for every policy) is its own row.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import _backward as torch_split
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import gradsafe.pipelining as gradsafe_split
from gradsafe.testing import MatmulFlops

# torch's names for compute actions: I is gradsafe's B (input gradients), B a full backward.
Kind = Literal["F", "I", "W", "B"]
KINDS: tuple[Kind, ...] = ("F", "I", "W", "B")


# ---------------------------------------------------------------- action orders


@dataclass(frozen=True)
class Op:
    """One compute action of a schedule: ``kind`` of ``stage`` on ``microbatch``."""

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


Order = dict[int, list[Op]]  # rank -> its compute actions, in the order it runs them

# name -> (schedule class name in torch.distributed.pipelining.schedules, stages per rank)
# Schedule1F1B runs its own loop; its pipeline_order only describes it, and on torch 2.13 and
# 2.15 wrongly (the last rank starts at F1 and runs an F of a microbatch that does not
# exist: simulate refuses it). ScheduleInterleaved1F1B with one stage per rank is torch's 1F1B
# that runs from its pipeline_order.
SCHEDULES: dict[str, tuple[str, int]] = {
    "1F1B": ("ScheduleInterleaved1F1B", 1),
    "InterleavedZB": ("ScheduleInterleavedZeroBubble", 2),
    "ZBV": ("ScheduleZBVZeroBubble", 2),
    "DualPipeV": ("ScheduleDualPipeV", 2),
}


class _StandInStage(_PipelineStageBase):
    """What a schedule's constructor reads from a stage, without a module or a process group."""

    def __init__(self, stage_index: int, num_stages: int, ranks: int) -> None:
        # No super().__init__: it needs a process group. torch's own test_schedule.py does the same.
        self.submod = None  # type: ignore[assignment]
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank, self.group = ranks, 0, None
        self.p2p_per_edge = False  # read by newer torch's schedules

    def _create_grad_recv_info(self, act_send_info: dict[Any, Any]) -> tuple[Any, ...]:
        return ()

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:
        pass

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> None:
        pass


def torch_order(class_name: str, ranks: int, microbatches: int, per_rank: int) -> Order:
    """The compute actions torch's schedule ``class_name`` orders on each rank.

    Builds the schedule on ``per_rank`` stand-in stages per rank and reads its
    ``pipeline_order``: bubbles (None) and non-compute actions (send/recv, reduce-grad,
    unshard) dropped, DualPipeV's OVERLAP_F_B pairs flattened into their two actions.
    Raises LookupError if the installed torch lacks the class; the schedule's own
    ValueError if it refuses the shape (e.g. too few microbatches).
    """
    cls = getattr(schedules, class_name, None)
    if cls is None:
        raise LookupError(f"torch {torch.__version__} has no {class_name}")
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    num_stages = ranks * per_rank
    loss = lambda out, target: out.sum()  # noqa: E731  # a loss makes the schedule plan backwards
    # Stand-ins for rank 0's stages: a schedule computes every rank's order from the counts alone.
    stages = [_StandInStage(i, num_stages, ranks) for i in (0, num_stages - 1)[:per_rank]]
    built = cls(stages[0] if single else stages, microbatches, loss_fn=loss)
    order: Order = {}
    for rank, actions in sorted(built.pipeline_order.items()):
        order[rank] = []
        for action in filter(None, actions):
            for leaf in action.sub_actions or (action,):
                kind = leaf.computation_type.value
                if kind in KINDS:
                    order[rank].append(Op(kind, leaf.stage_index, leaf.microbatch_index))
    return order


# ---------------------------------------------------------------- simulation


class ScheduleError(ValueError):
    """An action order that cannot run: a duplicate, a missing dependency, or a cycle."""


def _dependencies(op: Op, backward_kind: Mapping[tuple[int, int], Kind], last: int) -> list[Op]:
    s, m = op.stage, op.microbatch
    if op.kind == "F":
        return [Op("F", s - 1, m)] if s > 0 else []
    if op.kind == "W":
        return [Op("I", s, m)]
    # I or B: the next stage's input gradient; the last stage's loss comes from its own F.
    if s == last:
        return [Op("F", s, m)]
    return [Op(backward_kind.get((s + 1, m), "I"), s + 1, m), Op("F", s, m)]


def simulate(order: Order, costs: Mapping[Kind, float], latency: float = 0.0) -> float:
    """The step's makespan: every rank runs its actions in order, each once its dependencies are done.

    ``costs`` gives each kind's duration (one per stage: the stages are alike); ``latency``
    is added to a dependency that ran on another rank. Raises ScheduleError when an action
    appears twice, waits for one no rank runs, or the order deadlocks (a dependency cycle).
    """
    rank_of: dict[Op, int] = {}
    for rank, ops in order.items():
        for op in ops:
            if op in rank_of:
                raise ScheduleError(f"{op} appears twice (ranks {rank_of[op]} and {rank})")
            rank_of[op] = rank
    if not rank_of:
        return 0.0
    backward_kind: dict[tuple[int, int], Kind] = {
        (op.stage, op.microbatch): op.kind for op in rank_of if op.kind in ("I", "B")
    }
    last = max(op.stage for op in rank_of)
    for op in rank_of:
        missing = [d for d in _dependencies(op, backward_kind, last) if d not in rank_of]
        if missing:
            raise ScheduleError(f"{op} waits for {missing[0]}, which no rank runs")
        if op.kind == "I" and Op("W", op.stage, op.microbatch) not in rank_of:
            raise ScheduleError(f"{op} has no W: its weight gradients are never computed")
        if op.kind == "F" and (op.stage, op.microbatch) not in backward_kind:
            raise ScheduleError(f"{op} has no backward (B or I)")

    finish: dict[Op, float] = {}
    clock = dict.fromkeys(order, 0.0)
    done = dict.fromkeys(order, 0)
    progressed = True
    while progressed:  # each sweep runs every action whose dependencies have finished
        progressed = False
        for rank, ops in order.items():
            while done[rank] < len(ops):
                op = ops[done[rank]]
                deps = _dependencies(op, backward_kind, last)
                if any(d not in finish for d in deps):
                    break
                ready = [finish[d] + (latency if rank_of[d] != rank else 0.0) for d in deps]
                finish[op] = clock[rank] = max([clock[rank], *ready]) + costs[op.kind]
                done[rank] += 1
                progressed = True
    stuck = {rank: ops[done[rank]] for rank, ops in order.items() if done[rank] < len(ops)}
    if stuck:
        waits = ", ".join(f"rank {r} at {op}" for r, op in stuck.items())
        raise ScheduleError(f"the order deadlocks (a dependency cycle): {waits}")
    return max(clock.values(), default=0.0)


# ---------------------------------------------------------------- the stage and its costs


class MLPBlock(nn.Module):
    """Pre-norm MLP block: x + Linear(4d->d)(GELU(Linear(d->4d)(LayerNorm(x))))."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Stage(nn.Module):
    """``blocks`` MLP blocks, each checkpointed as ``mode`` says (none, full, sac)."""

    def __init__(self, d: int, blocks: int, mode: str) -> None:
        super().__init__()
        self.d, self.mode = d, mode
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode == "none":
                x = block(x)
            elif self.mode == "full":
                x = checkpoint(block, x, use_reentrant=False)
            else:
                context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
                x = checkpoint(block, x, use_reentrant=False, context_fn=context)
        return x


@dataclass(frozen=True)
class Split:
    """A split backward: ``b(outputs, grads, inputs, params) -> (dinputs, handoff)``, then ``w(params, handoff)``."""

    b: Callable[..., Any]
    w: Callable[..., Any]


def _fused_b(outputs: list[torch.Tensor], grads: list[torch.Tensor], *_: Any) -> tuple[None, None]:
    torch.autograd.backward(outputs, grads)
    return None, None


FUSED = Split(_fused_b, lambda params, handoff: None)


def _under(policy: Any, b: Callable[..., Any]) -> Callable[..., Any]:
    """``b`` run under gradsafe's checkpointed-weights ``policy``."""

    def run(*args: Any) -> Any:
        with gradsafe_split.checkpointed_weights(policy):
            return b(*args)

    return run


def split_policies() -> dict[str, Split]:
    """The splits measured, by name; to compare another, add an entry.

    gradsafe's: one entry per ``gradsafe.pipelining.CheckpointedWeights`` policy
    (where a checkpointed stage's weight GEMMs run), found by feature; without
    it, gradsafe's split as installed. (The "ideal" split is derived, not run.)
    """
    gs_b, gs_w = gradsafe_split.stage_backward_input, gradsafe_split.stage_backward_weight
    policies: dict[str, Split] = {}
    for policy in getattr(gradsafe_split, "CheckpointedWeights", ()):
        policies[f"gradsafe[{policy.name}]"] = Split(_under(policy, gs_b), gs_w)
    if not policies:
        policies["gradsafe"] = Split(gs_b, gs_w)
    policies["torch"] = Split(torch_split.stage_backward_input, torch_split.stage_backward_weight)
    policies["fused"] = FUSED
    return policies


@dataclass(frozen=True)
class StageCosts:
    """One stage's F, fused backward, and per policy its (B, W) or why it failed; one unit throughout."""

    forward: float
    fused: float
    split: dict[str, tuple[float, float] | str]

    def kinds(self, policy: str, scale: float) -> dict[Kind, float] | str:
        """Durations of F, I (B), W and a full backward B under ``policy``, times ``scale``."""
        bw = self.split[policy]
        if isinstance(bw, str):
            return bw
        return {
            "F": self.forward * scale,
            "I": bw[0] * scale,
            "W": bw[1] * scale,
            "B": self.fused * scale,  # a full-backward action runs the fused backward
        }


@contextlib.contextmanager
def _measured(flops: bool, into: list[float]) -> Iterator[None]:
    """Appends to ``into`` what the block costs: matmul FLOPs, or thread CPU seconds."""
    if flops:
        with MatmulFlops() as counter:
            yield
        into.append(float(counter.total))
    else:
        start = time.thread_time()
        yield
        into.append(time.thread_time() - start)


def _one_pass(stage: Stage, tokens: int, split: Split, flops: bool) -> list[float]:
    """[F, B, W] of one microbatch through ``stage``."""
    params = list(stage.parameters())
    samples: list[float] = []
    x = torch.randn(tokens, stage.d, requires_grad=True)
    with _measured(flops, samples):
        out = stage(x)
    with _measured(flops, samples):
        _, handoff = split.b([out], [torch.ones_like(out)], [x], params)
    with _measured(flops, samples):
        split.w(params, handoff)
    stage.zero_grad(set_to_none=True)
    return samples


def weight_gemm_flops(stage: Stage, tokens: int) -> float:
    """FLOPs of one microbatch's weight-gradient GEMMs: 2 * tokens * in * out per Linear."""
    linears = [m for m in stage.modules() if isinstance(m, nn.Linear)]
    return float(sum(2 * tokens * m.in_features * m.out_features for m in linears))


def measure_stage(
    stage: Stage, tokens: int, flops: bool, reps: int
) -> tuple[StageCosts, StageCosts]:
    """(minimum, median) over ``reps`` of F, the fused backward and every policy's B and W.

    The policies run interleaved, rotating which goes first each repetition (after three
    warm-up repetitions when timing). A policy that raises is reported by its error, once.
    An "ideal" entry is added: the fused backward, split so that W's share is the
    weight-gradient GEMMs' share of its FLOPs.
    """
    policies = split_policies()
    names = list(policies)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    failed: dict[str, str] = {}
    warmup = 0 if flops else 3
    for rep in range(reps + warmup):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if name in failed:
                continue
            try:
                result = _one_pass(stage, tokens, policies[name], flops)
            except Exception as exc:  # torch's split on selective AC: reported in the table
                failed[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:100]}"
                stage.zero_grad(set_to_none=True)
                continue
            if rep >= warmup:
                samples[name].append(result)
    if "fused" in failed:
        raise RuntimeError(f"the stage's fused backward failed: {failed['fused']}")
    ideal_w_share = weight_gemm_flops(stage, tokens) / _one_pass(stage, tokens, FUSED, True)[1]
    picked = []
    for pick in (min, statistics.median):
        split: dict[str, tuple[float, float] | str] = {}
        for name, runs in samples.items():
            split[name] = failed.get(name) or (pick(r[1] for r in runs), pick(r[2] for r in runs))
        fused = pick(r[1] for r in samples["fused"])
        split["ideal"] = (fused * (1 - ideal_w_share), fused * ideal_w_share)
        forward = pick(r[0] for runs in samples.values() for r in runs)
        picked.append(StageCosts(forward, fused, split))
    return picked[0], picked[1]


# ---------------------------------------------------------------- the printout


@dataclass(frozen=True)
class Case:
    """One stage configuration and its measured costs (FLOPs; CPU seconds min and median)."""

    mode: str
    tokens: int
    flops: StageCosts
    cpu_min: StageCosts
    cpu_median: StageCosts


def makespans(
    costs: StageCosts, ranks: int, microbatches: int, latency: float
) -> dict[str, dict[str, float | str]]:
    """Per schedule, per policy: the simulated step over the ideal zero-bubble step.

    ``latency`` is in units of one stage's forward, so one value means the same for both costings.
    """
    ideal = microbatches * 2 * (costs.forward + costs.fused)
    latency *= costs.forward
    table: dict[str, dict[str, float | str]] = {}
    for schedule, (class_name, per_rank) in SCHEDULES.items():
        try:
            order = torch_order(class_name, ranks, microbatches, per_rank)
        except (LookupError, ValueError) as exc:
            table[schedule] = {"*": f"not built: {exc}"}
            continue
        row: dict[str, float | str] = {}
        splits = any(op.kind in ("I", "W") for ops in order.values() for op in ops)
        # an order of full backwards runs the fused one whatever the policy
        for policy in costs.split:
            kinds = costs.kinds(policy if splits else "fused", scale=2 / per_rank)
            try:
                row[policy] = (
                    kinds if isinstance(kinds, str) else simulate(order, kinds, latency) / ideal
                )
            except ScheduleError as exc:
                row[policy] = f"torch's order: {exc}"
        table[schedule] = row
    return table


def print_costs(cases: Sequence[Case], policies: Sequence[str]) -> None:
    print("\nCosts of one stage, one microbatch: F, then per policy B (torch's I), W, B+W over the")
    print("fused backward, and W's share of B+W. MFLOP (matmul); CPU ms min (median).")
    head = f"{'ckpt':>5} {'tokens':>6} {'policy':<22} | {'MFLOP F':>8} {'B':>8} {'W':>8} {'B+W/fused':>9} {'W share':>7}"
    print(head + f" | {'CPU ms F':>13} {'B':>13} {'W':>13} {'W share':>7}")
    for case in cases:
        for policy in policies:
            flop, low, mid = (c.split[policy] for c in (case.flops, case.cpu_min, case.cpu_median))
            label = f"{case.mode:>5} {case.tokens:>6} {policy:<22} | "
            if isinstance(flop, str) or isinstance(low, str) or isinstance(mid, str):
                print(label + f"crashed: {next(c for c in (flop, low, mid) if isinstance(c, str))}")
                continue
            flop_cells = (
                f"{case.flops.forward / 1e6:8.2f} {flop[0] / 1e6:8.2f} {flop[1] / 1e6:8.2f}"
                f" {sum(flop) / case.flops.fused:9.2f} {flop[1] / sum(flop):7.3f}"
            )
            ms = lambda a, b: f"{a * 1e3:6.3f} ({b * 1e3:.3f})"  # noqa: E731
            cpu_cells = (
                f"{ms(case.cpu_min.forward, case.cpu_median.forward):>13} {ms(low[0], mid[0]):>13}"
                f" {ms(low[1], mid[1]):>13} {low[1] / sum(low):7.3f}"
            )
            print(label + flop_cells + " | " + cpu_cells)


def print_makespans(
    cases: Sequence[Case], policies: Sequence[str], args: argparse.Namespace
) -> None:
    print(
        f"\nStep makespan / ideal zero-bubble step ({args.microbatches} microbatches, latency"
        f" {args.latency:g}; 1.00 = no bubble), costed by matmul FLOPs | by CPU time (min)"
    )
    widths = [max(8, len(p)) for p in policies]
    names = " ".join(f"{p:>{w}}" for p, w in zip(policies, widths, strict=True))
    print(f"{'ckpt':>5} {'tokens':>6} {'ranks':>5} {'schedule':<13} | {names} | {names}")
    notes: dict[str, int] = {}

    def cells(row: Mapping[str, float | str]) -> str:
        out = []
        for policy, width in zip(policies, widths, strict=True):
            value = row.get(policy, row.get("*", "-"))
            if isinstance(value, str):  # a failure: numbered, spelled out below the table
                out.append(f"{f'[{notes.setdefault(value, len(notes) + 1)}]':>{width}}")
            else:
                out.append(f"{value:{width}.3f}")
        return " ".join(out)

    for case in cases:
        for ranks in args.ranks:
            by_flops = makespans(case.flops, ranks, args.microbatches, args.latency)
            by_cpu = makespans(case.cpu_min, ranks, args.microbatches, args.latency)
            for schedule in by_flops:
                label = f"{case.mode:>5} {case.tokens:>6} {ranks:>5} {schedule:<13}"
                print(f"{label} | {cells(by_flops[schedule])} | {cells(by_cpu[schedule])}")
    for note, number in notes.items():
        print(f"  [{number}] {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[32, 128, 512], help="per microbatch"
    )
    parser.add_argument("--blocks", type=int, default=2, help="MLP blocks per stage")
    parser.add_argument(
        "--checkpoint", nargs="+", choices=("none", "full", "sac"), default=["none", "full"]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument(
        "--latency",
        type=float,
        default=0.0,
        help="per cross-rank dependency, in units of one stage's forward",
    )
    parser.add_argument("--reps", type=int, default=15, help="CPU-time repetitions")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    policies = [*split_policies(), "ideal"]
    print(
        f"torch {torch.__version__}, {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs,"
        f" torch threads {torch.get_num_threads()}, fp32,"
        f" {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    print(f"stage: {args.blocks} MLP blocks, d={args.d}; policies: {', '.join(policies)}")
    for ranks in args.ranks:  # why the 1F1B rows are not Schedule1F1B's (see SCHEDULES)
        try:
            simulate(
                torch_order("Schedule1F1B", ranks, args.microbatches, 1), dict.fromkeys(KINDS, 1.0)
            )
        except ScheduleError as exc:
            print(
                f"Schedule1F1B's pipeline_order at {ranks} ranks is refused ({exc}): 1F1B rows are"
                " ScheduleInterleaved1F1B's order with one stage per rank"
            )
    cases = []
    for mode in args.checkpoint:
        for tokens in args.tokens:
            stage = Stage(args.d, args.blocks, mode)
            flops, _ = measure_stage(stage, tokens, True, 1)
            cpu_min, cpu_median = measure_stage(stage, tokens, False, args.reps)
            cases.append(Case(mode, tokens, flops, cpu_min, cpu_median))
    print_costs(cases, policies)
    print_makespans(cases, policies, args)


if __name__ == "__main__":
    main()
