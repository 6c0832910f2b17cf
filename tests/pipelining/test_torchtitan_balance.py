"""torchtitan's own stages under gradsafe's default split: W carries the weight GEMMs.

Optional: skipped unless torchtitan is installed (the ``torchtitan`` test
extra, run in CI's torch 2.15 session). The stages are built as torchtitan
builds them for ZBV on 2 ranks (``gradsafe/verify/_torchtitan.py``): its
llama3 debugmodel with its default selective activation checkpointing. The
figure is docs/pipelining.md's (``benchmarks/pipelining_balance.py
--torchtitan``: W share 0.494 on each middle stage, 0.000 under ``IN_B``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="optional: the torchtitan test extra is not installed")

from gradsafe.pipelining import (  # noqa: E402
    CheckpointedWeights,
    checkpointed_weights,
    stage_backward_input,
    stage_backward_weight,
)
from gradsafe.testing import MatmulFlops  # noqa: E402
from gradsafe.verify._torchtitan import build_stages  # noqa: E402


def _w_shares(policy: CheckpointedWeights) -> list[float]:
    """W's share of each middle stage's weight-and-input matmul FLOPs, recomputation left out."""
    stages, microbatches, _ = build_stages("llama3", "ZBVZeroBubble", 2)
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
        shares.append(w.total / (b.total - b.in_forward + w.total))
    return shares


def test_torchtitans_selective_ac_middle_stages_leave_the_weight_gemms_to_w() -> None:
    shares = _w_shares(CheckpointedWeights.IN_W)
    assert shares and all(share >= 0.40 for share in shares), shares


def test_torchtitans_middle_stages_under_in_b_leave_w_nothing() -> None:
    # The 0.2.0 behaviour, still chosen explicitly: what the default above fixes.
    assert all(share == 0.0 for share in _w_shares(CheckpointedWeights.IN_B))
