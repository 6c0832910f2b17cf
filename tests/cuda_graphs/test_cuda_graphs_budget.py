"""The copy budget docs/cuda_graphs.md states for ownership="auto", case by case (issue 13, item 5).

The cases are the benchmark's (benchmarks/cuda_graphs_ownership.py), so the
table in the docs and this test count the same thing: clones in one
steady-state step of 4 microbatches, under emulate_cuda_graphs, with the
gradients compared against the same model run eagerly in fp64.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from gradsafe.testing import emulate_cuda_graphs

# benchmarks/ is not a package and not on sys.path under plain `pytest`: load by path.
_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_graphs_ownership.py"
_spec = importlib.util.spec_from_file_location("_cuda_graphs_ownership_bench", _BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses resolve their module by name
_spec.loader.exec_module(bench)
BUDGET_CASES, measure_case = bench.BUDGET_CASES, bench.measure_case

# (clones per step, parameter-sized bytes / parameter bytes, activation bytes) for "auto"
EXPECTED = {
    "plain, zero_grad(set_to_none=True)": (8, 1.0, 0),
    "plain, zero_grad(set_to_none=False)": (0, 0.0, 0),
    "Megatron-style hook clears .grad": (32, 4.0, 0),  # once per microbatch
    "tensor hook on every parameter, set_to_none=False": (32, 4.0, 0),
    "weight shared by 2 graphed callables, set_to_none=True": (4, 2 * 4096 / 4224 + 128 / 4224, 0),
    "weight shared by 2 graphed callables, set_to_none=False": (0, 0.0, 0),
    "input from an eager layer, set_to_none=False": (4, 0.0, 4 * 8 * 64 * 8),  # per microbatch
}


@pytest.mark.parametrize("case", BUDGET_CASES, ids=[c.name for c in BUDGET_CASES])
def test_auto_copy_budget(case) -> None:  # type: ignore[no-untyped-def]
    with emulate_cuda_graphs():
        counter, param_bytes, right = measure_case(case, "auto", torch.device("cpu"))
    clones, param_copies, other = EXPECTED[case.name]
    assert right
    assert counter.clones == clones
    assert counter.param_shaped_bytes / param_bytes == pytest.approx(param_copies)
    assert counter.bytes - counter.param_shaped_bytes == other
