"""The seed report's hazard: a Partial gradient through AccumulateGrad's layout fix-up.

With the pre-fix strategy installed (any torch) or natively (torch 2.11), a
Replicate parameter whose local view is used transposed with
``grad_placements=[Partial()]`` gets a Replicate ``.grad`` and one all-reduce
per backward. ``gradsafe.patch("dtensor")`` keeps it Partial with no
collective, and leaving the block puts back exactly what was there.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.torch_version import TorchVersion

import gradsafe
from gradsafe.dtensor import _torch, probe_propagator
from gradsafe.patching import MISSING, PatchRegistry


def _seed_backward(mesh: DeviceMesh) -> tuple[tuple[object, ...], dict[str, int]]:
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 6), mesh, [Replicate()]))
    local = weight.to_local(grad_placements=[Partial()])
    with CommDebugMode() as comm:
        (local.t().contiguous() * 3.0).sum().backward()
    assert isinstance(weight.grad, DTensor)
    assert weight.grad.stride() == weight.stride()
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    return weight.grad.placements, counts


BUG = ((Replicate(),), {"c10d_functional.all_reduce": 1})
FIXED = ((Partial(),), {})


def _tables() -> tuple[dict[object, object], dict[object, object]]:
    single = _torch.single_dim_strategy_table() or {}
    return (
        {op: _torch.op_strategy_table().get(op, MISSING) for op in _torch.EMPTY_FACTORIES},
        {op: single.get(op, MISSING) for op in _torch.EMPTY_FACTORIES},
    )


def test_prefix_strategy_reproduces_and_gradsafe_fixes(fake_meshes, prefix_strategy) -> None:
    mesh = fake_meshes[1]
    before = _tables()
    # The first run also fills the sharding caches with the pre-fix decision:
    # the fix showing up on the very next backward proves they were cleared.
    assert _seed_backward(mesh) == BUG
    # A fresh registry: the process's one cached its decision for the real tables.
    registry = PatchRegistry([gradsafe.capabilities.DTENSOR])
    with registry.patch("dtensor") as handle:
        assert handle.names == ("dtensor",)
        assert registry.status()["dtensor"].active
        assert _seed_backward(mesh) == FIXED
    assert _seed_backward(mesh) == BUG
    after = _tables()
    for table_before, table_after in zip(before, after):
        assert table_before.keys() == table_after.keys()
        for op in table_before:
            assert table_after[op] is table_before[op], op
    for op, installed in prefix_strategy.op_strategy.items():
        assert after[0][op] is installed


def test_patch_plan_shadows_a_single_dim_entry(prefix_strategy) -> None:
    plan = gradsafe.capabilities.DTENSOR.plan()
    assert not isinstance(plan, gradsafe.patching.Skip)
    wheres = [target.where for target in plan]
    single = _torch.single_dim_strategy_table() or {}
    for op in _torch.EMPTY_FACTORIES:
        assert any(f"op_strategy_funcs[{op}]" in w for w in wheres)
        shadowed = any(f"op_single_dim_strategy_funcs[{op}]" in w for w in wheres)
        assert shadowed == (op in single)


NATIVE_HAZARD = TorchVersion(torch.__version__) < (2, 13)


def test_native_behaviour_matches_the_probe_and_gradsafe_is_right(fake_meshes) -> None:
    """torch 2.11: the hazard is native. 2.13+: upstream is right and the patch says so."""
    mesh = fake_meshes[1]
    upstream = _seed_backward(mesh)
    assert upstream == (BUG if NATIVE_HAZARD else FIXED)
    assert probe_propagator().keeps_placements == (not NATIVE_HAZARD)
    with gradsafe.patch("dtensor") as handle:
        assert _seed_backward(mesh) == FIXED
        if NATIVE_HAZARD:
            assert handle.names == ("dtensor",)
        else:
            assert handle.names == ()
            skipped = gradsafe.status()["dtensor"].skipped
            assert skipped is not None
            assert skipped.startswith("verified: upstream already keeps placements")
    assert _seed_backward(mesh) == upstream
