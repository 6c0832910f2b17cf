"""Doctor row for ``dtensor``: a Partial gradient through autograd's layout fix-up.

The reproduction is the seed report's: a Replicate DTensor parameter whose
local view is used transposed, with ``grad_placements=[Partial()]``. It runs
in-process on torch's fake process group (2 ranks, no communication) when no
process group exists, and tears it down afterwards. When the caller already
has a process group it is left alone and only the propagator probe runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

from torch.utils._python_dispatch import TorchDispatchMode

from gradsafe.doctor import Outcome, patched_check

__all__ = ["CHECKS"]


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gradsafe.dtensor._torch import clear_sharding_caches

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # Cached decisions hold the fake mesh; do not keep them in the user's process.
        clear_sharding_caches()


class _CollectiveCounter(TorchDispatchMode):
    """Counts collectives, like CommDebugMode, which needs numpy (not a torch dependency)."""

    _NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")
    # Not wait_tensor or _wrap_tensor_autograd, which accompany a collective.
    _COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                    "all_to_all", "alltoall", "broadcast")

    def __init__(self) -> None:
        from torch.distributed.tensor import DTensor

        super().__init__()
        self._dtensor = DTensor
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if self._dtensor in types:
            # Let DTensor dispatch first, so the collectives it issues come back here.
            return NotImplemented
        name = func.__name__.split(".")[0].lstrip("_")
        if func.namespace in self._NAMESPACES and name.startswith(self._COLLECTIVES):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_repro() -> Outcome:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (2,))
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(3, 4), mesh, [Replicate()]))
    local = cast(DTensor, weight).to_local(grad_placements=[Partial()])
    with _CollectiveCounter() as comm:
        (local.t().contiguous() * torch.arange(12.0).reshape(4, 3)).sum().backward()
    grad = weight.grad
    if not isinstance(grad, DTensor):
        return Outcome(False, f"grad is {type(grad).__name__}, not a DTensor")
    collectives = comm.count
    values_ok = torch.equal(grad.to_local(), torch.arange(12.0).reshape(4, 3).t())
    detail = f"grad {list(grad.placements)}, {collectives} collective(s) in backward"
    if not values_ok:
        detail += ", local gradient values differ"
    right = grad.placements == (Partial(),) and collectives == 0 and values_ok
    return Outcome(right, detail)


def _repro() -> Outcome:
    import torch.distributed as dist

    if not dist.is_available():
        return Outcome(None, "torch.distributed is not built into this torch")
    if dist.is_initialized():
        from gradsafe.dtensor._probe import probe_propagator

        found = probe_propagator()
        failures = found.empty_failures + found.copy_failures
        detail = "; ".join(failures) if failures else "placements kept"
        return Outcome(
            found.keeps_placements,
            f"propagator probe only (a process group is already initialised): {detail}",
        )
    with _fake_world(2):
        return _backward_repro()


CHECKS = (
    patched_check(
        "H2 DTensor Partial grad all-reduced by layout fix-up", "dtensor", "dtensor", _repro
    ),
)
