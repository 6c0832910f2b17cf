"""H2, written once: a Partial gradient through autograd's layout fix-up.

The reproduction is the seed report's: a Replicate DTensor parameter whose
local view is used transposed, with ``grad_placements=[Partial()]``, so its
gradient arrives Partial with strides that differ from the parameter's.
The doctor row, the tests and the benchmark all run it from here, with the
collective counter defined here.

The doctor row runs it in-process on torch's fake process group (2 ranks, no
communication) when no process group exists, and tears it down afterwards.
When the caller already has a process group it is left alone and only the
propagator probe runs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from gradsafe.checks import Outcome, patched_check
from gradsafe.dtensor._torch import TorchDispatchMode

__all__ = [
    "CHECKS",
    "CollectiveCounter",
    "SeedResult",
    "fake_world",
    "run_seed",
    "seed_backward",
    "seed_coefficients",
    "seed_parameter",
]


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """torch's in-process fake process group (rank 0 of ``world_size``); nothing communicates."""
    import torch.distributed as dist

    from gradsafe.dtensor._torch import clear_sharding_caches, fake_store

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # Cached decisions hold the fake mesh; do not keep them in the user's process.
        clear_sharding_caches()


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives by op name, like CommDebugMode, which needs numpy (not a torch dependency).

    ``counts`` maps ``"namespace.op"`` (e.g. ``"_c10d_functional.all_reduce"``)
    to how often it ran inside the ``with`` block; ``total`` sums them.
    """

    _NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")
    # Not wait_tensor or _wrap_tensor_autograd, which accompany a collective.
    _COLLECTIVES = (
        "all_reduce",
        "allreduce",
        "all_gather",
        "allgather",
        "reduce_scatter",
        "all_to_all",
        "alltoall",
        "broadcast",
    )

    def __init__(self) -> None:
        from torch.distributed.tensor import DTensor

        super().__init__()
        self._dtensor = DTensor
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._dtensor in types:
            # Let DTensor dispatch first, so the collectives it issues come back here.
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace in self._NAMESPACES and name.lstrip("_").startswith(self._COLLECTIVES):
            self.counts[f"{func.namespace}.{name}"] += 1
        return func(*args, **(kwargs or {}))


def seed_parameter(mesh: DeviceMesh, shape: tuple[int, int] = (3, 4)) -> torch.nn.Parameter:
    """A Replicate DTensor parameter of ones on the 1-D ``mesh``."""
    from torch.distributed.tensor import DTensor, Replicate

    local = torch.ones(shape, device=mesh.device_type)
    return torch.nn.Parameter(DTensor.from_local(local, mesh, [Replicate()]))


def seed_coefficients(shape: tuple[int, int] = (3, 4)) -> torch.Tensor:
    """Coefficients for :func:`seed_backward`; each rank's local gradient is their transpose."""
    rows, cols = shape
    return torch.arange(float(rows * cols), device="cpu").reshape(cols, rows)


def seed_backward(weight: torch.nn.Parameter, coeff: torch.Tensor) -> CollectiveCounter:
    """One backward of the seed pattern; returns the collectives it issued.

    The local view is used transposed (``.t().contiguous()``), so the Partial
    gradient arrives with strides that differ from the parameter's and
    AccumulateGrad takes its layout fix-up when ``.grad`` is None.
    """
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(weight, DTensor):
        raise TypeError(f"seed_backward needs a DTensor parameter, got {type(weight).__name__}")
    local = weight.to_local(grad_placements=[Partial()])
    with CollectiveCounter() as comm:
        (local.t().contiguous() * coeff.to(local.device)).sum().backward()
    return comm


@dataclasses.dataclass(frozen=True)
class SeedResult:
    """What one seed backward gave: ``.grad``'s placements, the collectives, and checks."""

    placements: tuple[object, ...]
    collectives: dict[str, int]
    values_right: bool  # the local gradient equals the coefficients' transpose
    strides_right: bool  # .grad has the parameter's strides (the layout contract)

    @property
    def hazard_free(self) -> bool:
        from torch.distributed.tensor import Partial

        return (
            self.placements == (Partial(),)
            and not self.collectives
            and self.values_right
            and self.strides_right
        )


def run_seed(mesh: DeviceMesh, shape: tuple[int, int] = (3, 4)) -> SeedResult:
    """The seed reproduction on ``mesh``, from a fresh parameter (``.grad`` None)."""
    from torch.distributed.tensor import DTensor

    weight = seed_parameter(mesh, shape)
    coeff = seed_coefficients(shape)
    comm = seed_backward(weight, coeff)
    grad = weight.grad
    if not isinstance(grad, DTensor) or not isinstance(weight, DTensor):
        raise TypeError(f"the seed backward left .grad as {type(grad).__name__}, not a DTensor")
    return SeedResult(
        placements=tuple(grad.placements),
        collectives=dict(comm.counts),
        values_right=torch.equal(grad.to_local().cpu(), coeff.t()),
        strides_right=grad.stride() == weight.stride()
        and grad.to_local().stride() == weight.to_local().stride(),
    )


def _backward_repro() -> Outcome:
    from torch.distributed.device_mesh import init_device_mesh

    found = run_seed(init_device_mesh("cpu", (2,)))
    detail = f"grad {list(found.placements)}, {sum(found.collectives.values())} collective(s) in backward"
    if not found.values_right:
        detail += ", local gradient values differ"
    if not found.strides_right:
        detail += ", .grad strides differ from the parameter's"
    return Outcome(found.hazard_free, detail)


def _seed_probe() -> Outcome:
    # The seed's two ops on its placements, asked of the live propagator: no
    # backward, so the caller's process group is neither used nor replaced.
    from torch.distributed.tensor import Partial

    from gradsafe.dtensor import _torch

    mesh = _torch.probe_mesh((2,))
    shape, partial = [3, 4], (Partial(),)
    empty, _ = _torch.probe_propagation(
        _torch.EMPTY_FACTORIES[0], mesh, shape, [partial], [shape, [1, 3]]
    )
    copy, communicates = _torch.probe_propagation(
        torch.ops.aten.copy_.default, mesh, shape, [empty, partial]
    )
    detail = (
        f"new_empty_strided {list(partial)} -> {list(empty)}, copy_ -> {list(copy)}"
        f"{' with a collective' if communicates else ''}"
    )
    return Outcome(
        empty == partial and not communicates,
        f"propagator probe only (a process group is already initialised): {detail}",
    )


def _repro() -> Outcome:
    import torch.distributed as dist

    if dist.is_initialized():
        return _seed_probe()
    with fake_world(2):
        return _backward_repro()


CHECKS = (
    patched_check(
        "H2 DTensor Partial grad all-reduced by layout fix-up", "dtensor", "dtensor", _repro
    ),
)
