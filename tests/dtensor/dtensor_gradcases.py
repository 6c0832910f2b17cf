"""Gradient cases for the dtensor tests: one parameter, one gradient layout, one backward path.

Shared by the fake-process-group matrix (placements, collectives, strides)
and the gloo runs (values against a plain-tensor reference). A case builds a
DTensor parameter, takes its local view with ``to_local(grad_placements=...)``
and makes the local gradient equal to a known per-rank tensor in a chosen
memory layout, so the expected global gradient is known exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from gradsafe.dtensor._hazards import CollectiveCounter

LAYOUTS = ("contiguous", "transposed", "expanded", "channels_last")

# (name, mesh ndim, parameter placements, gradient placements)
PLACEMENTS: tuple[tuple[str, int, tuple[Placement, ...], tuple[Placement, ...]], ...] = (
    ("R>P(sum)", 1, (Replicate(),), (Partial("sum"),)),
    ("R>P(avg)", 1, (Replicate(),), (Partial("avg"),)),
    ("R>P(max)", 1, (Replicate(),), (Partial("max"),)),
    ("R>P(min)", 1, (Replicate(),), (Partial("min"),)),
    ("S0", 1, (Shard(0),), (Shard(0),)),
    ("S1", 1, (Shard(1),), (Shard(1),)),
    ("RR>PP(sum)", 2, (Replicate(), Replicate()), (Partial("sum"), Partial("sum"))),
    ("RR>PP(avg)", 2, (Replicate(), Replicate()), (Partial("avg"), Partial("avg"))),
    ("RR>PP(max)", 2, (Replicate(), Replicate()), (Partial("max"), Partial("max"))),
    ("S0S1", 2, (Shard(0), Shard(1)), (Shard(0), Shard(1))),
    ("S0R>S0P", 2, (Shard(0), Replicate()), (Shard(0), Partial("sum"))),
)


@dataclasses.dataclass(frozen=True)
class Case:
    placement: str
    layout: str
    existing_grad: bool
    hook_holds_ref: bool
    create_graph: bool

    @property
    def id(self) -> str:
        flags = [
            "grad-existing" if self.existing_grad else "grad-None",
            "hook" if self.hook_holds_ref else "nohook",
            "create_graph" if self.create_graph else "plain",
        ]
        return "-".join([self.placement, self.layout, *flags])

    @property
    def spec(self) -> tuple[int, tuple[Placement, ...], tuple[Placement, ...]]:
        for name, ndim, param, grad in PLACEMENTS:
            if name == self.placement:
                return ndim, param, grad
        raise KeyError(self.placement)


def all_cases() -> Iterator[Case]:
    for (name, *_), layout, existing, hook, create in itertools.product(
        PLACEMENTS, LAYOUTS, (False, True), (False, True), (False, True)
    ):
        yield Case(name, layout, existing, hook, create)


def kept_by(placements: tuple[Placement, ...]) -> bool:
    """Whether ``new_empty(_strided)`` keeps ``placements`` under gradsafe.patch("dtensor").

    Natively where upstream keeps placements (2.13+). Where the patch
    applies (2.11): Shard-containing placements and, for Replicate/Partial
    ones, every Partial reduce op the installed torch can accumulate into in
    place (2.11: sum, avg). Where the patch is skipped for another reason
    (2.10), gradsafe changes nothing: False.
    """
    from gradsafe.dtensor import _patch, probe_propagator
    from gradsafe.patching import Skip

    found = probe_propagator()
    if found.keeps_placements:
        return True
    if isinstance(_patch.plan(), Skip):
        return False
    if any(p.is_shard() for p in placements):
        return True
    return all(
        p.is_replicate() or getattr(p, "reduce_op", None) in found.accumulating_reduce_ops
        for p in placements
    )


def kept_by_gradsafe(case: Case) -> bool:
    """Whether the case's gradient placements survive the layout fix-up under the patch."""
    return kept_by(case.spec[2])


def global_shape(layout: str) -> tuple[int, ...]:
    return (4, 4, 2, 2) if layout == "channels_last" else (4, 8)


def local_coeff(case: Case, shape: torch.Size, rank: int, step: int) -> torch.Tensor:
    """The local gradient rank ``rank`` produces in backward ``step``, contiguous."""
    gen = torch.Generator().manual_seed(1000 * rank + 17 * step + len(case.id))
    if case.layout == "expanded":
        row = torch.randint(-4, 5, (shape[-1],), generator=gen).float()
        return row.expand(shape).contiguous()
    return torch.randint(-4, 5, tuple(shape), generator=gen).float()


