"""A documented limit: gradients of different Partial reduce ops accumulated into one parameter.

Under the patch (torch 2.11) the first ``.grad`` stays ``Partial(sum)``, as on
torch 2.13+, so a following ``Partial(avg)`` gradient cannot be accumulated into
it: DTensor raises, as torch 2.13+ does without gradsafe. Unpatched 2.11
all-reduces the first ``.grad`` to Replicate and accepts it. docs/dtensor.md
("Other limitations") states this; the test pins it so a change is noticed.
"""

from __future__ import annotations

import torch

import gradsafe
from gradsafe.dtensor._hazards import fake_world, seed_coefficients, seed_parameter


def _partial_backward(weight: torch.Tensor, reduce_op: str) -> None:
    from torch.distributed.tensor import Partial

    local = weight.to_local(grad_placements=[Partial(reduce_op)])  # type: ignore[attr-defined]
    (local.t().contiguous() * seed_coefficients()).sum().backward()


def _sum_then_avg(mesh: object) -> str:
    weight = seed_parameter(mesh)  # type: ignore[arg-type]
    _partial_backward(weight, "sum")
    try:
        _partial_backward(weight, "avg")
    except AssertionError as exc:  # DTensor's redistribution refusal
        return f"raises: {exc}"
    return f"accumulates into {list(weight.grad.placements)}"  # type: ignore[union-attr]


def test_sum_then_avg_behaves_as_torch_2_13() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        plain = _sum_then_avg(mesh)
        with gradsafe.patch("dtensor") as handle:
            applied = "dtensor" in handle.names
            patched = _sum_then_avg(mesh)
    if applied:  # 2.11: torch 2.13's semantics, limit included
        assert plain.startswith("accumulates"), plain
        assert "partial type" in patched, patched
    else:  # 2.13+: upstream already keeps Partial; gradsafe changes nothing
        assert patched == plain
        assert "partial type" in plain, plain
