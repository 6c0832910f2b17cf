"""FSDP2: B and W find the parameters autograd saw, whichever of sharded/unsharded the caller passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ranks import free_port, worker_env

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.distributed


def test_sharded_in_b_unsharded_in_w_exact_and_stray_parameter_named(tmp_path: Path) -> None:
    out = tmp_path / "found.pt"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_pipelining_fsdp_worker.py"), str(free_port()), str(out)],
        env=worker_env(),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-3000:]
    found = torch.load(out, weights_only=False)
    assert found["B sees"] == "DTensor" and found["W sees"] != "DTensor", found
    assert found["max error"] < 1e-12, found
    assert "leaf tensor" not in found["stray"] and "parameter of shape (4, 4)" in found["stray"], (
        found
    )
    # A forward between B and W reshards: W refuses instead of reading freed memory.
    assert "storage has been freed since B" in found["resharded before W"], found