def _loss(local: torch.Tensor, coeff: torch.Tensor, layout: str) -> torch.Tensor:
    # Each form makes d(loss)/d(local) == coeff, in the layout named.
    if layout == "contiguous":
        return (local * coeff).sum()
    if layout == "transposed":
        return (local * coeff.t().contiguous().t()).sum()
    if layout == "expanded":
        return (local.sum(0) * coeff[0]).sum()  # sum's backward expands: stride 0
    if layout == "channels_last":
        return (local * coeff.contiguous(memory_format=torch.channels_last)).sum()
    raise ValueError(layout)


@dataclasses.dataclass
class Outcome:
    placements: tuple[Placement, ...]
    collectives: int
    param_stride: tuple[int, ...]
    grad_stride: tuple[int, ...]
    param_local_stride: tuple[int, ...]
    grad_local_stride: tuple[int, ...]
    grad: DTensor


def run(case: Case, mesh: DeviceMesh) -> Outcome:
    """Run ``case``'s backward(s); collectives are counted in the last backward only."""
    _, param_pl, grad_pl = case.spec
    full = torch.zeros(global_shape(case.layout))
    weight = torch.nn.Parameter(DTensor.from_local(_local_of(full, mesh, param_pl), mesh, param_pl))
    held: list[torch.Tensor] = []
    if case.hook_holds_ref:
        weight.register_hook(lambda g: held.append(g))
    rank = dist.get_rank()
    steps = 2 if case.existing_grad else 1
    comm = CollectiveCounter()
    for step in range(steps):
        local = weight.to_local(grad_placements=grad_pl)
        coeff = local_coeff(case, local.shape, rank, step)
        loss = _loss(local, coeff, case.layout)
        if step == steps - 1:
            with comm:
                loss.backward(create_graph=case.create_graph)
        else:
            loss.backward(create_graph=case.create_graph)
    grad = weight.grad
    assert isinstance(grad, DTensor)
    local_grad = grad.to_local()
    return Outcome(
        placements=grad.placements,
        collectives=comm.total,
        param_stride=weight.stride(),
        grad_stride=grad.stride(),
        param_local_stride=weight.to_local().stride(),
        grad_local_stride=local_grad.stride(),
        grad=grad,
    )


def _local_of(
    full: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    coord: list[int] | None = None,
) -> torch.Tensor:
    """The shard of ``full`` held at mesh coordinate ``coord`` (default: this rank's)."""
    coord = coord if coord is not None else mesh.get_coordinate()
    assert coord is not None
    local = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            local = local.chunk(mesh.size(mesh_dim), dim=placement.dim)[coord[mesh_dim]]
    return local.contiguous()


def _combine(parts: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    if isinstance(placement, Shard):
        return torch.cat(parts, dim=placement.dim)
    if isinstance(placement, Partial):
        stacked = torch.stack(parts)
        reduce = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}
        return reduce[placement.reduce_op](stacked, dim=0)
    return parts[0]


def expected_global_grad(case: Case, mesh: DeviceMesh) -> torch.Tensor:
    """The gradient a plain (non-distributed) backward gives, from every rank's local one.

    Rebuilt without DTensor: per backward step, combine all ranks' local
    gradients mesh dimension by mesh dimension (last first): Shard
    concatenates, Partial reduces with its op; then sum the steps.
    """
    _, _, grad_pl = case.spec
    full = torch.zeros(global_shape(case.layout))
    grid = mesh.mesh
    total = torch.zeros_like(full)
    for step in range(2 if case.existing_grad else 1):
        pieces: dict[tuple[int, ...], torch.Tensor] = {}
        for coord in itertools.product(*(range(n) for n in grid.shape)):
            rank = int(grid[coord])
            shape = _local_of(full, mesh, grad_pl, list(coord)).shape
            pieces[coord] = local_coeff(case, shape, rank, step)
        for mesh_dim in reversed(range(grid.dim())):
            grouped: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
            for coord, piece in pieces.items():
                grouped.setdefault(coord[:mesh_dim], []).append((coord[mesh_dim], piece))
            pieces = {
                key: _combine([p for _, p in sorted(items, key=lambda i: i[0])], grad_pl[mesh_dim])
                for key, items in grouped.items()
            }
        total += pieces[()]
    return total
