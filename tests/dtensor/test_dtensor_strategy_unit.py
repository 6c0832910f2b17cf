"""gradsafe's new_empty(_strided) rule and strategy, on synthetic schemas and the fake process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import applied
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
from torch.distributed.tensor.placement_types import _MaskPartial

import gradsafe
from gradsafe.dtensor import FollowRule, ProbeFailure, ProbeResult, _patch, _torch, probe_propagator
from gradsafe.dtensor._hazards import CollectiveCounter
from gradsafe.patching import MISSING, Skip

aten = torch.ops.aten
NEW_EMPTY_STRIDED, NEW_EMPTY = _torch.EMPTY_FACTORIES
ALL_REDUCE_OPS = frozenset({"sum", "avg", "max", "min"})


def _spec(mesh: DeviceMesh, placements, shape=(4, 8)) -> DTensorSpec:  # type: ignore[no-untyped-def]
    stride = torch.empty(shape).stride()
    return DTensorSpec(
        mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, torch.float32)
    )


def _chosen(rule: FollowRule, op, spec: DTensorSpec, shape) -> tuple[object, ...]:  # type: ignore[no-untyped-def]
    """Output placements of gradsafe's strategy for ``op(spec, shape[, strides])``."""
    args: tuple[object, ...] = (OpStrategy([OpSpec(spec)]), list(shape))
    if op is NEW_EMPTY_STRIDED:
        args += (list(torch.empty(shape).t().stride()) if len(shape) == 2 else [1] * len(shape),)
    strategy = _torch.EmptyFactoryStrategy(rule)(OpSchema(op, args, {}))
    assert len(strategy.strategies) == 1
    return strategy.strategies[0].output_spec.placements


def _needing_the_patch(accumulating: tuple[str, ...]) -> ProbeResult:
    """The live probe's result, as if upstream did not keep Partial(sum) through new_empty."""
    failure = ProbeFailure("aten.new_empty.default", (Partial("sum"),), (Replicate(),))
    return dataclasses.replace(
        probe_propagator(), empty_failures=(failure,), accumulating_reduce_ops=accumulating
    )


EVERYTHING = FollowRule(ALL_REDUCE_OPS, uneven_strided=True)
LINEAR_ONLY = FollowRule(frozenset({"sum", "avg"}), uneven_strided=False)

KEPT = [
    [Partial("sum")],
    [Partial("avg")],
    [Partial("max")],
    [Partial("min")],
    [Shard(0)],
    [Shard(1)],
    [Replicate()],
    [Shard(0), Partial("sum")],
    [Partial("max"), Shard(1)],
    [Partial("avg"), Partial("avg")],
    [Shard(0), Shard(1)],
]


@pytest.mark.parametrize("op", _torch.EMPTY_FACTORIES, ids=str)
@pytest.mark.parametrize("placements", KEPT, ids=str)
def test_same_shape_keeps_placements(op, placements) -> None:  # type: ignore[no-untyped-def]
    spec = _spec(_torch.probe_mesh([2] * len(placements)), placements)
    assert _chosen(EVERYTHING, op, spec, (4, 8)) == tuple(placements)


@pytest.mark.parametrize("op", _torch.EMPTY_FACTORIES, ids=str)
@pytest.mark.parametrize("placements", KEPT, ids=str)
def test_other_shape_is_replicate(op, placements) -> None:  # type: ignore[no-untyped-def]
    spec = _spec(_torch.probe_mesh([2] * len(placements)), placements)
    assert _chosen(EVERYTHING, op, spec, (8, 4)) == (Replicate(),) * len(placements)


@pytest.mark.parametrize(
    "placements,kept",
    [
        ([Partial("max")], False),
        ([Partial("min")], False),
        ([Partial("sum")], True),
        ([Partial("avg"), Partial("sum")], True),
        ([Partial("sum"), Partial("max")], False),
        # A sharded input keeps everything, as torch 2.11 itself does.
        ([Shard(0), Partial("max")], True),
    ],
    ids=str,
)
def test_reduce_ops_not_accumulable_are_replicate(placements, kept: bool) -> None:  # type: ignore[no-untyped-def]
    spec = _spec(_torch.probe_mesh([2] * len(placements)), placements)
    want = tuple(placements) if kept else (Replicate(),) * len(placements)
    assert _chosen(LINEAR_ONLY, NEW_EMPTY, spec, (4, 8)) == want


def test_partial_subclasses_are_not_kept() -> None:
    spec = _spec(_torch.probe_mesh((2,)), [_MaskPartial()])
    assert _chosen(EVERYTHING, NEW_EMPTY, spec, (4, 8)) == (Replicate(),)


@pytest.mark.parametrize("op", _torch.EMPTY_FACTORIES, ids=str)
@pytest.mark.parametrize("uneven_strided", [False, True])
def test_uneven_shard(op, uneven_strided: bool) -> None:  # type: ignore[no-untyped-def]
    """Uneven shards are kept unless local strides would be derived by division (older torch)."""
    spec = _spec(_torch.probe_mesh((3,)), [Shard(1)])
    rule = FollowRule(ALL_REDUCE_OPS, uneven_strided)
    kept = op is NEW_EMPTY or uneven_strided
    assert _chosen(rule, op, spec, (4, 8)) == ((Shard(1),) if kept else (Replicate(),))


