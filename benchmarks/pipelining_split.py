"""Split backward (B/W) cost: gradsafe vs torch's own vs one fused backward, side by side.

Run: PYTHONPATH=. python benchmarks/pipelining_split.py [--quick] [--section N] [--sweep] [--device cuda]
Prints the torch version, machine and date, then times (ms) and ratios measured
in this one process, interleaving the implementations in every repetition, on
one intra-op thread. Each figure is thread CPU time (what this thread spent,
which other processes on a shared machine disturb far less than wall time),
given as the minimum and the median over repetitions, with wall time's minimum
beside it; "noise" is median / minimum of gradsafe's CPU time (close to 1 on a
quiet machine). Ratios are taken between figures of the same kind.

The implementations run in every order in turn (all permutations, one per
repetition): the backward right after one that freed much memory pays that
memory's page faults again (glibc hands large freed blocks back to the
system), and a fixed order charged them to the same implementation every time
(``--fixed-order`` shows it; so would a rotation, which keeps who follows whom).

Section 7 times the two small rows of section 2 (fixed per-call cost) with many
interleaved repetitions (``--small-reps``, default 1000), gradsafe and torch's split
only, printing the 10th percentile and the median of B, W and B + W: 15
repetitions of a sub-millisecond backward on a loaded machine move the ratio by
20 %.

Sections 1-3 run by default; ``--sweep`` adds 4 (B+W over stage sizes, d = 64
to 4096, depth 12 to 192) and 5 (per-node cost on 1.5 k to 50 k nodes), which
take several minutes.

``--device cuda`` runs the models on the GPU at sizes that occupy it (section 2:
d = 1024, 4096 tokens; the small rows unchanged) and puts the GPU time of each
B, W and fused backward, from CUDA events recorded around it, where wall time
stood, and the process's CPU time for the thread's (autograd runs CUDA nodes on
a device thread of its own).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.pipelining import _backward as torch_split

from gradsafe.pipelining import _graph, _weight_pass, stage_backward_input, stage_backward_weight
from gradsafe.pipelining._hazards import ReusedLinear

Forward = Callable[[torch.Tensor], torch.Tensor]


class Block(nn.Module):
    """Pre-norm attention + 4x MLP (optional dropout after the MLP's activation)."""

    def __init__(self, d: int, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        split = lambda z: z.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        att = (split(q) @ split(k).transpose(-1, -2) / math.sqrt(d // self.heads)).softmax(-1)
        x = x + self.proj((att @ split(v)).transpose(1, 2).reshape(b, t, d))
        h = F.gelu(self.fc1(self.ln2(x)))
        return x + self.fc2(F.dropout(h, self.dropout) if self.dropout else h)


def linear_stack(layers: int, d: int, shared: bool, bias: bool) -> tuple[nn.Module, Forward]:
    if shared:  # H1's nested-shared-weight reproduction, at size
        one = ReusedLinear(d, layers, bias)
        return one, one
    stack = nn.Sequential(
        *(m for _ in range(layers) for m in (nn.Linear(d, d, bias=bias), nn.Tanh()))
    )
    return stack, stack


def recurrence(steps: int, d: int) -> tuple[nn.Module, Forward]:
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
    m.u = nn.Parameter(torch.randn(d, d) / math.sqrt(d))

    def fwd(x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x)
        for _ in range(steps):
            h = torch.tanh(h @ m.w + x @ m.u)  # x @ w points straight at w's AccumulateGrad
        return h

    return m, fwd


def transformer(layers: int, d: int) -> tuple[nn.Module, Forward]:
    stack = nn.Sequential(*(Block(d) for _ in range(layers)))
    return stack, stack


# Minor page faults of this thread (Linux); of the process elsewhere.
_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


DEVICE = torch.device("cpu")  # --device


def _cpu() -> float:
    """Thread CPU time; on CUDA the process's, since autograd runs CUDA nodes on its device thread."""
    return time.process_time() if DEVICE.type == "cuda" else time.thread_time()


def _time(fn: Callable[[], Any]) -> tuple[float, float, int]:
    """(wall, thread CPU) seconds and minor page faults of one call; on CUDA, GPU time for wall."""
    faults = resource.getrusage(_RUSAGE).ru_minflt
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cpu = _cpu()
        start.record()
        fn()
        end.record()
        cpu = _cpu() - cpu
        end.synchronize()
        gpu = start.elapsed_time(end) / 1e3
        return gpu, cpu, resource.getrusage(_RUSAGE).ru_minflt - faults
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return (
        time.perf_counter() - wall,
        time.thread_time() - cpu,
        resource.getrusage(_RUSAGE).ru_minflt - faults,
    )


class Impl:
    def __init__(self, name: str, b: Any, w: Any) -> None:
        self.name, self.b, self.w = name, b, w

    def run(
        self, model: nn.Module, fwd: Forward, x: torch.Tensor
    ) -> tuple[tuple[float, float, int], ...]:
        """(wall, CPU) of B and of W; for the fused backward, all of it is B."""
        out = fwd(x)
        g = torch.ones_like(out)
        if self.b is None:  # fused
            return _time(lambda: torch.autograd.backward([out], [g])), (0.0, 0.0, 0)
        box: dict[str, Any] = {}
        tb = _time(lambda: box.setdefault("h", self.b([out], [g], [x], model.parameters())[1]))
        tw = _time(lambda: self.w(model.parameters(), box["h"]))
        return tb, tw


IMPLS = {
    "fused": Impl("fused", None, None),
    "gradsafe": Impl("gradsafe", stage_backward_input, stage_backward_weight),
    "torch": Impl("torch", torch_split.stage_backward_input, torch_split.stage_backward_weight),
}


FIXED_ORDER = False  # --fixed-order: fused, gradsafe, torch in every repetition (the old way)


def measure(
    model: nn.Module,
    fwd: Forward,
    x_shape: tuple[int, ...],
    reps: int,
    warmup: int = 3,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Per implementation: B, W and B+W in CPU ms (min), B+W CPU median, B+W wall min, noise."""
    model.to(DEVICE)
    samples: dict[str, list[tuple[tuple[float, float, int], ...]]] = {k: [] for k in IMPLS}
    crashed: dict[str, str] = {}
    names = [name for name in IMPLS if name not in skip]
    orders = [list(names)] if FIXED_ORDER else [list(o) for o in itertools.permutations(names)]
    for rep in range(reps + warmup):
        for name in orders[rep % len(orders)]:
            impl = IMPLS[name]
            if name in crashed:
                continue
            model.zero_grad(set_to_none=True)
            x = torch.randn(*x_shape, device=DEVICE, requires_grad=True)
            try:
                timing = impl.run(model, fwd, x)
            except RuntimeError as exc:
                crashed[name] = str(exc).strip().splitlines()[-1][:60]
                continue
            if rep >= warmup:
                samples[name].append(timing)
    result: dict[str, Any] = {}
    for name, s in samples.items():
        if name in crashed or name in skip:
            result[name] = None
            continue
        cpu = [b[1] + w[1] for b, w in s]
        result[name] = {
            "B": min(b[1] for b, _ in s) * 1e3,
            "W": min(w[1] for _, w in s) * 1e3,
            "total": min(cpu) * 1e3,
            "median": statistics.median(cpu) * 1e3,
            "wall": min(b[0] + w[0] for b, w in s) * 1e3,
            "noise": statistics.median(cpu) / min(cpu),
            "faults": statistics.median(b[2] + w[2] for b, w in s),
        }
    result["crashed"] = crashed
    return result


def fmt(v: float | None) -> str:
    return "  crash" if v is None else f"{v:7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sizes")
    parser.add_argument(
        "--section",
        type=int,
        choices=(1, 2, 3, 4, 5, 6, 7),
        action="append",
        help="run only these",
    )
    parser.add_argument("--sweep", action="store_true", help="also sections 4 and 5 (minutes)")
    parser.add_argument(
        "--fixed-order",
        action="store_true",
        help="no rotation: shows the page faults a fixed order charges to one implementation",
    )
    parser.add_argument(
        "--device", default="cpu", help="cuda: on the GPU, GPU time from CUDA events for wall"
    )
    parser.add_argument(
        "--small-reps", type=int, default=1000, help="section 7's repetitions (default 1000)"
    )
    args = parser.parse_args()
    global FIXED_ORDER, DEVICE
    FIXED_ORDER = args.fixed_order
    DEVICE = torch.device(args.device)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    reps = 5 if args.quick else 15
    d, tokens = (128, 256) if args.quick else (256, 1024)
    if DEVICE.type == "cuda":
        d, tokens = (512, 2048) if args.quick else (1024, 4096)
    gpu = f", {torch.cuda.get_device_name()} (wall = GPU time)" if DEVICE.type == "cuda" else ""
    print(
        f"torch {torch.__version__}, {platform.machine()} {platform.processor() or ''}".strip()
        + f", {os.cpu_count()} CPUs{gpu}, torch threads {torch.get_num_threads()}, fp32,"
        + f" min of {reps}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )

    sections = set(args.section or ((1, 2, 3, 4, 5, 6) if args.sweep else (1, 2, 3, 6)))
    if 1 in sections:
        section_w_shared(d, tokens, reps)
    if 2 in sections:
        section_b_plus_w(d, tokens, reps)
    if 3 in sections:
        section_analysis()
    if 4 in sections:
        section_sweep(args.quick)
    if 5 in sections:
        section_per_node(args.quick)
    if 6 in sections:
        section_own(reps)
    if 7 in sections:
        section_small(args.small_reps)


def section_w_shared(d: int, tokens: int, reps: int) -> None:
    print(
        "\n1. W of one bias-free Linear applied L times vs L distinct Linears (tokens x d = "
        f"{tokens} x {d})"
    )
    print(f"{'L':>4} | {'gradsafe W shared/distinct':>27} | {'torch W shared/distinct':>24}")
    for layers in (4, 12):
        res = {
            s: measure(*linear_stack(layers, d, s, False), (tokens, d), reps) for s in (True, False)
        }
        ratios = []
        for name in ("gradsafe", "torch"):
            sh, di = res[True][name], res[False][name]
            ratios.append(
                "crash"
                if sh is None or di is None
                else f"{sh['W']:.2f}/{di['W']:.2f} = {sh['W'] / di['W']:.2f}x"
            )
        print(f"{layers:>4} | {ratios[0]:>27} | {ratios[1]:>24}")


def section_b_plus_w(d: int, tokens: int, reps: int) -> None:
    print("\n2. B+W (ms) vs torch's own B+W and one fused backward")
    models = {
        f"12 distinct Linear (d={d})": (linear_stack(12, d, False, True), (tokens, d)),
        "1 Linear x12, no bias": (linear_stack(12, d, True, False), (tokens, d)),
        "1 Linear x12, bias": (linear_stack(12, d, True, True), (tokens, d)),
        "recurrence h@w + x@u x12": (recurrence(12, d), (tokens, d)),
        f"12 transformer blocks (d={d // 2})": (transformer(12, d // 2), (4, tokens // 8, d // 2)),
        f"12 transformer blocks (d={d})": (transformer(12, d), (4, tokens // 8, d)),
        "small: 12 distinct Linear(64), 64 tokens": (linear_stack(12, 64, False, True), (64, 64)),
        "small: 1 Linear(256), 64 tokens": (linear_stack(1, 256, False, True), (64, 256)),
    }
    print(
        "   thread CPU ms (min over repetitions); ratios of CPU min, CPU median and wall min;"
        " minor page faults per backward (median) of fused, gradsafe B+W, torch B+W"
        + (" (fixed order: fused, gradsafe, torch)" if FIXED_ORDER else "")
    )
    print(
        f"{'model':<40} | {'fused':>7} | {'gs B':>7} {'gs W':>7} {'gs B+W':>7} | {'torch B+W':>9} | "
        f"{'gs/fused min/med/wall':>22} | {'gs/torch min/med/wall':>22} | {'noise':>5} | faults"
    )
    for label, ((model, fwd), shape) in models.items():
        r = measure(model, fwd, shape, reps)
        gs, tc, fu = r["gradsafe"], r["torch"], r["fused"]
        ratios = lambda a, b: "/".join(f"{a[k] / b[k]:.2f}" for k in ("total", "median", "wall"))  # noqa: E731
        vs_torch = "torch crashes" if tc is None else ratios(gs, tc)
        print(
            f"{label:<40} | {fu['total']:7.2f} | {gs['B']:7.2f} {gs['W']:7.2f} {gs['total']:7.2f} | "
            f"{fmt(None if tc is None else tc['total']):>9} | {ratios(gs, fu):>22} | {vs_torch:>22} | "
            f"{gs['noise']:5.2f} | {fu['faults']:.0f} {gs['faults']:.0f} "
            + ("-" if tc is None else f"{tc['faults']:.0f}")
        )


def section_analysis() -> None:
    print("\n3. Graph analysis (gradsafe B's classification walk) on transformer stacks, d=16")
    print(f"{'layers':>6} | {'nodes':>6} | {'ms':>7} | {'us/node':>7}")
    for layers in (24, 96, 384):
        model, fwd = transformer(layers, 16)
        x = torch.randn(2, 4, 16, requires_grad=True)
        out = fwd(x)
        edges = [get_gradient_edge(out)]
        inputs = [get_gradient_edge(x).node]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            graph = _graph.analyze(edges, inputs)
            times.append(time.perf_counter() - start)
        t = min(times) * 1e3
        print(f"{layers:>6} | {graph.num_nodes:>6} | {t:7.2f} | {t * 1e3 / graph.num_nodes:7.2f}")


# (d, depth) of the Linear + tanh stacks of section 4; d=4096 stops at depth 12
# (2.4 GiB of parameters and gradients alone at depth 48).
SWEEP = ((64, 12), (64, 48), (64, 192), (256, 12), (256, 48), (256, 192), (1024, 12), (1024, 48))
SWEEP_LARGE = ((4096, 12),)


def section_sweep(quick: bool) -> None:
    tokens = 128
    print(
        f"\n4. B+W over stage sizes: depth x (Linear(d) + tanh), {tokens} tokens; thread CPU ms"
        f" (min of {3 if quick else 7})"
    )
    print("   overhead = gradsafe / fused - 1; '<5%' marks rows where it is under 5 %")
    print(
        f"{'d':>5} {'depth':>5} {'nodes':>6} | {'fused':>8} | {'torch':>8} | {'gradsafe':>8} | "
        f"{'overhead':>8} | {'gs/torch':>8} | {'noise':>5} |"
    )
    for d, depth in SWEEP + (() if quick else SWEEP_LARGE):
        model, fwd = linear_stack(depth, d, False, True)
        # Default init shrinks activations ~1.7x per layer: deep stacks would
        # run on denormals (100x slower arithmetic). Tanh's gain keeps them O(1).
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=5 / 3 / math.sqrt(d))
        nodes = _nodes(fwd, (tokens, d))
        r = measure(model, fwd, (tokens, d), 3 if quick else 7, warmup=2 if d >= 1024 else 3)
        gs, tc, fu = r["gradsafe"], r["torch"], r["fused"]
        over = gs["total"] / fu["total"] - 1
        vs_torch = "crash" if tc is None else f"{gs['total'] / tc['total']:.2f}"
        print(
            f"{d:>5} {depth:>5} {nodes:>6} | {fu['total']:8.2f} | {fmt(None if tc is None else tc['total']):>8} | "
            f"{gs['total']:8.2f} | {over * 100:7.1f}% | {vs_torch:>8} | {gs['noise']:5.2f} | "
            + ("<5%" if over < 0.05 else "")
        )
        del model, fwd


def _nodes(fwd: Forward, shape: tuple[int, ...]) -> int:
    """Autograd nodes of one stage backward (as B's walk counts them)."""
    x = torch.randn(*shape, requires_grad=True)
    out = fwd(x)
    return _graph.analyze([get_gradient_edge(out)], [get_gradient_edge(x).node]).num_nodes


def section_per_node(quick: bool) -> None:
    print(
        "\n5. Per-node cost: transformer blocks, d=16, batch 2 x 4 tokens (the work is all per node);"
        " thread CPU ms (min of 3)"
    )
    print(
        f"{'layers':>6} {'nodes':>6} | {'fused':>8} | {'torch':>8} | {'gradsafe':>8} | "
        f"{'(gs-fused)/node':>15} | {'gs/fused':>8} | {'(gs-torch)/node':>15} | {'noise':>5}"
    )
    for layers in (24, 96, 384) if quick else (24, 96, 384, 816):
        model, fwd = transformer(layers, 16)
        nodes = _nodes(fwd, (2, 4, 16))
        # torch's W is quadratic in the nodes here (18 s at 23 k nodes): not run beyond 6 k.
        r = measure(model, fwd, (2, 4, 16), 3, warmup=2, skip=("torch",) if nodes > 6000 else ())
        gs, tc, fu = r["gradsafe"], r["torch"], r["fused"]
        torch_ms = "skipped" if tc is None else f"{tc['total']:8.1f}"
        per_torch = "-" if tc is None else f"{(gs['total'] - tc['total']) / nodes * 1e3:.2f} us"
        print(
            f"{layers:>6} {nodes:>6} | {fu['total']:8.1f} | {torch_ms:>8} | {gs['total']:8.1f} | "
            f"{(gs['total'] - fu['total']) / nodes * 1e3:12.2f} us | "
            f"{gs['total'] / fu['total']:8.2f} | {per_torch:>15} | "
            f"{gs['noise']:5.2f}"
        )


class _Timed:
    """Thread CPU time spent inside calls of ``owner.name`` (those ``only`` admits) while installed."""

    def __init__(self, owner: Any, name: str, only: Callable[..., bool] = lambda *a: True) -> None:
        self.owner, self.name, self.only = owner, name, only
        self.inner = getattr(owner, name)
        self.total = 0.0

    def __enter__(self) -> _Timed:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.only(*args):
                return self.inner(*args, **kwargs)
            start = _cpu()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.total += _cpu() - start

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.owner, self.name, self.inner)


def section_own(reps: int) -> None:
    print(
        "\n6. gradsafe's own time: B+W minus the work any split does (B's engine call, W's node"
        " calls and reductions, W's delivery engine calls); thread CPU ms, median. 'own' still"
        " counts freeing the gradients W consumed. 'split work': the parts any split runs (B's engine"
        " call, W's node calls, reductions, delivery) over fused, a floor under gradsafe / fused"
    )
    print(
        f"{'model':<40} | {'fused':>7} | {'gs B+W':>7} | {'B engine':>8} | {'W nodes':>7} | "
        f"{'reduce':>6} | {'deliver':>7} | {'own':>6} | {'own/fused':>9} | {'split work/fused':>16}"
    )
    models = {
        "12 transformer blocks (d=128)": (transformer(12, 128), (4, 128, 128)),
        "small: 12 distinct Linear(64), 64 tokens": (linear_stack(12, 64, False, True), (64, 64)),
        "small: 1 Linear(256), 64 tokens": (linear_stack(1, 256, False, True), (64, 256)),
    }
    for label, ((model, fwd), shape) in models.items():
        model.to(DEVICE)
        rows: list[tuple[float, ...]] = []
        for rep in range(reps + 3):
            model.zero_grad(set_to_none=True)
            x = torch.randn(*shape, device=DEVICE, requires_grad=True)
            fused = IMPLS["fused"].run(model, fwd, x)[0][1]
            model.zero_grad(set_to_none=True)
            x = torch.randn(*shape, device=DEVICE, requires_grad=True)
            # What gradsafe runs that a split must: B's engine call, each node W calls
            # for its weight part, the reductions of broadcast gradients the engine
            # would make, and the engine calls that deliver (those without `wanted`;
            # the one with it only hosts the node calls).
            with (
                # B's engine entry: autograd.grad's own import of it, and the
                # module's, which B calls where it bypasses autograd.grad.
                _Timed(torch.autograd, "_engine_run_backward") as b_engine,
                _Timed(torch.autograd.graph, "_engine_run_backward") as b_direct,
                _Timed(_weight_pass, "call_node") as nodes,
                _Timed(torch.Tensor, "sum_to_size") as reduce,
                _Timed(_weight_pass, "run_backward", lambda *a: len(a) < 3) as deliver,
            ):
                tb, tw = IMPLS["gradsafe"].run(model, fwd, x)
            parts = (b_engine.total + b_direct.total, nodes.total, reduce.total, deliver.total)
            if rep >= 3:
                rows.append((fused, tb[1] + tw[1], *parts, tb[1] + tw[1] - sum(parts)))
        f, t, be, wn, re, de, own = (statistics.median(col) * 1e3 for col in zip(*rows))
        print(
            f"{label:<40} | {f:7.2f} | {t:7.2f} | {be:8.2f} | {wn:7.2f} | {re:6.2f} | {de:7.2f} | "
            f"{own:6.2f} | {own / f * 100:8.1f}% | {(be + wn + re + de) / f:15.2f}x"
        )


def section_small(reps: int) -> None:
    print(
        f"\n7. The small rows, {reps} repetitions, gradsafe and torch's split interleaved (order"
        " alternating); thread CPU us, 10th percentile / median"
    )
    print(
        f"{'model':<40} | {'gs B':>9} {'gs W':>9} {'gs B+W':>9} | {'torch B':>9} {'torch W':>9} "
        f"{'torch B+W':>9} | {'gs/torch p10/med':>16}"
    )
    models = {
        "small: 12 distinct Linear(64), 64 tokens": (linear_stack(12, 64, False, True), (64, 64)),
        "small: 1 Linear(256), 64 tokens": (linear_stack(1, 256, False, True), (64, 256)),
    }
    for label, ((model, fwd), shape) in models.items():
        model.to(DEVICE)
        times: dict[str, list[tuple[float, float]]] = {"gradsafe": [], "torch": []}
        for rep in range(reps + 20):
            for name in ("gradsafe", "torch") if rep % 2 else ("torch", "gradsafe"):
                model.zero_grad(set_to_none=True)
                x = torch.randn(*shape, device=DEVICE, requires_grad=True)
                tb, tw = IMPLS[name].run(model, fwd, x)
                if rep >= 20:
                    times[name].append((tb[1], tw[1]))

        def cell(samples: list[float]) -> tuple[float, float]:
            ordered = sorted(samples)
            return ordered[len(ordered) // 10] * 1e6, statistics.median(ordered) * 1e6

        row = {
            name: [cell([b for b, _ in t]), cell([w for _, w in t]), cell([b + w for b, w in t])]
            for name, t in times.items()
        }
        gs, tc = row["gradsafe"], row["torch"]
        text = lambda c: f"{c[0]:4.0f}/{c[1]:4.0f}"  # noqa: E731
        print(
            f"{label:<40} | {' '.join(text(c) for c in gs)} | {' '.join(text(c) for c in tc)} | "
            f"{gs[2][0] / tc[2][0]:7.2f}/{gs[2][1] / tc[2][1]:.2f}"
        )


if __name__ == "__main__":
    main()
