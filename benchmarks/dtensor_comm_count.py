"""Collectives per backward for a DTensor parameter whose Partial gradient arrives transposed.

The seed report's pattern (gradsafe.dtensor._hazards: Replicate parameter,
``to_local(grad_placements=[Partial()])``, used transposed), on torch's
in-process fake process group (4 ranks, collectives do nothing), without and
with ``gradsafe.patch("dtensor")``, side by side in one process. Also prints
the mean wall time per backward; with a fake group that measures dispatch
overhead only, not communication; both columns include the collective
counter's dispatch mode.

Run: ``PYTHONPATH=. python benchmarks/dtensor_comm_count.py``
"""

from __future__ import annotations

import os
import platform
import time

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import gradsafe
from gradsafe.dtensor._hazards import fake_world, seed_backward, seed_parameter

STEPS = 200
SHAPE = (256, 128)


def measure(mesh: DeviceMesh) -> tuple[int, str, float]:
    weight = seed_parameter(mesh, SHAPE)
    coeff = torch.randn(SHAPE[1], SHAPE[0])

    def step() -> int:
        weight.grad = None
        return seed_backward(weight, coeff).total

    for _ in range(10):
        step()
    collectives = step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    per_step = (time.perf_counter() - start) / STEPS
    grad = weight.grad
    if not isinstance(grad, DTensor):
        raise TypeError(f".grad is {type(grad).__name__}, not a DTensor")
    return collectives, str(list(grad.placements)), per_step


def main() -> None:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        up = measure(mesh)
        with gradsafe.patch("dtensor") as handle:
            fixed = measure(mesh)
            note = "" if handle.names else f" (patch skipped: {gradsafe.status()['dtensor'].skipped})"
        up2 = measure(mesh)
    print(
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"fake pg x4, {SHAPE[0]}x{SHAPE[1]} parameter, {STEPS} backwards"
    )
    print(f"upstream : {up[0]} collective(s)/backward, grad {up[1]}, {up[2] * 1e6:.0f} us/backward")
    print(f"gradsafe : {fixed[0]} collective(s)/backward, grad {fixed[1]}, {fixed[2] * 1e6:.0f} us/backward{note}")
    upstream_time = (up[2] + up2[2]) / 2
    print(f"time ratio gradsafe/upstream: {fixed[2] / upstream_time:.2f} (upstream measured before and after)")


if __name__ == "__main__":
    main()
