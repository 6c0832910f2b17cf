"""The ``gradsafe doctor`` row for dtensor: right with gradsafe, fast, and clean."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from gradsafe.doctor import run
from gradsafe.dtensor import probe_propagator


def test_row_is_right_with_gradsafe_and_leaves_no_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this pytest process")
    start = time.perf_counter()
    report = run(["dtensor"])
    elapsed = time.perf_counter() - start
    (row,) = report.rows
    assert row.gradsafe.correct is True, row.gradsafe.detail
    assert row.upstream.correct is probe_propagator().keeps_placements, row.upstream.detail
    assert "0 collective(s)" in row.gradsafe.detail
    assert not dist.is_initialized()
    assert elapsed < 5.0, f"doctor row took {elapsed:.1f} s"


def test_row_leaves_an_existing_process_group_alone(fake_meshes) -> None:
    group = dist.group.WORLD
    (row,) = run(["dtensor"]).rows
    assert dist.is_initialized() and dist.group.WORLD is group
    assert "propagator probe only" in row.gradsafe.detail
    assert row.gradsafe.correct is True, row.gradsafe.detail
