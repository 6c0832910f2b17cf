"""Rank bodies for the gloo tests (spawned processes; results go to one JSON file per rank).

``values``: a representative subset of the gradient matrix under
``gradsafe.patch("dtensor")``, each ``.grad.full_tensor()`` compared with the
gradient rebuilt from every rank's local one without DTensor.
``fsdp``: a ``fully_shard`` (FSDP2) model whose weight is used transposed,
run with and without gradsafe; collectives per backward and gradients
against a single-process reference.
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from dtensor_gradcases import LAYOUTS, PLACEMENTS, Case, expected_global_grad, kept_by_gradsafe, run
from torch.distributed.device_mesh import init_device_mesh

import gradsafe
from gradsafe.dtensor._hazards import CollectiveCounter

_TIMEOUT = datetime.timedelta(seconds=60)


def value_cases(world_size: int) -> list[Case]:
    """The subset checked on real ranks: every placement and layout through the fix-up,
    plus hook + create_graph, plus accumulation into an existing ``.grad``.

    Accumulating a Partial(max)/Partial(min) gradient that AccumulateGrad
    stole (contiguous, no hook) raises on torch 2.11 with or without
    gradsafe; every other accumulation must work.
    """
    cases = []
    for name, ndim, _, grad_pl in PLACEMENTS:
        if ndim == 2 and world_size != 4:
            continue
        max_or_min = any(getattr(p, "reduce_op", None) in ("max", "min") for p in grad_pl)
        for layout in LAYOUTS:
            cases.append(Case(name, layout, False, False, False))
            cases.append(Case(name, layout, False, True, True))
            if not (max_or_min and layout == "contiguous"):
                cases.append(Case(name, layout, True, False, False))
    return cases


def _values(rank: int, world_size: int) -> list[dict[str, object]]:
    meshes = {1: init_device_mesh("cpu", (world_size,))}
    if world_size == 4:
        meshes[2] = init_device_mesh("cpu", (2, 2))
    results = []
    with gradsafe.patch("dtensor"):
        for case in value_cases(world_size):
            mesh = meshes[case.spec[0]]
            try:
                outcome = run(case, mesh)
            except RuntimeError as exc:
                results.append({"id": case.id, "ok": False, "detail": f"raises: {exc}"[:300]})
                continue
            got = outcome.grad.full_tensor()
            want = expected_global_grad(case, mesh)
            # Collectives of accumulation into an existing .grad, and of gradients
            # gradsafe leaves to torch, are checked in the fake-pg matrix.
            quiet = case.existing_grad or not kept_by_gradsafe(case) or outcome.collectives == 0
            ok = torch.allclose(got, want, rtol=1e-6, atol=1e-5) and quiet
            detail = (
                f"{list(outcome.placements)}, {outcome.collectives} collectives, "
                f"max |err| {float((got - want).abs().max()):.3g}"
            )
            results.append({"id": case.id, "ok": bool(ok), "detail": detail})
    return results


class _TransposedUse(torch.nn.Module):
    """Weight stored (out, in) but consumed through a transposed contiguous copy,
    so its gradient arrives transposed (the seed report's pattern)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t().contiguous().t())


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(_TransposedUse(8, 6), _TransposedUse(6, 4))


def _fsdp_step(
    rank: int, world_size: int, x: torch.Tensor
) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = _model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss = model(x.chunk(world_size)[rank]).square().sum()
    with CollectiveCounter() as comm:
        loss.backward()
    counts = dict(comm.counts)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return counts, grads


def _fsdp(rank: int, world_size: int) -> list[dict[str, object]]:
    x = torch.randn(4 * world_size, 8, generator=torch.Generator().manual_seed(1))
    reference = _model()
    reference(x).square().sum().div(world_size).backward()  # FSDP averages over ranks
    want = {name: p.grad for name, p in reference.named_parameters()}
    upstream_counts, upstream_grads = _fsdp_step(rank, world_size, x)
    with gradsafe.patch("dtensor"):
        counts, grads = _fsdp_step(rank, world_size, x)
    fsdp_own = {
        "c10d._allgather_base_",
        "c10d._reduce_scatter_base_",
        "c10d.allgather_into_tensor_coalesced_",
        "c10d.reduce_scatter_tensor_coalesced_",
    }
    results = [
        {
            "id": "fsdp2-collectives",
            "ok": counts == upstream_counts and set(counts) <= fsdp_own,
            "detail": f"with gradsafe {counts}; upstream {upstream_counts}",
        }
    ]
    for name, grad in grads.items():
        err = float((grad - want[name]).abs().max())
        up_err = float((upstream_grads[name] - want[name]).abs().max())
        results.append(
            {
                "id": f"fsdp2-grad-{name}",
                "ok": err < 1e-5,
                "detail": f"max |err| {err:.3g} (upstream {up_err:.3g})",
            }
        )
    return results


def worker(rank: int, world_size: int, job: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    # A file rendezvous needs no free TCP port (no race with other test runs);
    # gloo itself connects the ranks over 127.0.0.1.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world_size,
        timeout=_TIMEOUT,
    )
    try:
        results = _values(rank, world_size)
        if job == "values+fsdp":
            results += _fsdp(rank, world_size)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    # Results are on disk. Skip interpreter teardown: in about one launch in
    # five a torch/gloo background thread is still joinable when C++ statics
    # are destroyed and the rank aborts ("terminate called without an active
    # exception", no Python frame), after all work is done.
    os._exit(0)
