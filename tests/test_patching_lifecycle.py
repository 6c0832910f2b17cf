"""The patch registry's promises (docs/architecture.md, README "Use").

Each test is one defect found by trying the registry as a hostile user; they
use a private registry over a throw-away module so they run in milliseconds.
"""

from __future__ import annotations

import copy
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterator

import pytest

from gradsafe.patching import AttrTarget, Patch, PatchRegistry


def _torch_a() -> str:
    return "torch a"


def _torch_b() -> str:
    return "torch b"


def _ours_a() -> str:
    return "ours a"


def _ours_b() -> str:
    return "ours b"


def _other_ours_a() -> str:
    return "another patch's a"


@pytest.fixture
def mod() -> Iterator[types.ModuleType]:
    module = types.ModuleType("gradsafe_review_target")
    module.a = _torch_a  # type: ignore[attr-defined]
    module.b = _torch_b  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _patch_a(after_change=lambda: None) -> Patch:  # type: ignore[no-untyped-def]
    return Patch(
        "a", "", lambda: [AttrTarget("gradsafe_review_target", "a", _ours_a)], after_change
    )


def _patch_b(after_change=lambda: None) -> Patch:  # type: ignore[no-untyped-def]
    return Patch(
        "b", "", lambda: [AttrTarget("gradsafe_review_target", "b", _ours_b)], after_change
    )


def test_partially_released_handle_reentered_patches_every_requested_name(
    mod: types.ModuleType,
) -> None:
    # README: "a stored handle can be entered again ... and patches every block".
    registry = PatchRegistry([_patch_a(), _patch_b()])
    handle = registry.patch()
    handle.release("a")
    with handle:
        assert mod.a is _ours_a, "the block runs without patch 'a' although the handle requested it"
        assert mod.b is _ours_b
    assert (mod.a, mod.b) == (_torch_a, _torch_b)
    assert registry.status()["a"].refcount == registry.status()["b"].refcount == 0


def test_failing_after_change_on_apply_leaves_nothing_applied(mod: types.ModuleType) -> None:
    # docs/architecture.md: "The first reference applies a patch (all slots or none)".
    def fail() -> None:
        raise RuntimeError("cache clear failed")

    registry = PatchRegistry([_patch_a(after_change=fail)])
    with pytest.raises(RuntimeError, match="cache clear failed"):
        registry.patch()
    state = registry.status()["a"]
    assert state.refcount == 0
    assert mod.a is _torch_a, "patch() raised, yet gradsafe's object stays installed, unowned"
    assert not registry.is_object_patched("gradsafe_review_target", "a")


def test_one_failing_release_does_not_leak_the_blocks_other_references(
    mod: types.ModuleType,
) -> None:
    calls = []

    def fail_on_restore() -> None:
        calls.append(1)
        if len(calls) == 2:  # 1: apply, 2: restore
            raise RuntimeError("cache clear failed")

    registry = PatchRegistry([_patch_a(after_change=fail_on_restore), _patch_b()])
    with pytest.raises(RuntimeError, match="cache clear failed"):
        with registry.patch():
            pass
    assert mod.a is _torch_a
    assert registry.status()["b"].refcount == 0, "patch 'b' is left installed with no holder"
    assert mod.b is _torch_b


def test_second_patch_of_the_same_slot_does_not_silently_undo_the_first(
    mod: types.ModuleType,
) -> None:
    # Releasing the later patch restored torch's object while the earlier one
    # was still active (and status() then reported a CONFLICT against
    # gradsafe's own patch). Either refusing the overlap or restoring the
    # earlier patch's object is acceptable; silently dropping it is not.
    first = Patch("first", "", lambda: [AttrTarget("gradsafe_review_target", "a", _ours_a)])
    second = Patch("second", "", lambda: [AttrTarget("gradsafe_review_target", "a", _other_ours_a)])
    registry = PatchRegistry([first, second])
    with registry.patch("first"):
        try:
            handle = registry.patch("second")
        except RuntimeError:
            assert mod.a is _ours_a
        else:
            handle.release()
            assert mod.a is _ours_a, "releasing 'second' removed 'first' while 'first' is active"
        assert registry.status()["first"].conflicts == ()
        assert all(t.state == "replaced" for t in registry.status()["first"].targets)
    assert mod.a is _torch_a


def test_release_refuses_unknown_names(mod: types.ModuleType) -> None:
    # patch() and unpatch() refuse a typo; release() silently kept the patch.
    registry = PatchRegistry([_patch_a()])
    handle = registry.patch()
    with pytest.raises(ValueError, match="unknown"):
        handle.release("aa")
    handle.release()
    assert mod.a is _torch_a


