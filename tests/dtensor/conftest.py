"""Fixtures for the dtensor tests: a fake process group, and a pre-fix strategy.

The pre-fix strategy is written from the hazard's description (new_empty /
new_empty_strided give Replicate unless the input is sharded and the shape is
unchanged), so the hazard can be reproduced on any torch. ``applied`` installs
gradsafe's targets for a given probe result by hand: ``gradsafe.patch`` plans
once per process from the real propagator, so under the fixture it would
(rightly) still skip on torch that keeps placements.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.placement_types import Partial, Replicate

from gradsafe.dtensor import _patch, _torch
from gradsafe.dtensor._hazards import fake_world
from gradsafe.patching import MISSING, Skip, Target


@pytest.fixture(scope="session", autouse=True)
def _plan_before_any_fixture() -> None:
    """gradsafe plans once per process; make that happen on the unmodified propagator.

    Also runs the first sharding propagation on the main thread: on torch
    2.11 CUDA builds without a GPU, a first propagation on another thread
    makes the main thread's next DTensor op segfault (torch's bug).
    """
    _patch.plan()


@pytest.fixture(scope="module")
def fake_meshes() -> Iterator[dict[int, DeviceMesh]]:
    """A 4-rank fake process group (rank 0) with a 1-D (4,) and a 2-D (2, 2) mesh."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this pytest process")
    with fake_world(4):
        yield {1: init_device_mesh("cpu", (4,)), 2: init_device_mesh("cpu", (2, 2))}


@contextlib.contextmanager
def applied(plan: Sequence[Target] | Skip) -> Iterator[None]:
    """Install ``plan``'s targets (as gradsafe.patch would) and restore them on exit."""
    if isinstance(plan, Skip):
        raise AssertionError(f"expected targets, got a skip: {plan.reason}")
    saved = [(target, target.read()) for target in plan]
    for target in plan:
        target.write(target.replacement)
    _patch.after_change()
    try:
        yield
    finally:
        for target, original in reversed(saved):
            target.write(original)
        _patch.after_change()


def prefix_op_strategy(op_schema: OpSchema) -> OpStrategy:
    """Pre-fix behaviour: Replicate, or follow the input only when it is sharded."""
    input_strategy = op_schema.args_schema[0]
    assert isinstance(input_strategy, OpStrategy)
    mesh = input_strategy.mesh
    same_shape = tuple(input_strategy.shape) == tuple(op_schema.args_schema[1])  # type: ignore[arg-type]
    choices = []
    for candidate in input_strategy.strategies:
        spec = candidate.output_spec
        follow = same_shape and spec.is_sharded()
        out = spec.placements if follow else (Replicate(),) * mesh.ndim
        choices.append(
            OpSpec(
                output_specs=DTensorSpec(mesh, out),
                input_specs=(spec,),
                redistribute_cost=[generate_redistribute_costs(input_strategy, spec)],
            )
        )
    return OpStrategy(choices)


def prefix_single_dim_strategy(op, args_schema, kwargs_schema):  # type: ignore[no-untyped-def]
    """Pre-fix behaviour in single-dim form: [output, input] placement pairs per mesh dim."""
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    meta, shape = args_schema[0], args_schema[1]
    same_shape = tuple(meta.shape) == tuple(shape)
    pairs: list[list[object]] = []
    for dim in range(len(meta.shape)):
        out = _ShardingPlaceholder(dim) if same_shape else Replicate()
        pairs.append([out, _ShardingPlaceholder(dim)])
    for reduce_op in ("sum", "avg", "max", "min"):
        pairs.append([Replicate(), Partial(reduce_op)])
    return pairs


def _set(table: dict, key: object, value: object) -> None:
    if value is MISSING:
        table.pop(key, None)
    else:
        table[key] = value


@dataclasses.dataclass(frozen=True)
class PrefixInstall:
    """Which pre-fix form is installed, and the entries it put in each table.

    ``op_strategy`` follows any sharded input (even [Shard, Partial]);
    ``single_dim`` decides per mesh dimension, so a Partial dimension is
    Replicate even next to a Shard one.
    """

    kind: str
    op_strategy: dict[object, object]
    single_dim: dict[object, object]


@pytest.fixture(params=["op_strategy", "single_dim"])
def prefix_strategy(request: pytest.FixtureRequest) -> Iterator[PrefixInstall]:
    """Install the pre-fix strategy in one of the propagator's tables; restore on exit."""
    op_table = _torch.op_strategy_table()
    single = _torch.single_dim_strategy_table()
    installed: dict[str, dict[object, object]] = {"op_strategy": {}, "single_dim": {}}
    if request.param == "op_strategy":
        for op in _torch.EMPTY_FACTORIES:
            installed["op_strategy"][op] = prefix_op_strategy
            installed["single_dim"][op] = MISSING  # a single-dim entry would win
    else:
        if single is None:
            pytest.skip("this torch has no single-dim strategy table")
        from torch.distributed.tensor._ops.single_dim_strategy import _SingleDimStrategyInfo

        for op in _torch.EMPTY_FACTORIES:
            installed["single_dim"][op] = _SingleDimStrategyInfo(prefix_single_dim_strategy)
    saved = {
        "op_strategy": {op: op_table.get(op, MISSING) for op in _torch.EMPTY_FACTORIES},
        "single_dim": {
            op: (single.get(op, MISSING) if single is not None else MISSING)
            for op in _torch.EMPTY_FACTORIES
        },
    }
    for op, value in installed["op_strategy"].items():
        _set(op_table, op, value)  # type: ignore[arg-type]
    if single is not None:
        for op, value in installed["single_dim"].items():
            _set(single, op, value)  # type: ignore[arg-type]
    _torch.clear_sharding_caches()
    try:
        yield PrefixInstall(request.param, installed["op_strategy"], installed["single_dim"])
    finally:
        for op, value in saved["op_strategy"].items():
            _set(op_table, op, value)  # type: ignore[arg-type]
        if single is not None:
            for op, value in saved["single_dim"].items():
                _set(single, op, value)  # type: ignore[arg-type]
        _torch.clear_sharding_caches()
