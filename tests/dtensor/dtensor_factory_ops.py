"""What user code does with ``new_empty`` / ``new_empty_strided`` of a DTensor, op by op.

Shared by the semantics test and the script that recorded torch 2.13's
behaviour. Each op starts from ``x`` (local values 1..8 on every rank, 2x4,
placements given) and an empty tensor made from it with ``x``'s shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from gradsafe.dtensor._hazards import CollectiveCounter

PLACEMENTS: dict[str, Placement] = {
    "P(sum)": Partial("sum"),
    "P(avg)": Partial("avg"),
    "P(max)": Partial("max"),
    "P(min)": Partial("min"),
    "S(0)": Shard(0),
    "R": Replicate(),
}

FACTORIES: dict[str, Callable[[DTensor], DTensor]] = {
    "new_empty": lambda x: x.new_empty(x.shape),
    "new_empty_strided": lambda x: x.new_empty_strided(x.shape, x.stride()),
}


def _ones_like_local(x: DTensor) -> DTensor:
    return DTensor.from_local(torch.ones(x.shape), x.device_mesh, [Replicate()])


# name -> (op, whether its values are deterministic)
OPS: dict[str, tuple[Callable[[DTensor, DTensor], DTensor], bool]] = {
    "fill_(1)": (lambda e, x: e.fill_(1.0), True),
    "zero_()": (lambda e, x: e.zero_(), True),
    "zero_().add_(R ones)": (lambda e, x: e.zero_().add_(_ones_like_local(x)), True),
    "zero_().add_(x)": (lambda e, x: e.zero_().add_(x), True),
    "normal_()": (lambda e, x: e.normal_(), False),
    "uniform_()": (lambda e, x: e.uniform_(), False),
    "copy_(x)": (lambda e, x: e.copy_(x), True),
    "copy_(R ones)": (lambda e, x: e.copy_(_ones_like_local(x)), True),
    "copy_(x).mul_(2)": (lambda e, x: e.copy_(x).mul_(2), True),
    "zero_() + 1": (lambda e, x: e.zero_() + 1, True),
}

#: (placements of the empty tensor, of the result, collectives, result's local values or None)
Behaviour = tuple[str, str, int, tuple[float, ...] | None]


def behaviour(mesh: DeviceMesh, placement: str, factory: str, op: str) -> Behaviour | str:
    """What ``op`` does on rank 0 of ``mesh``; ``"raises"`` if it raises RuntimeError."""
    x = DTensor.from_local(torch.arange(1.0, 9.0).reshape(2, 4), mesh, [PLACEMENTS[placement]])
    run, deterministic = OPS[op]
    try:
        with CollectiveCounter() as comm:
            empty = FACTORIES[factory](x)
            made = str(list(empty.placements))
            out = run(empty, x)
    except RuntimeError:
        return "raises"
    values = tuple(out.to_local().flatten().tolist()) if deterministic else None
    return made, str(list(out.placements)), comm.total, values


def record() -> None:
    """Print this torch's behaviour as a Python dict (how TORCH_2_13 was recorded, on 2.13.0)."""
    from torch.distributed.device_mesh import init_device_mesh

    from gradsafe.dtensor._hazards import fake_world

    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        print(f"# torch {torch.__version__}, rank 0 of a fake process group of 4")
        print("{")
        for placement in PLACEMENTS:
            for op in OPS:
                found = {factory: behaviour(mesh, placement, factory, op) for factory in FACTORIES}
                if len(set(found.values())) != 1:
                    raise RuntimeError(f"{placement} {op}: the factories differ: {found}")
                print(f"    ({placement!r}, {op!r}): {found['new_empty']!r},")
        print("}")


if __name__ == "__main__":
    record()
