"""How each split divides a checkpointed stage's backward between B and W (issue 29).

Run: PYTHONPATH=. python benchmarks/pipelining_balance.py [--d 128] [--blocks 2] [--torchtitan
[--compile BACKEND]]
Prints the torch version and machine, then, for a stage of MLP blocks
(LayerNorm, Linear d->4d, GELU, Linear 4d->d; float64) without checkpointing,
with every block checkpointed (``use_reentrant=False``) and with selective
checkpointing saving the matmuls' outputs (torchtitan's "op" SAC), at 0.25*d,
d and 4*d tokens per microbatch: per split (gradsafe under each
``CheckpointedWeights`` policy, torch's own, and a fused backward) the matmul
MFLOP run in B and in W, W's share of them in both senses gradsafe names
("W share of backward": W/(B+W), recomputation included, as ``gradsafe verify
--work`` and benchmarks/pipelining_schedule.py print it; "of gradients": the
recomputation left out), how many forwards' worth of matmuls the
backward recomputes, and the bytes alive between B and W (absolute, and over
the same stage's without checkpointing). Counted, not timed
(benchmarks/_balance.py), so any machine prints the same figures.
``--torchtitan`` (torchtitan 0.3.0 installed, torch >= 2.14) also prints, per
policy, the matmul MFLOP in B and W of the middle stages of torchtitan's
llama3 debugmodel, stages built as ``gradsafe verify --torchtitan`` builds
them for ZBV on 2 ranks (torchtitan's default selective AC), one microbatch;
with ``--compile aot_eager`` (or ``inductor``), each transformer block compiled
in place over its AC wrapper first, as torchtitan's ``--compile.enable`` does,
once without the patch and once compiled afresh under ``gradsafe.patch()``.
"""

from __future__ import annotations

import argparse
import platform

import torch
from _balance import Split, measure  # beside this script (its folder is on sys.path)
from torch import nn

import gradsafe
from gradsafe.pipelining import (
    CheckpointedWeights,
    checkpointed_weights,
    stage_backward_input,
    stage_backward_weight,
)
from gradsafe.testing import MatmulFlops

SPLITS: tuple[Split, ...] = (*CheckpointedWeights, "torch", "fused")


def _name(split: Split) -> str:
    return split.name if isinstance(split, CheckpointedWeights) else split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--torchtitan", action="store_true")
    parser.add_argument("--compile", choices=("aot_eager", "inductor"), default=None)
    args = parser.parse_args()
    d = args.d
    print(f"torch {torch.__version__}, {platform.machine()}, d={d}, {args.blocks} blocks, float64")
    header = (
        f"{'tokens':>6} {'checkpointing':<10} {'split':<15} {'B MFLOP':>9} {'W MFLOP':>9} "
        f"{'W/bwd':>6} {'W/grads':>7} {'recomputes':>10} {'held B->W':>11} {'/ no AC':>8}"
    )
    print(header)
    print("(W/bwd: W share of backward, W/(B+W); W/grads: of gradients, recomputation left out)")
    for tokens in (d // 4, d, 4 * d):
        plain = measure(CheckpointedWeights.IN_W, "none", tokens, d, args.blocks).held
        for checkpointing in ("none", "full", "selective"):
            for split in SPLITS:
                name = _name(split)
                try:
                    r = measure(split, checkpointing, tokens, d, args.blocks)  # type: ignore[arg-type]
                except RuntimeError as exc:
                    print(f"{tokens:>6} {checkpointing:<10} {name:<15} crash: {str(exc)[:60]}")
                    continue
                share = "" if split == "fused" else f"{r.w / (r.b + r.w):>6.3f} {r.w_share:>7.3f}"
                held = "" if split == "fused" else f"{r.held:>11,d} {r.held / plain:>8.2f}"
                print(
                    f"{tokens:>6} {checkpointing:<10} {name:<15} {r.b / 1e6:>9.1f} "
                    f"{r.w / 1e6:>9.1f} {share:>14} {r.recomputes:>10.2f} {held}"
                )
    if args.torchtitan:
        torchtitan_stages(args.compile)


def torchtitan_stages(backend: str | None) -> None:
    compiled = f", blocks compiled in place ({backend})" if backend else ""
    print(f"torchtitan llama3 debugmodel, ZBV on 2 ranks, middle stages, one microbatch{compiled}")
    if backend is None:
        _torchtitan_rows(None, "")
        return
    # A compiled block splits only if its forward compiled under the patch: both, compiled afresh.
    _torchtitan_rows(backend, "not patched ")
    torch._dynamo.reset()
    with gradsafe.patch():
        _torchtitan_rows(backend, "patched ")


def _torchtitan_rows(backend: str | None, label: str) -> None:
    from gradsafe.verify._torchtitan import build_stages

    stages, microbatches, _ = build_stages("llama3", "ZBVZeroBubble", 2)
    for stage in stages:
        for block in getattr(stage, "layers", nn.ModuleDict()).children() if backend else ():
            block.compile(backend=backend, fullgraph=True)  # torchtitan's apply_compile
    for policy in CheckpointedWeights:
        h: torch.Tensor = microbatches[0][0]
        pairs = []
        for i, stage in enumerate(stages):
            x = h.detach().requires_grad_() if i else h
            h = stage(x)
            pairs.append((x, h))
        for i in range(1, len(stages) - 1):
            x, out = pairs[i]
            params = list(stages[i].parameters())
            with checkpointed_weights(policy), MatmulFlops(forwards=True) as b:
                _, handoff = stage_backward_input(out, torch.ones_like(out), [x], params)
            with MatmulFlops(forwards=True) as w:
                stage_backward_weight(params, handoff)
            grads = b.total - b.in_forward + w.total
            print(
                f"  {label}{policy.name:<15} stage {i}: B {b.total / 1e6:.1f} MFLOP "
                f"(recomputation {b.in_forward / 1e6:.1f}), W {w.total / 1e6:.1f} MFLOP, "
                f"W share of backward {w.total / (b.total + w.total):.3f}, of gradients "
                f"{w.total / grads:.3f}"
            )


if __name__ == "__main__":
    main()