def test_a_probe_failing_on_a_changed_internal_is_a_cached_skip(mod: types.ModuleType) -> None:
    # README: "a patch whose target or call site differs is skipped with the
    # reason". A probe meeting a changed torch internal can fail with any
    # exception (KeyError from a strategy table, TypeError from a changed
    # signature), not only ImportError/AttributeError; then patch() raised,
    # applied none of the other patches, and re-ran the failing probe on
    # every later patch().
    probes = []

    def changed_internal() -> list[AttrTarget]:
        probes.append(1)
        raise KeyError("aten.new_empty_strided.default")

    registry = PatchRegistry([_patch_a(), Patch("changed", "", changed_internal)])
    with registry.patch() as handle:
        assert handle.names == ("a",)
        assert mod.a is _ours_a
    state = registry.status()["changed"]
    assert state.state == "skipped"
    assert state.skipped is not None and "new_empty_strided" in state.skipped
    with registry.patch():
        pass
    assert len(probes) == 1


def _decision(plan: object) -> tuple[str, ...]:
    from gradsafe.patching import Skip

    if isinstance(plan, Skip):
        return ("skip", plan.reason)
    return ("replace", *(t.where for t in plan))  # type: ignore[attr-defined]


def test_plans_ignore_the_callers_dispatch_modes() -> None:
    # docs/architecture.md: a plan is computed "always under plain tensor
    # semantics ... so patch() under torch.no_grad(), torch.inference_mode()
    # or torch.device("meta") decides exactly as at start-up". A dispatch mode
    # the caller has active (FakeTensorMode while tracing, a FLOP or memory
    # counter) ran inside the probes: under FakeTensorMode the DTensor probe
    # raised DataDependentOutputException, so gradsafe.patch() failed.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gradsafe.capabilities import CUDA_GRAPHS, DTENSOR, PIPELINING

    at_start_up = PatchRegistry([PIPELINING, DTENSOR, CUDA_GRAPHS])
    expected = {name: _decision(at_start_up.plan(name)) for name in at_start_up.names()}
    traced = PatchRegistry([PIPELINING, DTENSOR, CUDA_GRAPHS])
    with FakeTensorMode():
        got = {name: _decision(traced.plan(name)) for name in traced.names()}
    assert got == expected


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy, lambda h: pickle.dumps(h)])
def test_a_handle_cannot_be_copied_so_no_copy_releases_the_originals_references(
    mod: types.ModuleType, duplicate: Callable[[object], object]
) -> None:
    registry = PatchRegistry([_patch_a()])
    handle = registry.patch()
    with pytest.raises(TypeError, match=r"cannot be copied.*patch\(\) again"):
        duplicate(handle)
    assert mod.a is _ours_a and handle.names == ("a",)
    handle.release()
    assert mod.a is _torch_a and registry.status()["a"].refcount == 0


def test_a_copy_attempt_inside_a_with_block_leaves_the_block_patched(mod: types.ModuleType) -> None:
    registry = PatchRegistry([_patch_a()])
    with registry.patch() as handle:
        with pytest.raises(TypeError):
            copy.copy(handle)
        assert mod.a is _ours_a and registry.status()["a"].refcount == 1
    assert mod.a is _torch_a


def test_leaving_a_handle_more_often_than_it_was_entered_is_a_clear_error(
    mod: types.ModuleType,
) -> None:
    registry = PatchRegistry([_patch_a()])
    handle = registry.patch()
    with handle:
        pass
    with pytest.raises(RuntimeError, match="__exit__ called more often than __enter__"):
        handle.__exit__(None, None, None)
    assert mod.a is _torch_a and registry.status()["a"].refcount == 0


def test_unpatch_with_nothing_to_release_is_a_no_op(mod: types.ModuleType) -> None:
    registry = PatchRegistry([_patch_a()])
    registry.unpatch()  # nothing patched at all
    handle = registry.patch()
    handle.release()
    registry.unpatch("a")  # released already through the handle
    with registry.patch():
        registry.unpatch()  # the block's reference is not this call's to release
        assert mod.a is _ours_a and registry.status()["a"].refcount == 1
    assert mod.a is _torch_a and registry.status()["a"].refcount == 0


def test_one_handle_entered_by_many_threads_keeps_every_block_patched(
    mod: types.ModuleType,
) -> None:
    registry = PatchRegistry([_patch_a()])
    handle = registry.patch()
    handle.release()
    threads = 8
    entered = threading.Barrier(threads)
    seen: list[object] = []
    errors: list[BaseException] = []

    def block() -> None:
        try:
            with handle:
                entered.wait(timeout=10)  # every thread inside its block at once
                seen.append(mod.a)
                entered.wait(timeout=10)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=block) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert errors == [] and seen == [_ours_a] * threads
    assert mod.a is _torch_a and registry.status()["a"].refcount == 0 and handle.names == ()
