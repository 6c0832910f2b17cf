"""Memory on FSDP2 and DDP stages: gradsafe's B and W never hold more live storage than torch's split.

2 gloo ranks (``_memory_dp_worker.py``): a middle stage of Linear + tanh layers
(weight- and activation-dominated) wrapped over both ranks with FSDP2 (really
sharded, ``reshard_after_forward=False`` so that torch's split computes every
gradient) or DDP, 3 microbatches, every B then every W and B/W per
microbatch, driven as ``stage.py`` drives it (DDP ``no_sync`` except the last
microbatch; FSDP2's flags; the stage's gradient reduction at the end). Live
storage counted with :class:`gradsafe.testing.LiveStorage` from the wrapping
on, so what the wrapper allocates counts in both runs (DDP's buckets, which
only gradsafe's W writes into: torch's W fires no parameter hooks, so DDP
never reduces its gradients, see docs/pipelining.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _ranks import run_ranks

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.distributed

# gradsafe's helper nodes allocate a few scalars (anchors): bytes, not gradients.
_SLACK = 4096


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("memory_dp")
    results = run_ranks(HERE / "_memory_dp_worker.py", [], 2, out, "FSDP2/DDP memory", 240)
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}: {res['crash']}"
    return results[0]


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_dp_stage_holds_no_more_than_torchs_split_at_any_point(
    measured: dict[str, dict[tuple[str, ...], dict[str, int]]], wrapper: str
) -> None:
    points = measured["points"]
    cases = [case[:3] for case in points if case[0] == wrapper and case[3] == "torch"]
    assert len(cases) == 4, list(points)
    over = {}
    for case in cases:
        theirs, ours = points[(*case, "torch")], points[(*case, "gradsafe")]
        assert ours.keys() == theirs.keys()
        over.update(
            {
                (case[1], case[2], name): (ours[name], theirs[name])
                for name in theirs
                if ours[name] > theirs[name] + _SLACK
            }
        )
    assert not over, f"bytes (gradsafe, torch's split) where gradsafe holds more: {over}"


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_dp_stage_gradients_equal_torchs_split(
    measured: dict[str, dict[tuple[str, ...], list[torch.Tensor]]], wrapper: str
) -> None:
    """The comparison above is like for like: torch's split computes the same gradients here."""
    grads = measured["grads"]
    for case in (c[:3] for c in grads if c[0] == wrapper and c[3] == "torch"):
        for ours, theirs in zip(grads[(*case, "gradsafe")], grads[(*case, "torch")]):
            torch.testing.assert_close(ours, theirs, msg=str(case))
