"""Cost of side-effect-free stage metadata inference (H6): a schedule's first step, gradsafe vs torch.

Run: PYTHONPATH=. python benchmarks/pipelining_inference.py [--quick] [--layers 2 --dim 256]

Two stages of ``layers`` transformer blocks (plus a BatchNorm, whose statistics
gradsafe copies back) on one gloo rank, ``ScheduleInterleaved1F1B`` with 4
microbatches and an MSE loss (no backward inside it, so torch and gradsafe
compute the same gradients and only the inference's bookkeeping differs). Each
repetition builds fresh stages and a fresh schedule and times step 1 (which
runs torch's metadata inference; under gradsafe with the snapshot, zero
inputs, silenced hooks and restore) and step 2 (no inference), torch and
gradsafe interleaved in every repetition. Parameters hold gradients from an
earlier step, so gradsafe parks and puts them back. Wall and thread CPU
time, min and median, on one intra-op thread; ratios are gradsafe / torch.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradsafe
from gradsafe.pipelining.schedule._inference import InferenceSnapshot
from gradsafe.pipelining.schedule._one_rank import one_rank_world

_MICROBATCHES = 4


class Block(nn.Module):
    """Pre-norm self-attention + 4x MLP."""

    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.att(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def _stage(layers: int, d: int, seq: int) -> nn.Module:
    return nn.Sequential(nn.BatchNorm1d(seq), *(Block(d) for _ in range(layers)))


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _one(args: Any, patched: bool) -> tuple[tuple[float, float], tuple[float, float]]:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    modules = [_stage(args.layers, args.dim, args.seq) for _ in range(2)]
    for module in modules:
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    schedule = ScheduleInterleaved1F1B(
        stages, n_microbatches=_MICROBATCHES, loss_fn=lambda y, t: (y - t).square().mean()
    )
    x = torch.randn(_MICROBATCHES * args.batch, args.seq, args.dim)
    target = torch.randn_like(x)
    with gradsafe.patch("pipelining") if patched else _nothing():
        first = _timed(lambda: schedule.step(x, target=target))
        second = _timed(lambda: schedule.step(x, target=target))
    return first, second


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.dim, args.seq, args.reps = 64, 16, 3
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(
        f"torch {torch.__version__}, {platform.machine()} {platform.processor() or ''}".strip()
        + f", {os.cpu_count()} cores (shared), 1 intra-op thread"
    )
    print(
        f"2 stages x {args.layers} blocks (d={args.dim}, seq {args.seq}, +BatchNorm), "
        f"{_MICROBATCHES} microbatches of {args.batch}, ScheduleInterleaved1F1B, {args.reps} reps"
    )
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    with one_rank_world():
        _one(args, False), _one(args, True)  # warm-up
        for _ in range(args.reps):
            for patched in (False, True):
                first, second = _one(args, patched)
                times.setdefault(("step 1 (inference)", patched), []).append(first)
                times.setdefault(("step 2", patched), []).append(second)
    modules = [_stage(args.layers, args.dim, args.seq) for _ in range(2)]
    for module in modules:
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    snapshot = [_timed(lambda: InferenceSnapshot.take(modules).restore()) for _ in range(args.reps)]
    print(
        f"{'':22}{'torch ms (min/med)':>22}{'gradsafe ms (min/med)':>24}"
        f"{'ratio wall (min/med)':>24}{'ratio cpu (min/med)':>22}"
    )
    for what in ("step 1 (inference)", "step 2"):
        up, gs = times[(what, False)], times[(what, True)]
        row = []
        for k in (0, 1):
            a, b = [t[k] for t in up], [t[k] for t in gs]
            row.append((min(a), statistics.median(a), min(b), statistics.median(b)))
        wall, cpu = row
        print(
            f"{what:22}{wall[0] * 1e3:>10.1f} / {wall[1] * 1e3:<9.1f}{wall[2] * 1e3:>12.1f} / "
            f"{wall[3] * 1e3:<9.1f}{wall[2] / wall[0]:>12.3f} / {wall[3] / wall[1]:<9.3f}"
            f"{cpu[2] / cpu[0]:>10.3f} / {cpu[3] / cpu[1]:<9.3f}"
        )

    first_step = min(t[0] for t in times[("step 1 (inference)", False)])
    took = [t[0] for t in snapshot]
    print(
        f"snapshot take + restore alone (both stages): {min(took) * 1e3:.2f} / "
        f"{statistics.median(took) * 1e3:.2f} ms (min/med) = "
        f"{min(took) / first_step:.4f} of torch's step 1 (min)"
    )


if __name__ == "__main__":
    main()
