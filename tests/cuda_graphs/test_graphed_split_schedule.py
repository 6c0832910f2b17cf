"""End to end: torch.distributed.pipelining zero-bubble schedules on 2 gloo ranks running graphed split stages.

Each rank graphs its two stages with make_graphed_split_callables (CUDA graphs
emulated on the CPU) in the order CaptureOrder derives from the schedule, and
gives PipelineStage the graphed modules with ``dw_builder=graphed.dw_builder(chunk)``.
The parameter gradients after the second step equal a single-process fused
backward (fp64, 1e-9), each post-accumulate hook fires once per microbatch
and step, and the schedule's own action list gives the order that was captured.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _ranks import run_ranks

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _graphed_split_schedule_worker as worker  # noqa: E402

pytestmark = pytest.mark.distributed


def _run(kind: str, tmp_path: Path) -> list[dict[str, object]]:
    return run_ranks(HERE / "_graphed_split_schedule_worker.py", [kind], 2, tmp_path, kind)


def _reference() -> dict[str, torch.Tensor]:
    modules = worker.build_stages()
    x, y = worker.batch(worker.STEPS - 1)
    for xm, ym in zip(x.chunk(worker.MICROBATCHES), y.chunk(worker.MICROBATCHES)):
        h = xm
        for m in modules:
            h = m(h)
        # The schedule averages over microbatches (scale_grads=True).
        (worker.loss_fn(h, ym) / worker.MICROBATCHES).backward()
    return {f"{i}.{n}": p.grad for i, m in enumerate(modules) for n, p in m.named_parameters()}


@pytest.mark.parametrize("kind", ["ZBV", "InterleavedZB"])
def test_schedule_on_graphed_split_stages_equals_single_process(kind: str, tmp_path: Path) -> None:
    results = _run(kind, tmp_path)
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}: {res['crash']}"
        assert res["order_matches"], f"rank {r}: the schedule runs another order than was captured"
        assert res["position"] == 0, f"rank {r}: a step ended partway through the order"
    want = _reference()
    got = {k: v for res in results for k, v in res["grads"].items()}  # type: ignore[union-attr]
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-9, rtol=1e-9, msg=key)
    hooks = {k: v for res in results for k, v in res["hooks"].items()}  # type: ignore[union-attr]
    assert hooks == {k: worker.MICROBATCHES * worker.STEPS for k in want}, hooks
