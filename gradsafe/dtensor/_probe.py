"""Ask the installed torch's sharding propagator what it does with the layout-contract ops.

The probe builds synthetic operator schemas on a :class:`DeviceMesh` created
without process groups and runs the propagator's uncached path on them, so
it needs no process group, never communicates, and leaves the caches alone.
It answers through whatever table the propagator consults first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

import torch
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Partial, Placement, Shard

from gradsafe.dtensor import _torch

__all__ = ["ProbeResult", "probe_propagator"]

_SHAPE = (4, 6)
_TRANSPOSED_STRIDE = (1, 4)  # a parameter's strides differing from the gradient's

# (mesh shape, gradient placements) the layout contract meets in practice.
_CASES: tuple[tuple[tuple[int, ...], tuple[Placement, ...]], ...] = (
    ((2,), (Partial("sum"),)),
    ((2,), (Partial("avg"),)),
    ((2,), (Partial("max"),)),
    ((2,), (Shard(0),)),
    ((2, 2), (Shard(0), Partial("sum"))),
)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the propagator did on the probe cases.

    ``empty_failures`` lists the ``new_empty(_strided)`` cases whose output
    did not take the input's placements; ``copy_failures`` the cases where
    ``copy_`` of a Partial source into a Partial destination would
    redistribute. Each entry reads ``"op [input placements] -> [output]"``.
    """

    empty_failures: tuple[str, ...]
    copy_failures: tuple[str, ...]

    @property
    def keeps_placements(self) -> bool:
        """Upstream already keeps placements through new_empty_strided + copy_."""
        return not self.empty_failures and not self.copy_failures


def _mesh(shape: Sequence[int]) -> DeviceMesh:
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(tuple(shape))
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)


def _spec(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensorSpec:
    meta = TensorMeta(torch.Size(_SHAPE), (_SHAPE[1], 1), torch.float32)
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def _propagate(op: OpOverload, args: tuple[object, ...]) -> tuple[tuple[Placement, ...], bool]:
    schema = OpSchema(op, args, {}, schema_info=_torch.schema_info(op))
    sharding = _torch.propagator().propagate_op_sharding_non_cached(schema)
    spec = cast(DTensorSpec, sharding.output_spec)  # the probed ops return one tensor
    # A redistribution only because shape arguments were localised is no communication.
    communicates = sharding.needs_redistribute and not sharding.use_val_from_redistribute_schema
    return spec.placements, communicates


def _describe(op: OpOverload, given: tuple[Placement, ...], got: tuple[Placement, ...]) -> str:
    return f"{op} {list(given)} -> {list(got)}"


def probe_propagator() -> ProbeResult:
    """Run the probe cases through the live propagator (tens of milliseconds, no communication)."""
    empty_failures: list[str] = []
    copy_failures: list[str] = []
    for mesh_shape, placements in _CASES:
        spec = _spec(_mesh(mesh_shape), placements)
        for op in _torch.EMPTY_FACTORIES:
            args: tuple[object, ...] = (spec, list(_SHAPE))
            if op is _torch.EMPTY_FACTORIES[0]:
                args += (list(_TRANSPOSED_STRIDE),)
            got, communicates = _propagate(op, args)
            if got != placements or communicates:
                empty_failures.append(_describe(op, placements, got))
        if any(p.is_partial() for p in placements):
            got, communicates = _propagate(torch.ops.aten.copy_.default, (spec, spec))
            if got != placements or communicates:
                copy_failures.append(_describe(torch.ops.aten.copy_.default, placements, got))
    return ProbeResult(tuple(empty_failures), tuple(copy_failures))
