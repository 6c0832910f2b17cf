"""torchtitan's own stages under gradsafe's default split: W carries the weight GEMMs.

Optional: skipped unless torchtitan is installed (the ``torchtitan`` test
extra, run in CI's torch 2.15 session). The stages are built as torchtitan
builds them for ZBV on 2 ranks (``gradsafe/verify/_torchtitan.py``): its
llama3 debugmodel with its default selective activation checkpointing. The
figure is docs/pipelining.md's (``benchmarks/pipelining_balance.py
--torchtitan``: W share 0.494 on each middle stage, 0.000 under ``IN_B``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("torchtitan", reason="optional: the torchtitan test extra is not installed")

import gradsafe  # noqa: E402
from gradsafe.pipelining import (  # noqa: E402
    CheckpointedWeights,
    checkpointed_weights,
    stage_backward_input,
    stage_backward_weight,
)
from gradsafe.testing import MatmulFlops  # noqa: E402
from gradsafe.verify._torchtitan import build_stages  # noqa: E402


def _w_shares(
    policy: CheckpointedWeights, compile_backend: str = "", recomputation: bool = False
) -> list[float]:
    """W's share of each middle stage's weight-and-input matmul FLOPs, recomputation left out
    (or, with ``recomputation``, counted in B where it runs: verify's ``w_share``).

    With ``compile_backend``, each transformer block is compiled in place over its AC wrapper
    as torchtitan's ``apply_compile`` does, under ``gradsafe.patch()``.
    """
    stages, microbatches, _ = build_stages("llama3", "ZBVZeroBubble", 2)
    if compile_backend:
        for stage in stages:
            for block in getattr(stage, "layers", {}).values():
                block.compile(backend=compile_backend, fullgraph=True)
    with gradsafe.patch() if compile_backend else contextlib.nullcontext():
        return _shares(stages, microbatches, policy, recomputation)


def _shares(
    stages: list[torch.nn.Module],
    microbatches: list[tuple[torch.Tensor]],
    policy: CheckpointedWeights,
    recomputation: bool,
) -> list[float]:
    h: torch.Tensor = microbatches[0][0]
    pairs = []
    for i, stage in enumerate(stages):
        x = h.detach().requires_grad_() if i else h
        h = stage(x)
        pairs.append((x, h))
    shares = []
    for i in range(1, len(stages) - 1):
        x, out = pairs[i]
        params = list(stages[i].parameters())
        with checkpointed_weights(policy), MatmulFlops(forwards=True) as b:
            _, handoff = stage_backward_input(out, torch.ones_like(out), [x], params)
        with MatmulFlops(forwards=True) as w:
            stage_backward_weight(params, handoff)
        b_flops = b.total if recomputation else b.total - b.in_forward
        shares.append(w.total / (b_flops + w.total))
    return shares


def test_torchtitans_selective_ac_middle_stages_leave_the_weight_gemms_to_w() -> None:
    shares = _w_shares(CheckpointedWeights.IN_W)
    assert shares and all(share >= 0.40 for share in shares), shares


def test_torchtitans_middle_stages_under_in_b_leave_w_nothing() -> None:
    # The 0.2.0 behaviour, still chosen explicitly: what the default above fixes.
    assert all(share == 0.0 for share in _w_shares(CheckpointedWeights.IN_B))


def test_torchtitans_compiled_middle_stages_leave_the_weight_gemms_to_w() -> None:
    # --compile.enable: each block compiled in place over its selective-AC wrapper. Under the
    # patch AOTAutograd's backward is split into dI (B) and dW (W); B also runs the compiled
    # graph's recomputation, counted here (verify's w_share). aot_eager: the split is
    # AOTAutograd's, whatever the backend, and it compiles fastest on CPU.
    shares = _w_shares(CheckpointedWeights.IN_W, compile_backend="aot_eager", recomputation=True)
    assert shares and all(share >= 0.40 for share in shares), shares
