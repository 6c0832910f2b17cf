"""Ask the installed torch's sharding propagator what it does with the layout-contract ops.

The probe builds synthetic operator schemas on meshes that own no process
group and runs the propagator's uncached path on them, so it needs no
process group, never communicates, and leaves the caches alone. It answers
through whatever table the propagator consults first. It creates one small
CPU tensor per mesh (the rank grid, explicitly on the CPU) and no autograd
state, so it gives the same answer under ``torch.no_grad()``,
``torch.inference_mode()`` and ``with torch.device("meta")``. While
``gradsafe.patch("dtensor")`` is applied the propagator consults gradsafe's
strategy, so the probe then answers for it, not for upstream: ask it before.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import Partial, Placement, Shard

from gradsafe.dtensor import _torch

__all__ = ["ProbeFailure", "ProbeResult", "probe_propagator"]

_SHAPE = (4, 6)
_TRANSPOSED_STRIDE = (1, 4)  # a parameter's strides differing from the gradient's
_REDUCE_OPS = ("sum", "avg", "max", "min")

# (mesh shape, gradient placements) the layout contract meets in practice.
_CASES: tuple[tuple[tuple[int, ...], tuple[Placement, ...]], ...] = (
    ((2,), (Partial("sum"),)),
    ((2,), (Partial("avg"),)),
    ((2,), (Partial("max"),)),
    ((2,), (Shard(0),)),
    ((2, 2), (Shard(0), Partial("sum"))),
)


@dataclasses.dataclass(frozen=True)
class ProbeFailure:
    """One probe case where the propagator did not keep the input's placements."""

    op: str
    given: tuple[Placement, ...]
    got: tuple[Placement, ...]

    def __str__(self) -> str:
        return f"{self.op} {list(self.given)} -> {list(self.got)}"


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the propagator did on the probe cases.

    ``empty_failures`` lists the ``new_empty(_strided)`` cases whose output
    did not take the input's placements; ``copy_failures`` the cases where
    ``copy_`` of a Partial source into a Partial destination would
    redistribute.
    ``accumulating_reduce_ops`` are the reduce ops ``r`` for which an in-place
    ``add_`` of a ``Partial(r)`` tensor into a ``Partial(r)`` tensor keeps the
    destination's placements (AccumulateGrad's ``grad += new_grad``; any
    other outcome makes DTensor raise for the in-place op).
    """

    empty_failures: tuple[ProbeFailure, ...]
    copy_failures: tuple[ProbeFailure, ...]
    accumulating_reduce_ops: tuple[str, ...]

    @property
    def keeps_placements(self) -> bool:
        """Upstream already keeps placements through new_empty_strided + copy_."""
        return not self.empty_failures and not self.copy_failures


def probe_propagator() -> ProbeResult:
    """Run the probe cases through the live propagator (tens of milliseconds, no communication)."""
    aten = torch.ops.aten
    empty_failures: list[ProbeFailure] = []
    copy_failures: list[ProbeFailure] = []
    meshes = {shape: _torch.probe_mesh(shape) for shape, _ in _CASES}
    for mesh_shape, placements in _CASES:
        mesh = meshes[mesh_shape]
        for op in _torch.EMPTY_FACTORIES:
            extra: list[object] = [list(_SHAPE)]
            if op is _torch.EMPTY_FACTORIES[0]:
                extra.append(list(_TRANSPOSED_STRIDE))
            got, communicates = _torch.probe_propagation(op, mesh, _SHAPE, [placements], extra)
            if got != placements or communicates:
                empty_failures.append(ProbeFailure(str(op), placements, got))
        if any(p.is_partial() for p in placements):
            copy = aten.copy_.default
            got, communicates = _torch.probe_propagation(copy, mesh, _SHAPE, [placements] * 2)
            if got != placements or communicates:
                copy_failures.append(ProbeFailure(str(copy), placements, got))
    accumulating = []
    for reduce_op in _REDUCE_OPS:
        partial = (Partial(reduce_op),)
        got, _ = _torch.probe_propagation(aten.add_.Tensor, meshes[(2,)], _SHAPE, [partial] * 2)
        if got == partial:
            accumulating.append(reduce_op)
    return ProbeResult(tuple(empty_failures), tuple(copy_failures), tuple(accumulating))
