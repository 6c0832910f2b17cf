"""``verify(work=True)`` on stages holding ``torch.compile``'d blocks: where B ran a compiled
region's backward whole (compiled without gradsafe's split), the report says so per stage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _factories import _batches
from torch import nn

import gradsafe
from gradsafe.verify import verify
from gradsafe.verify._report import VerifyReport, WorkShare

ORDER = "w-after-b"


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()  # each test compiles its blocks afresh, with or without the patch
    yield
    torch._dynamo.reset()


def _stage() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(2)]
    return nn.Sequential(*(torch.compile(b, backend="aot_eager") for b in blocks))


def _ours(report: VerifyReport) -> WorkShare:
    assert report.work is not None
    (share,) = report.work["gradsafe"][ORDER]
    return share


def test_a_stage_whose_compiled_blocks_b_ran_whole_is_named_in_the_work_report() -> None:
    report = verify(_stage(), _batches(), orders=(ORDER,), work=True)
    ours = _ours(report)
    assert report.ok, str(report)  # exact: the regions ran whole in B
    assert ours.w_flops == 0 and ours.unsplit_compiled == 1  # two blocks, one compiled graph
    assert "stage 0: 1 torch.compile'd region(s) ran their backward whole in B" in str(report)


def test_a_stage_whose_compiled_blocks_compiled_under_the_patch_splits_them() -> None:
    with gradsafe.patch("pipelining"):
        report = verify(_stage(), _batches(), orders=(ORDER,), work=True)
    ours = _ours(report)
    assert report.ok, str(report)
    assert ours.unsplit_compiled == 0 and ours.w_share is not None and ours.w_share >= 0.4
    assert "ran their backward whole in B" not in str(report)
