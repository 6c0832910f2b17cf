"""Collectives per backward for a DTensor parameter whose Partial gradient arrives transposed.

The seed report's pattern (Replicate parameter, ``to_local(grad_placements=
[Partial()])``, used transposed), on torch's in-process fake process group
(4 ranks, collectives do nothing), without and with ``gradsafe.patch("dtensor")``,
side by side in one process. Also prints the mean wall time per backward;
with a fake group that measures dispatch overhead only, not communication.

Run: ``PYTHONPATH=. python benchmarks/dtensor_comm_count.py``
"""

from __future__ import annotations

import platform
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import gradsafe

STEPS = 200


def measure(mesh) -> tuple[float, str, float]:  # type: ignore[no-untyped-def]
    weight = torch.nn.Parameter(DTensor.from_local(torch.randn(256, 128), mesh, [Replicate()]))
    coeff = torch.randn(128, 256)

    def step() -> None:
        weight.grad = None
        local = weight.to_local(grad_placements=[Partial()])
        (local.t().contiguous() * coeff).sum().backward()

    for _ in range(10):
        step()
    with CommDebugMode() as comm:
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    per_step = (time.perf_counter() - start) / STEPS
    assert isinstance(weight.grad, DTensor)
    return comm.get_total_counts(), str(list(weight.grad.placements)), per_step


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = init_device_mesh("cpu", (4,))
    try:
        up = measure(mesh)
        with gradsafe.patch("dtensor") as handle:
            fixed = measure(mesh)
            note = "" if handle.names else f" (patch skipped: {gradsafe.status()['dtensor'].skipped})"
        up2 = measure(mesh)
    finally:
        dist.destroy_process_group()
    print(f"torch {torch.__version__}, {platform.machine()}, {platform.processor() or 'cpu'}, fake pg x4")
    print(f"upstream : {up[0]} collective(s)/backward, grad {up[1]}, {up[2] * 1e6:.0f} us/backward")
    print(f"gradsafe : {fixed[0]} collective(s)/backward, grad {fixed[1]}, {fixed[2] * 1e6:.0f} us/backward{note}")
    upstream_time = (up[2] + up2[2]) / 2
    print(f"time ratio gradsafe/upstream: {fixed[2] / upstream_time:.2f} (upstream measured before and after)")


if __name__ == "__main__":
    main()
