"""A delayed weight gradient under FSDP2: W comes after FSDP2 reduce-scattered and freed the
unsharded parameter, so the store refuses instead of losing the gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
from _ranks import run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_fsdp2_delayed_worker.py")


def test_w_refuses_a_parameter_fsdp2_freed_after_b(tmp_path: Path) -> None:
    for result in run_ranks(WORKER, [], 2, tmp_path, "FSDP2 with a delayed weight gradient"):
        assert "crash" not in result, result
        # Before the refusal, W wrote into the freed unsharded parameter's .grad and the
        # sharded parameter's gradient stayed None: the weight missed the step.
        assert result["grad_is_none"], result
        assert "storage freed since B" in str(result["error"]), result
        assert "FSDP2" in str(result["error"]) and "delay_wgrad_compute" in str(result["error"])