def test_strategy_outside_propagation_names_the_cause() -> None:
    with pytest.raises(TypeError, match="outside DTensor sharding propagation"):
        _torch.EmptyFactoryStrategy(EVERYTHING)(OpSchema(NEW_EMPTY, (torch.empty(2), [2]), {}))


def test_plan_follows_the_probed_accumulation() -> None:
    """The installed rule keeps exactly the reduce ops the installed torch accumulates into."""
    found = _needing_the_patch(probe_propagator().accumulating_reduce_ops)
    plan = _patch.plan_for(found)
    assert not isinstance(plan, Skip)
    strategies = {
        t.replacement for t in plan if isinstance(t.replacement, _torch.EmptyFactoryStrategy)
    }
    assert strategies == {
        _torch.EmptyFactoryStrategy(
            FollowRule(
                frozenset(found.accumulating_reduce_ops), _torch.LOCAL_STRIDES_FOLLOW_LOCAL_SHAPE
            )
        )
    }


def test_initialised_factories_keep_upstream_strategy(prefix_strategy) -> None:
    table = _torch.op_strategy_table()
    single = _torch.single_dim_strategy_table() or {}
    ops = (aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
    before = [(table.get(op), single.get(op)) for op in ops]
    with applied(_patch.plan_for(probe_propagator())):
        assert [(table.get(op), single.get(op)) for op in ops] == before


def test_after_change_clears_python_and_native_caches(fake_meshes) -> None:
    from torch.distributed.tensor.debug import _get_fast_path_sharding_prop_cache_stats as native

    x = DTensor.from_local(torch.ones(4), fake_meshes[1], [Replicate()])
    x + x
    hits, misses = native()
    x + x
    assert native() == (hits + 1, misses)  # cached
    _patch.after_change()
    x + x
    assert native() == (0, 1)  # the clear also resets the counters; one miss: recomputed
    python_cache = _torch._propagator().propagate_op_sharding
    python_cache(OpSchema(aten.add.Tensor, (x._spec, x._spec), {}))
    assert python_cache.cache_info().currsize > 0
    _patch.after_change()
    assert python_cache.cache_info().currsize == 0


@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("op", _torch.EMPTY_FACTORIES, ids=str)
def test_fresh_partial_destination_copy_does_not_communicate(
    fake_meshes, prefix_strategy, op, reduce_op
) -> None:  # type: ignore[no-untyped-def]
    """With every reduce op kept, copy_ of a Partial source into the fresh tensor is local."""
    grad = DTensor.from_local(torch.randn(8, 4).t(), fake_meshes[1], [Partial(reduce_op)])
    plan = _patch.plan_for(_needing_the_patch(tuple(ALL_REDUCE_OPS)))
    with applied(plan), CollectiveCounter() as comm:
        fresh = (
            grad.new_empty_strided((4, 8), (8, 1))
            if op is NEW_EMPTY_STRIDED
            else grad.new_empty((4, 8))
        )
        fresh.copy_(grad)
    assert comm.total == 0
    assert fresh.placements == (Partial(reduce_op),)
    assert torch.equal(fresh.to_local(), grad.to_local())


def test_new_zeros_of_partial_stays_replicate(fake_meshes) -> None:
    grad = DTensor.from_local(torch.ones(4, 8), fake_meshes[1], [Partial()])
    with gradsafe.patch("dtensor"):
        zeros = grad.new_zeros((4, 8))
    assert zeros.placements == (Replicate(),)


def test_patch_skips_when_copy_would_communicate(prefix_strategy) -> None:
    """If copy_ itself all-reduced Partial into Partial, gradsafe says it cannot help."""

    def replicate_copy(op_schema: OpSchema) -> OpStrategy:
        dst, src = op_schema.args_schema[0], op_schema.args_schema[1]
        replicate = DTensorSpec(dst.mesh, (Replicate(),) * dst.mesh.ndim)
        cost = [[1.0] * len(dst.strategies), [1.0] * len(src.strategies)]
        return OpStrategy(
            [OpSpec(replicate, input_specs=(replicate, replicate), redistribute_cost=cost)]
        )

    copy = aten.copy_.default
    table, single = _torch.op_strategy_table(), _torch.single_dim_strategy_table()
    saved = table.get(copy, MISSING), (single or {}).get(copy, MISSING)
    table[copy] = replicate_copy
    if single is not None:
        single.pop(copy, None)
    try:
        plan = _patch.plan_for(probe_propagator())
    finally:
        for where, value in zip((table, single), saved):
            if where is not None:
                if value is MISSING:
                    where.pop(copy, None)
                else:
                    where[copy] = value
    assert isinstance(plan, Skip)
    assert "copy_" in plan.reason and "Partial" in plan.reason
