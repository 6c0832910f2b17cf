"""Memory in real ScheduleZBVZeroBubble steps: gradsafe's B and W never hold more than torch's split.

2 gloo ranks (``_memory_zbv_worker.py``), 4 stages of Linear + tanh layers
(weight- and activation-dominated), 4 microbatches, 2 steps without zeroing the
gradients (``.grad`` None, then held), live storage counted with
:class:`gradsafe.testing.LiveStorage`: on each rank, the peak during every B
and W call and what is alive after it, after each step (losses kept), and the
peak of the steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _ranks import run_ranks

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.distributed

# gradsafe's helper nodes allocate a few scalars (anchors): bytes, not gradients.
_SLACK = 4096


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = tmp_path_factory.mktemp("memory_zbv")
    results = run_ranks(HERE / "_memory_zbv_worker.py", [], 2, out, "ZBV memory", 240)
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}: {res['crash']}"
    return results


@pytest.mark.parametrize("stage", ["weight-dominated", "activation-dominated"])
def test_zbv_step_holds_no_more_than_torchs_split_at_any_point(
    measured: list[dict[str, dict[tuple[str, str], dict[str, int]]]], stage: str
) -> None:
    over = {}
    for rank, result in enumerate(measured):
        theirs = result["points"][(stage, "torch")]
        ours = result["points"][(stage, "gradsafe")]
        assert ours.keys() == theirs.keys()  # the same calls, in the same order
        assert sum(name.startswith("after W") for name in ours) >= 4
        over.update(
            {
                (rank, name): (ours[name], theirs[name])
                for name in theirs
                if ours[name] > theirs[name] + _SLACK
            }
        )
    assert not over, f"bytes (gradsafe, torch's split) where gradsafe holds more: {over}"
