"""W's share of the backward matmul FLOPs on a ``torch.compile``'d stage under gradsafe's split.

A stage of MLP blocks (LayerNorm, Linear d->4d, GELU, Linear 4d->d), d=64,
2 blocks, 64 tokens, float64, on the CPU: eager, each block compiled
(``torch.compile(block)``, inductor; also ``aot_eager``, the same AOTAutograd
graphs without code generation), and the whole stage compiled. One
microbatch's B (``stage_backward_input``) and W (``stage_backward_weight``)
run under a dispatch mode that counts matmul FLOPs with torch's own formulas
(``torch.utils.flop_counter.flop_registry``); it prints B's, W's and W's
share, and the largest difference from a fused backward's gradients.

AOTAutograd compiles one joint graph per region and runs its backward as one
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

import torch
import torch._functorch.config

from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import MatmulFlops

D, TOKENS, BLOCKS = 64, 64, 2


def block() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.LayerNorm(D),
        torch.nn.Linear(D, 4 * D),
        torch.nn.GELU(),
        torch.nn.Linear(4 * D, D),
    ).double()


def stage(mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [block() for _ in range(BLOCKS)]
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
    modes = ("eager", "blocks:aot_eager", "blocks:inductor", "stage:inductor")
    for mode in (*modes, "blocks:inductor, Linear eager"):
        counts, err = measure(mode)
        b, w = counts.get("B", 0), counts.get("W", 0)
        print(
            f"{mode:29} B {b:>9} W {w:>9} matmul FLOPs  W share {w / (b + w):.3f}  "
            f"max |grad - fused| {err:.1e}"
        )


if __name__ == "__main__":
    main()
