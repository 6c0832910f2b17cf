"""The seed report's hazard (run from gradsafe.dtensor._hazards), without and with gradsafe.

With the pre-fix strategy installed (any torch) or natively (torch 2.11), a
Replicate parameter whose local view is used transposed with
``grad_placements=[Partial()]`` gets a Replicate ``.grad`` and one all-reduce
per backward. gradsafe's strategy keeps it Partial with no collective, and
leaving the patch puts back exactly what was there.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import applied
from torch.distributed.tensor import Partial, Replicate

import gradsafe
from gradsafe.dtensor import _patch, _torch, probe_propagator
from gradsafe.dtensor._hazards import SeedResult, run_seed
from gradsafe.patching import MISSING, Skip

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke


def _seen(result: SeedResult) -> tuple[tuple[object, ...], dict[str, int]]:
    assert result.values_right and result.strides_right, result
    return result.placements, result.collectives


BUG = ((Replicate(),), {"_c10d_functional.all_reduce": 1})
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
    assert _seen(run_seed(mesh)) == BUG
    with applied(_patch.plan_for(probe_propagator())):
        assert _seen(run_seed(mesh)) == FIXED
    assert _seen(run_seed(mesh)) == BUG
    after = _tables()
    for table_before, table_after in zip(before, after):
        assert table_before.keys() == table_after.keys()
        for op in table_before:
            assert table_after[op] is table_before[op], op
    for op, installed in prefix_strategy.op_strategy.items():
        assert after[0][op] is installed


def test_plan_keeps_the_single_dim_entries_empty(prefix_strategy) -> None:
    plan = _patch.plan_for(probe_propagator())
    assert not isinstance(plan, Skip)
    wheres = [target.where for target in plan]
    has_single = _torch.single_dim_strategy_table() is not None
    for op in _torch.EMPTY_FACTORIES:
        assert any(f"op_strategy_funcs[{op}]" in w for w in wheres)
        assert any(f"op_single_dim_strategy_funcs[{op}]" in w for w in wheres) == has_single


def _native_hazard() -> bool:
    return not probe_propagator().keeps_placements


def test_native_behaviour_matches_the_probe_and_gradsafe_is_right(fake_meshes) -> None:
    """torch 2.11 and 2.12: the hazard is native. 2.13+: upstream is right and the patch says so.

    The probe is asked before the patch: under it the propagator answers with
    gradsafe's strategy, which keeps placements wherever the installed torch
    can accumulate them (every reduce op on 2.12, so there it answers "keeps").
    """
    mesh = fake_meshes[1]
    native = _native_hazard()
    upstream = _seen(run_seed(mesh))
    assert upstream == (BUG if native else FIXED)
    with gradsafe.patch("dtensor") as handle:
        assert _seen(run_seed(mesh)) == FIXED
        if native:
            assert handle.names == ("dtensor",)
        else:
            assert handle.names == ()
            skipped = gradsafe.status()["dtensor"].skipped
            assert skipped is not None
            assert skipped.startswith("verified: upstream already keeps placements")
    assert _seen(run_seed(mesh)) == upstream


def _thread_before_and_after(mesh, make_patch) -> tuple[SeedResult, list[SeedResult]]:  # type: ignore[no-untyped-def]
    """A thread runs the seed backward, then ``make_patch()`` is entered on this thread,
    then the other thread runs it twice more."""
    before_patch: list[SeedResult] = []
    after_patch: list[SeedResult] = []
    ready, patched = threading.Event(), threading.Event()

    def worker() -> None:
        before_patch.append(run_seed(mesh))
        ready.set()
        patched.wait(timeout=60)
        after_patch.append(run_seed(mesh))
        after_patch.append(run_seed(mesh))

    thread = threading.Thread(target=worker, name="backward-thread")
    thread.start()
    try:
        ready.wait(timeout=60)
        with make_patch():
            patched.set()
            thread.join(timeout=60)
    finally:
        patched.set()
        thread.join(timeout=60)
    return before_patch[0], after_patch


def test_patch_after_another_threads_backward_reaches_that_thread(
    fake_meshes, prefix_strategy
) -> None:
    """The other thread keeps its cached pre-fix decision torch-side (per-thread caches);
    its first backward after the patch must still be right, not a silent all-reduce."""
    before, after = _thread_before_and_after(
        fake_meshes[1], lambda: applied(_patch.plan_for(probe_propagator()))
    )
    assert _seen(before) == BUG
    assert [_seen(r) for r in after] == [FIXED, FIXED]


def test_native_patch_after_another_threads_backward(fake_meshes) -> None:
    before, after = _thread_before_and_after(fake_meshes[1], lambda: gradsafe.patch("dtensor"))
    assert _seen(before) == (BUG if _native_hazard() else FIXED)
    assert [_seen(r) for r in after] == [FIXED, FIXED]


def test_backward_guard_reaches_a_device_queue_without_warning(prefix_strategy) -> None:
    """The once-per-device clear runs a hook on the thread autograd uses for that device.

    No accelerator here: a meta tensor goes through the same code (its
    backward runs on the CPU queue), which checks the hook is reached.
    """
    import warnings

    plan = _patch.plan_for(probe_propagator())
    with applied(plan), warnings.catch_warnings():
        warnings.simplefilter("error")
        leaf = torch.zeros(3, device="meta", requires_grad=True)
        (leaf * 2).sum().backward()
        assert leaf.grad is not None and leaf.grad.device.type == "meta"
