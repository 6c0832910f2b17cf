"""The dtensor doctor row (gradsafe.dtensor._hazards.CHECKS): right with gradsafe, and clean."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gradsafe.dtensor import probe_propagator
from gradsafe.dtensor._hazards import CHECKS


def test_row_is_right_with_gradsafe_and_leaves_no_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this pytest process")
    (check,) = CHECKS
    upstream, with_gradsafe = check.upstream(), check.gradsafe()
    assert with_gradsafe.correct is True, with_gradsafe.detail
    assert upstream.correct is probe_propagator().keeps_placements, upstream.detail
    assert "0 collective(s)" in with_gradsafe.detail
    assert not dist.is_initialized()


def test_row_leaves_an_existing_process_group_alone(fake_meshes) -> None:
    group = dist.group.WORLD
    (check,) = CHECKS
    outcome = check.gradsafe()
    assert dist.is_initialized() and dist.group.WORLD is group
    assert "propagator probe only" in outcome.detail
    assert outcome.correct is True, outcome.detail
