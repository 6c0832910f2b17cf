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
from typing import cast

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


def _backward_repro() -> Outcome:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2,))
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(3, 4), mesh, [Replicate()]))
    local = cast(DTensor, weight).to_local(grad_placements=[Partial()])
    with CommDebugMode() as comm:
        (local.t().contiguous() * torch.arange(12.0).reshape(4, 3)).sum().backward()
    grad = weight.grad
    assert isinstance(grad, DTensor)
    collectives = comm.get_total_counts()
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
