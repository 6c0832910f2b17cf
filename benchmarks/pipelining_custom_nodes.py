"""Split backward through custom Functions, compiled blocks and checkpointing (issue 11).

Run: PYTHONPATH=. python benchmarks/pipelining_custom_nodes.py [--quick]
Prints the torch version and machine, then per stage, side by side in this one
process (implementations interleaved in every repetition, minimum over
repetitions, one intra-op thread; each timed until the microbatch's graph is
released; wall time, and the thread's CPU time, which a loaded machine
disturbs less: on CPU the autograd engine runs on the calling thread): fused backward, gradsafe B+W, torch's split B+W (ms and ratios;
"crash" where it raises), how often each custom backward /
checkpointed forward ran per microbatch, and the bytes gradsafe keeps from B to
W (weight-side gradients of nodes B had to run whole).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import pipelining_split  # the sibling benchmark (this script's folder is on sys.path)
import torch
import torch._functorch.config
from torch import nn
from torch.distributed.pipelining import _backward as torch_split
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import stage_backward_input, stage_backward_weight

CALLS = {"custom backward": 0, "checkpointed forward": 0}


class Cell(torch.autograd.Function):
    """``tanh(h @ w)`` as a custom Function (a kernel library's fused op)."""

    @staticmethod
    def forward(ctx, h, w):  # type: ignore[no-untyped-def, override]
        y = torch.tanh(h @ w)
        ctx.save_for_backward(h, w, y)
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        CALLS["custom backward"] += 1
        h, w, y = ctx.saved_tensors
        g = grad * (1 - y * y)
        return g @ w.T, h.T @ g


def rnn(steps: int, d: int) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(d, d) / math.sqrt(d))

    def fwd(x: torch.Tensor) -> torch.Tensor:
        for _ in range(steps):
            x = Cell.apply(x, m.w)
        return x

    return m, fwd


def compiled_shared(sites: int, d: int) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    lin = nn.Linear(d, d)
    block = torch.compile(lambda x: torch.tanh(lin(x)), backend="aot_eager", fullgraph=True)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        for _ in range(sites):
            x = block(x)
        return x

    return lin, fwd


class Block(pipelining_split.Block):
    """The split benchmark's transformer block with dropout, counting its (re)computed forwards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["checkpointed forward"] += 1
        return super().forward(x)


def checkpointed(layers: int, d: int) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    blocks = nn.ModuleList(Block(d, dropout=0.1) for _ in range(layers))

    def fwd(x: torch.Tensor) -> torch.Tensor:
        for blk in blocks:
            x = checkpoint(blk, x, use_reentrant=False, preserve_rng_state=False)
        return x

    return blocks, fwd


def run(
    impl: str, model: nn.Module, fwd: Any, x: torch.Tensor
) -> tuple[tuple[float, float], dict[str, int], int]:
    """((wall, thread CPU) seconds of backward, calls during it, bytes kept from B to W).

    The time runs until the microbatch's graph is released (its outputs and
    hand-off dropped): a split B releases what W does not need itself, a
    fused backward leaves the nodes to whoever drops the outputs.
    """
    for p in model.parameters():
        p.grad = None
    box: dict[str, Any] = {"out": fwd(x)}
    g = torch.ones_like(box["out"])
    before = dict(CALLS)
    kept = 0
    if impl == "fused":
        start, cpu = time.perf_counter(), time.thread_time()
        torch.autograd.backward([box.pop("out")], [g])
    else:
        b, w = (
            (stage_backward_input, stage_backward_weight)
            if impl == "gradsafe"
            else (torch_split.stage_backward_input, torch_split.stage_backward_weight)
        )
        start, cpu = time.perf_counter(), time.thread_time()
        handoff: Any = b([box.pop("out")], [g], [x], model.parameters())[1]
        kept = getattr(handoff, "kept_bytes", 0)
        w(model.parameters(), handoff)
        del handoff
    t = (time.perf_counter() - start, time.thread_time() - cpu)
    return t, {k: CALLS[k] - before[k] for k in CALLS}, kept


def measure(name: str, model: nn.Module, fwd: Any, shape: tuple[int, ...], reps: int) -> None:
    x = torch.randn(*shape, requires_grad=True)
    times: dict[str, list[tuple[float, float]]] = {"fused": [], "gradsafe": [], "torch": []}
    info: dict[str, tuple[dict[str, int], int] | None] = {}
    for _ in range(reps):
        for impl in times:
            if impl in info and info[impl] is None:
                continue
            try:
                t, calls, kept = run(impl, model, fwd, x)
            except RuntimeError as exc:
                info[impl] = None
                print(f"  {impl} raised: {str(exc).splitlines()[0][:100]}")
                continue
            times[impl].append(t)
            info[impl] = (calls, kept)
    best = {
        impl: tuple(min(t[k] for t in ts) * 1e3 for k in (0, 1)) for impl, ts in times.items() if ts
    }
    print(f"{name}")
    for impl in times:
        if impl not in best:
            print(f"  {impl:9s}   crash")
            continue
        (wall, cpu), (fused_wall, fused_cpu) = best[impl], best["fused"]
        calls, kept = info[impl] or ({}, 0)
        counts = ", ".join(f"{k} {v}" for k, v in calls.items() if v)
        print(
            f"  {impl:9s} {wall:8.2f} ms {wall / fused_wall:5.2f}x fused | CPU {cpu:8.2f} ms "
            f"{cpu / fused_cpu:5.2f}x  [{counts}]"
            + (f"  kept B->W {kept / 2**20:.2f} MiB" if impl == "gradsafe" else "")
        )
    if "torch" in best and "gradsafe" in best:
        print(
            f"  gradsafe / torch's split: {best['gradsafe'][0] / best['torch'][0]:.2f}x wall, "
            f"{best['gradsafe'][1] / best['torch'][1]:.2f}x CPU"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sizes")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch._functorch.config.donated_buffer = False  # a split backward needs it (see docs)
    reps = 3 if args.quick else 15
    d = 64 if args.quick else 256
    print(
        f"torch {torch.__version__}, {platform.machine()} {platform.processor() or ''}".strip()
        + f", {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, fp32, min of {reps}"
    )
    steps = 50 if args.quick else 200
    measure(
        f"custom-Function RNN cell, one weight, {steps} steps, d={d}", *rnn(steps, d), (32, d), reps
    )
    measure(
        f"one aot_eager-compiled block at 48 sites, d={d}", *compiled_shared(48, d), (32, d), reps
    )
    layers = 4 if args.quick else 12
    measure(
        f"{layers} transformer blocks, non-reentrant checkpoint each, d={d}",
        *checkpointed(layers, d),
        (2, 64, d),
        reps,
    )


if __name__ == "__main__":
    main()
