"""The schedule simulator of benchmarks/pipelining_schedule.py (issue 29, item 4).

The benchmark's makespans are only as good as its simulator and the action orders it reads
from torch: these tests pin the simulator on cases a reader can check by hand, its refusal
of orders that cannot run, the extraction of torch's orders for every schedule it lists on
the installed torch, and the stage costs that do not depend on gradsafe's split policy.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

# benchmarks/ is not a package and not on sys.path under plain `pytest`: load by path.
_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "pipelining_schedule.py"
_spec = importlib.util.spec_from_file_location("_pipelining_schedule_bench", _BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses resolve their module by name
_spec.loader.exec_module(bench)
Op, ScheduleError, simulate, torch_order = (
    bench.Op,
    bench.ScheduleError,
    bench.simulate,
    bench.torch_order,
)


def textbook_1f1b(ranks: int, microbatches: int) -> dict[int, list]:
    """1F1B as in the papers: rank r runs ranks-1-r warm-up forwards, then F/B pairs, then Bs."""
    order = {}
    for r in range(ranks):
        warmup = min(ranks - 1 - r, microbatches)
        ops = [Op("F", r, m) for m in range(warmup)]
        for m in range(microbatches - warmup):
            ops += [Op("F", r, warmup + m), Op("B", r, m)]
        ops += [Op("B", r, m) for m in range(microbatches - warmup, microbatches)]
        order[r] = ops
    return order


@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (4, 4)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0)])
def test_1f1b_makespan_is_the_textbook_one(
    ranks: int, microbatches: int, f: float, b: float
) -> None:
    costs = {"F": f, "B": b, "I": 0.0, "W": 0.0}
    expected = (microbatches + ranks - 1) * (f + b)
    assert simulate(textbook_1f1b(ranks, microbatches), costs) == expected
    # torch's 1F1B that runs from its pipeline_order: the same step
    torch_1f1b = torch_order("ScheduleInterleaved1F1B", ranks, microbatches, 1)
    assert simulate(torch_1f1b, costs) == expected


def test_latency_is_paid_once_per_cross_rank_dependency() -> None:
    # one microbatch through 2 ranks: F0, F1, B1, B0; two hops between ranks
    order = {0: [Op("F", 0, 0), Op("B", 0, 0)], 1: [Op("F", 1, 0), Op("B", 1, 0)]}
    costs = {"F": 1.0, "B": 2.0, "I": 0.0, "W": 0.0}
    assert simulate(order, costs, latency=0.5) == 1 + 0.5 + 1 + 2 + 0.5 + 2


def test_a_w_placed_in_a_wait_shortens_the_step() -> None:
    costs = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    last = [
        Op("F", 1, 0),
        Op("I", 1, 0),
        Op("F", 1, 1),
        Op("I", 1, 1),
        Op("W", 1, 0),
        Op("W", 1, 1),
    ]
    # rank 1: F0 1-2, I0 2-3, F1 3-4, I1 4-5, W 5-7
    ws_last = [
        Op("F", 0, 0),
        Op("F", 0, 1),
        Op("I", 0, 0),
        Op("I", 0, 1),
        Op("W", 0, 0),
        Op("W", 0, 1),
    ]
    # rank 0: F 0-2, I0 3-4, (waits for rank 1's I1) I1 5-6, W 6-8
    assert simulate({0: ws_last, 1: last}, costs) == 8.0
    w_in_wait = [
        Op("F", 0, 0),
        Op("F", 0, 1),
        Op("I", 0, 0),
        Op("W", 0, 0),
        Op("I", 0, 1),
        Op("W", 0, 1),
    ]
    # rank 0: F 0-2, I0 3-4, W0 4-5 (while rank 1 runs I1), I1 5-6, W1 6-7
    assert simulate({0: w_in_wait, 1: last}, costs) == 7.0


@pytest.mark.parametrize("ranks", [2, 4])
def test_zbv_loses_its_bubbles_when_w_is_empty(ranks: int) -> None:
    microbatches = 8
    order = torch_order("ScheduleZBVZeroBubble", ranks, microbatches, 2)
    busy = 2 * microbatches * 3  # each rank: 2 stages x 8 microbatches x (F + I + W), unit costs
    balanced = simulate(order, {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0})
    # F = I = W: only the start-up wait of the last rank's first F (ranks - 1 forwards upstream)
    assert balanced == busy + ranks - 1
    # the same backward, all in I (W = 0): the bubbles W filled come back
    w_empty = simulate(order, {"F": 1.0, "I": 2.0, "W": 0.0, "B": 2.0})
    assert w_empty >= balanced + ranks - 1


def test_a_dependency_cycle_is_refused() -> None:
    # rank 1 runs its backward before the forward it needs, which rank 0 waits for
    order = {0: [Op("F", 0, 0), Op("B", 0, 0)], 1: [Op("B", 1, 0), Op("F", 1, 0)]}
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(order, {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0})


@pytest.mark.parametrize(
    "order,message",
    [
        ({0: [Op("F", 0, 0), Op("F", 0, 0), Op("B", 0, 0)]}, "appears twice"),
        ({0: [Op("B", 0, 0)]}, "waits for 0F0"),
        ({0: [Op("F", 0, 0), Op("I", 0, 0)]}, "has no W"),
        ({0: [Op("F", 0, 0), Op("W", 0, 0), Op("I", 0, 0)]}, "deadlocks"),
        ({0: [Op("F", 0, 0)], 1: [Op("F", 1, 0), Op("B", 1, 0)]}, "has no backward"),
    ],
    ids=["duplicate", "missing dependency", "I without W", "W before its I", "F without backward"],
)
def test_an_order_that_cannot_run_is_refused(order: dict, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        simulate(order, {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0})


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", list(bench.SCHEDULES))
def test_torch_orders_are_extracted_whole(schedule: str, ranks: int) -> None:
    class_name, per_rank = bench.SCHEDULES[schedule]
    microbatches = 8
    order = torch_order(class_name, ranks, microbatches, per_rank)
    assert sorted(order) == list(range(ranks))
    ops = [op for rank_ops in order.values() for op in rank_ops]
    every = [(s, m) for s in range(ranks * per_rank) for m in range(microbatches)]
    assert sorted((o.stage, o.microbatch) for o in ops if o.kind == "F") == every
    assert sorted((o.stage, o.microbatch) for o in ops if o.kind in ("B", "I")) == every
    for rank, rank_ops in order.items():
        assert len({op.stage for op in rank_ops}) == per_rank, rank
    # the simulator runs it (no dependency broken, every I has its W), no faster than the work
    busy = microbatches * per_rank * 3
    assert simulate(order, {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}) >= busy


def test_each_checkpointed_weights_policy_of_gradsafe_gives_a_column(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    policies = bench.split_policies()
    names = [f"gradsafe[{p.name}]" for p in bench.gradsafe_split.CheckpointedWeights]
    assert list(policies) == [*names, "torch", "fused"]
    monkeypatch.delattr(bench.gradsafe_split, "CheckpointedWeights")
    assert list(bench.split_policies()) == ["gradsafe", "torch", "fused"]


@pytest.mark.parametrize("mode", ["none", "full"])
def test_stage_costs_count_the_matmuls_of_the_mlp_stage(mode: str) -> None:
    d, tokens = 16, 8
    stage = bench.Stage(d, 2, mode)
    costs, _ = bench.measure_stage(stage, tokens, flops=True, reps=1)
    forward = 2 * 2 * (2 * tokens * d * 4 * d)  # 2 blocks x 2 Linears, d x 4d each
    assert costs.forward == forward
    # a backward is twice the forward's GEMMs; full checkpointing recomputes each block up
    # to its GELU (the down projection's output is not saved for backward): half a forward
    assert costs.fused == (2 * forward if mode == "none" else 2.5 * forward)
    assert costs.split["ideal"] == (costs.fused - forward, forward)
    if mode == "none":  # torch's split: the weight GEMMs in W, the input GEMMs in B
        assert costs.split["torch"] == (forward, forward)
