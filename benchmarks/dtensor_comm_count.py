"""Collectives per backward for a DTensor parameter whose Partial gradient arrives transposed.

The seed report's pattern (gradsafe.dtensor._hazards: Replicate parameter,
``to_local(grad_placements=[Partial()])``, used transposed), on torch's
in-process fake process group (4 ranks, collectives do nothing), without and
with ``gradsafe.patch("dtensor")``, side by side in one process. Also prints
the mean wall time per backward; with a fake group that measures dispatch
overhead only, not communication; both columns include the collective
counter's dispatch mode.

Then two costs of the patch itself: the mean time of a ``with
gradsafe.patch("dtensor")`` entry and exit (the plan is made once per
process; on torch where the patch applies, each entry installs and each exit
restores, both clearing the calling thread's sharding caches), and the time
of a tiny plain (non-DTensor) CPU backward without and with the patch, which
wraps every backward's entry to bring the calling thread's caches up to date.

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


ROUNDS = 10  # the machine is shared: report the best of several interleaved rounds


def patch_cycle_us(cycles: int = 200) -> float:
    with gradsafe.patch("dtensor"):  # the first entry plans (probes) once per process
        pass
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(cycles):
            with gradsafe.patch("dtensor"):
                pass
        best = min(best, (time.perf_counter() - start) / cycles * 1e6)
    return best


def tiny_backward_us(steps: int = 1000) -> tuple[float, float]:
    """Best-of-rounds time of a tiny CPU backward: (upstream, under the patch)."""
    leaf = torch.ones(8, requires_grad=True)

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            (leaf * 2).sum().backward()
        return (time.perf_counter() - start) / steps * 1e6

    timed()
    upstream, patched = float("inf"), float("inf")
    for round_ in range(ROUNDS):
        # Alternate which side runs first, so that order effects cancel.
        for side in ("upstream", "patched") if round_ % 2 else ("patched", "upstream"):
            if side == "upstream":
                upstream = min(upstream, timed())
            else:
                with gradsafe.patch("dtensor"):
                    patched = min(patched, timed())
    return upstream, patched


def main() -> None:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        up = measure(mesh)
        start = time.perf_counter()
        with gradsafe.patch("dtensor") as handle:
            first_patch_ms = (time.perf_counter() - start) * 1e3
            fixed = measure(mesh)
            note = (
                "" if handle.names else f" (patch skipped: {gradsafe.status()['dtensor'].skipped})"
            )
        up2 = measure(mesh)
    print(
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"fake pg x4, {SHAPE[0]}x{SHAPE[1]} parameter, {STEPS} backwards"
    )
    print(f"upstream : {up[0]} collective(s)/backward, grad {up[1]}, {up[2] * 1e6:.0f} us/backward")
    print(
        f"gradsafe : {fixed[0]} collective(s)/backward, grad {fixed[1]}, {fixed[2] * 1e6:.0f} us/backward{note}"
    )
    upstream_time = (up[2] + up2[2]) / 2
    print(
        f"time ratio gradsafe/upstream: {fixed[2] / upstream_time:.2f} (upstream measured before and after)"
    )
    print(
        f"first gradsafe.patch('dtensor') in the process (probes the propagator): {first_patch_ms:.0f} ms"
    )
    print(
        f"with gradsafe.patch('dtensor') entry+exit (best of {ROUNDS}): {patch_cycle_us():.0f} us"
    )
    plain, patched = tiny_backward_us()
    print(
        f"tiny CPU backward (best of {ROUNDS}): upstream {plain:.1f} us, under the patch "
        f"{patched:.1f} us, ratio {patched / plain:.2f}"
    )


if __name__ == "__main__":
    main()
