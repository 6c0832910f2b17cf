"""W's share of the backward matmul FLOPs on a ``torch.compile``'d stage under gradsafe's split.

A stage of MLP blocks (LayerNorm, Linear d->4d, GELU, Linear 4d->d), d=64,
2 blocks, 64 tokens, float64, on the CPU: eager, each block compiled
(``torch.compile(block)``, inductor; also ``aot_eager``, the same AOTAutograd
graphs without code generation), and the whole stage compiled. One
microbatch's B (``stage_backward_input``) and W (``stage_backward_weight``)
run under a dispatch mode that counts matmul FLOPs with torch's own formulas
(``torch.utils.flop_counter.flop_registry``); it prints B's, W's and W's
share, and the largest difference from a fused backward's gradients.

Each compiled row runs twice: without the patch (the direct-import path as it
was) and under ``gradsafe.patch("pipelining")``, which cuts each region's
backward into an input-gradient graph (B) and a weight-gradient graph (W).
Without the patch: AOTAutograd compiles one joint graph per region and runs its backward as one
custom autograd Function node (``CompiledFunctionBackward``): all of the
region's gradients come from one call, so gradsafe's B runs it whole and W
gets nothing of it (the figures show W's share 0.000 for compiled blocks).
The last line leaves each block's Linear layers out of the compiled graph
(``torch.compiler.disable`` on their ``forward``: a graph break), so their
GEMMs are built-in autograd nodes again and W carries their weight part.

Run: ``PYTHONPATH=. python benchmarks/pipelining_compiled_w_share.py`` (inductor needs a C compiler).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch._functorch.config

import gradsafe
from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import MatmulFlops

D, TOKENS, BLOCKS = 64, 64, 2
#: The timed stage: large enough that the split's fixed per-call cost is not what is measured.
TIMED_D, TIMED_TOKENS = 256, 512


def block(d: int = D) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.LayerNorm(d),
        torch.nn.Linear(d, 4 * d),
        torch.nn.GELU(),
        torch.nn.Linear(4 * d, d),
    ).double()


def stage(mode: str, d: int = D) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [block(d) for _ in range(BLOCKS)]
    if mode == "blocks:inductor, Linear eager":
        for b in blocks:
            for layer in b:
                if isinstance(layer, torch.nn.Linear):
                    # a graph break: the GEMM stays a built-in node W can call again
                    layer.forward = torch.compiler.disable(layer.forward)  # type: ignore[method-assign]
        blocks = [torch.compile(b) for b in blocks]  # type: ignore[misc]
    elif mode.startswith("blocks"):
        backend = mode.split(":")[1]
        blocks = [torch.compile(b, backend=backend) for b in blocks]  # type: ignore[misc]
    whole = torch.nn.Sequential(*blocks)
    if mode == "stage:inductor":
        return torch.compile(whole)  # type: ignore[return-value]
    return whole


def measure(mode: str) -> tuple[dict[str, int], float]:
    model = stage(mode)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, D, dtype=torch.float64, generator=gen)
    g = torch.randn(TOKENS, D, dtype=torch.float64, generator=gen)
    # a fused backward first (also compiles the region)
    xr = x.clone().requires_grad_()
    model(xr).backward(g)
    want = [p.grad.clone() for p in params] + [xr.grad]  # type: ignore[union-attr]
    for p in params:
        p.grad = None
    xs = x.clone().requires_grad_()
    y = model(xs)
    counter = MatmulFlops()
    with counter:
        counter.phase = "B"
        (dx,), handoff = stage_backward_input(y, g, [xs], params)
        counter.phase = "W"
        stage_backward_weight(params, handoff)
    got = [p.grad for p in params] + [dx]
    err = max((a - b).abs().max().item() for a, b in zip(got, want))  # type: ignore[operator]
    return dict(counter.counts), err


def main() -> None:
    # The fused reference backward runs first: without this a compiled block's
    # backward would donate its saved buffers, which a split refuses.
    torch._functorch.config.donated_buffer = False
    print(
        f"torch {torch.__version__}, {platform.machine()}, d={D}, {TOKENS} tokens, {BLOCKS} blocks"
    )
    modes = ("blocks:aot_eager", "blocks:inductor", "stage:inductor")
    rows = [
        ("eager", False),
        *((m, False) for m in modes),
        ("blocks:inductor, Linear eager", False),
    ]
    rows += [(m, True) for m in modes]
    for mode, split in rows:
        torch._dynamo.reset()
        if split:
            with gradsafe.patch("pipelining"):
                counts, err = measure(mode)
        else:
            counts, err = measure(mode)
        b, w = counts.get("B", 0), counts.get("W", 0)
        label = f"{mode}{', patched' if split else ''}"
        print(
            f"{label:36} B {b:>9} W {w:>9} matmul FLOPs  W share {w / (b + w):.3f}  "
            f"max |grad - fused| {err:.1e}"
        )


def _timed(step: Callable[[], None], reps: int = 15) -> tuple[list[float], list[float]]:
    for _ in range(5):  # warm-up (a first run may compile)
        step()
    walls, cpus = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.thread_time()
        step()
        walls.append((time.perf_counter() - w0) * 1e3)
        cpus.append((time.thread_time() - c0) * 1e3)
    return walls, cpus


def backward_times(split: bool) -> dict[str, tuple[list[float], list[float]]]:
    """Per backward (ms): the inductor-compiled blocks' fused backward, and (patched) B+W."""
    model = stage("blocks:inductor", TIMED_D)
    params = list(model.parameters())
    x = torch.randn(TIMED_TOKENS, TIMED_D, dtype=torch.float64, requires_grad=True)
    g = torch.randn(TIMED_TOKENS, TIMED_D, dtype=torch.float64)
    model(x).backward(g)  # compiles

    def fused() -> None:
        y = model(x)
        torch.autograd.grad(y, [x, *params], g)

    def b_then_w() -> None:
        y = model(x)
        _, handoff = stage_backward_input(y, g, [x], params)
        stage_backward_weight(params, handoff)

    times = {"fused": _timed(fused)}
    if split:
        times["B+W"] = _timed(b_then_w)
    return times


def timing() -> None:
    """Forward+backward times: fused unpatched, fused patched, forward+B+W patched.

    One intra-op thread: on a shared CPU, OpenMP threads waiting for cores
    swamp the differences measured here."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    plain = backward_times(split=False)
    torch._dynamo.reset()
    with gradsafe.patch("pipelining"):
        patched = backward_times(split=True)
    rows = [
        ("fused, not patched", plain, "fused"),
        ("fused, patched (dI then dW)", patched, "fused"),
    ]
    rows.append(("forward, B, W, patched", patched, "B+W"))
    print(
        f"blocks:inductor, d={TIMED_D}, {TIMED_TOKENS} tokens, forward+backward (ms) | wall min | wall median | "
        "thread CPU min | thread CPU median | thread CPU min / not patched fused's"
    )
    base = min(plain["fused"][1])
    for name, times, key in rows:
        walls, cpus = times[key]
        print(
            f"{name} | {min(walls):.2f} | {statistics.median(walls):.2f} | {min(cpus):.2f} | "
            f"{statistics.median(cpus):.2f} | {min(cpus) / base:.2f}"
        )


if __name__ == "__main__":
    main()
    timing()
