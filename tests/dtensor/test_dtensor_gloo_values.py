"""End to end on real gloo ranks (127.0.0.1): gradient values, and FSDP2.

One launch per world size runs all its cases (torch import dominates the
cost); each case then reports as its own test.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from _ranks import start_forkserver
from dtensor_gloo_workers import value_cases, worker

pytestmark = pytest.mark.distributed

_DEADLINE_S = 180


def _launch(world_size: int, job: str, out_dir: Path) -> dict[str, tuple[bool, str]]:
    start_forkserver()  # ranks fork from a server that imported torch once (tests/_ranks.py)
    context = mp.start_processes(
        worker,
        args=(world_size, job, str(out_dir)),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + _DEADLINE_S
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"gloo job {job!r} on {world_size} ranks exceeded {_DEADLINE_S} s")
    merged: dict[str, tuple[bool, str]] = {}
    for rank in range(world_size):
        for row in json.loads((out_dir / f"rank{rank}.json").read_text()):
            ok, detail = merged.get(row["id"], (True, ""))
            merged[row["id"]] = (ok and row["ok"], detail or f"rank {rank}: {row['detail']}")
            if not row["ok"]:
                merged[row["id"]] = (False, f"rank {rank}: {row['detail']}")
    return merged


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[int, str], dict[str, tuple[bool, str]]]:
    found = {}
    for world_size, job in ((2, "values+fsdp"), (4, "values")):
        out_dir = tmp_path_factory.mktemp(f"gloo{world_size}{job}")
        found[(world_size, job)] = _launch(world_size, job, out_dir)
    return found


VALUE_IDS = [(2, c.id) for c in value_cases(2)] + [(4, c.id) for c in value_cases(4)]


@pytest.mark.parametrize(
    "world_size,case_id", VALUE_IDS, ids=[f"{w}ranks-{i}" for w, i in VALUE_IDS]
)
def test_values_match_plain_reference(results, world_size: int, case_id: str) -> None:
    job = "values+fsdp" if world_size == 2 else "values"
    ok, detail = results[(world_size, job)][case_id]
    assert ok, detail


@pytest.mark.parametrize(
    "check", ["fsdp2-collectives", "fsdp2-grad-0.weight", "fsdp2-grad-1.weight"]
)
def test_fully_shard_transposed_weight(results, check: str) -> None:
    ok, detail = results[(2, "values+fsdp")][check]
    assert ok, detail
    print(check, detail)
