"""Memory on FSDP2 and DDP stages: gradsafe's B and W never hold more live storage than a fair baseline.

2 gloo ranks (``_memory_dp_worker.py``): a middle stage of Linear + tanh layers
(weight- and activation-dominated) wrapped over both ranks with FSDP2 (really
sharded) or DDP, 3 microbatches, every B then every W and B/W per microbatch,
driven as ``stage.py`` drives it (DDP ``no_sync`` except the last microbatch;
FSDP2's flags; the stage's gradient reduction at the end). Live storage
counted with :class:`gradsafe.testing.LiveStorage` from the wrapping on, so
what the wrapper allocates counts in both runs (DDP's buckets, which only
gradsafe's W writes into: torch's W fires no parameter hooks, so DDP never
reduces its gradients, see docs/pipelining.md), and FSDP2's parameters at
their present size (it frees and re-gathers them by resizing storages).

FSDP2 with ``reshard_after_forward=False`` and DDP: gradsafe ≤ torch's split.
With ``reshard_after_forward=True`` torch's split computes wrong gradients (W is
handed sharded parameters the graph does not hold), so there the baselines are
torch's split on the same stage unresharded (the memory a torch user pays for
correct gradients) and a fused backward of the resharded stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def _points(measured: dict[str, Any], *case: str) -> dict[str, int]:
    return measured["points"][case]  # type: ignore[no-any-return]


@pytest.mark.parametrize("stage", ["weight-dominated", "activation-dominated"])
@pytest.mark.parametrize("order", ["every B, then every W", "B and W per microbatch"])
def test_resharded_fsdp_stage_holds_no_more_than_torchs_split_unresharded(
    measured: dict[str, Any], stage: str, order: str
) -> None:
    """``reshard_after_forward=True`` under gradsafe: ≤ torch's split on the stage unresharded.

    stage.py keeps the parameters unsharded from the first B's all-gather to the
    step's reduction (``set_reshard_after_backward(False)``), as the unresharded
    stage keeps them from its forward, so every point is bounded by torch's
    split there, except the first B's peak: its all-gather re-gathers what the
    forward freed, which any backward of the resharded stage pays at that point
    (bounded there by the larger of torch's split unresharded and a fused
    backward of the resharded stage).
    """
    ours = _points(measured, "fsdp resharded", stage, order, "gradsafe")
    unresharded = _points(measured, "fsdp", stage, order, "torch")
    fused = _points(measured, "fsdp resharded", stage, order, "fused")
    assert ours.keys() == unresharded.keys() == fused.keys()
    bound = dict(unresharded)
    bound["peak during B0"] = max(unresharded["peak during B0"], fused["peak during B0"])
    over = {name: (ours[name], bound[name]) for name in ours if ours[name] > bound[name] + _SLACK}
    assert not over, f"bytes (gradsafe resharded, bound) where gradsafe holds more: {over}"


def test_resharded_fsdp_stage_is_unsharded_from_the_first_b_to_the_reduction(
    measured: dict[str, Any],
) -> None:
    """What the bound above rests on, read from FSDP2's parameters: resharded after the
    forwards, gathered by the first B and kept so through every B and W (stage.py's
    ``set_reshard_after_backward(False)``), freed by the reduction; the unresharded stage
    holds them from its forwards. Both orders, every backward measured."""
    unsharded = measured["unsharded"]
    for case, gathered in unsharded.items():
        if not case[0].startswith("fsdp"):
            continue
        full = unsharded[("fsdp", *case[1:3], "torch")]["before B0"]
        expected = {point: full for point in gathered}
        expected["after the reduction"] = 0
        if case[0] == "fsdp resharded":
            expected["before B0"] = 0
        assert full > 0
        assert gathered == expected, case


def test_resharded_fsdp_stage_gradients_equal_a_fused_backward(measured: dict[str, Any]) -> None:
    """The resharded stage's gradients are right: equal to a fused backward's and to the unresharded stage's."""
    grads = measured["grads"]
    for case in (c[1:3] for c in grads if c[0] == "fsdp resharded" and c[3] == "gradsafe"):
        ours = grads[("fsdp resharded", *case, "gradsafe")]
        for reference in (("fsdp resharded", *case, "fused"), ("fsdp", *case, "torch")):
            for mine, theirs in zip(ours, grads[reference], strict=True):
                torch.testing.assert_close(mine, theirs, msg=str(reference))
