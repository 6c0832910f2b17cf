"""The patch registry: nesting, exceptions, threads, foreign replacement, status."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
from collections.abc import Iterator

import pytest

import gradsafe
from gradsafe import patching
from gradsafe.patching import AttrTarget, ItemTarget, Patch, PatchConflictWarning, Skip


def _original_a() -> str:
    return "original a"


def _original_b() -> str:
    return "original b"


def _ours_a() -> str:
    return "ours a"


def _ours_b() -> str:
    return "ours b"


TABLE: dict[str, object] = {"present": "upstream strategy"}


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """Two fake capabilities patching a fake module (two names) and a table."""
    mod = types.ModuleType("fake_torch_mod")
    mod.fn_a = _original_a  # type: ignore[attr-defined]
    mod.fn_b = _original_b  # type: ignore[attr-defined]
    reexport = types.ModuleType("fake_torch_reexport")
    reexport.fn_a = _original_a  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_torch_mod", mod)
    monkeypatch.setitem(sys.modules, "fake_torch_reexport", reexport)
    TABLE.clear()
    TABLE["present"] = "upstream strategy"
    calls: list[str] = []

    alpha = Patch(
        name="alpha",
        summary="fake functions",
        plan=lambda: [
            AttrTarget("fake_torch_mod", "fn_a", _ours_a),
            AttrTarget("fake_torch_reexport", "fn_a", _ours_a),
            AttrTarget("fake_torch_mod", "fn_b", _ours_b),
        ],
    )
    beta = Patch(
        name="beta",
        summary="fake strategy table",
        plan=lambda: [
            ItemTarget("TABLE", lambda: TABLE, "present", "ours"),
            ItemTarget("TABLE", lambda: TABLE, "absent", "ours too"),
        ],
        after_change=lambda: calls.append("cache cleared"),
    )
    gamma = Patch(name="gamma", summary="never applies", plan=lambda: Skip("torch 9 already fixed it"))
    delta = Patch(
        name="delta",
        summary="target missing",
        plan=lambda: [AttrTarget("fake_torch_mod", "not_there", _ours_a)],
    )
    caps = {"alpha": "", "beta": "", "gamma": "", "delta": ""}
    monkeypatch.setattr(patching, "_CAPABILITY_MODULES", caps)
    monkeypatch.setattr(
        patching,
        "_ENTRIES",
        {p.name: patching.Patcher(p) for p in (alpha, beta, gamma, delta)},
    )
    monkeypatch.setattr(patching, "_HANDLES", [])
    mod.calls = calls  # type: ignore[attr-defined]
    yield mod
    # every test must leave nothing applied
    assert all(e.refcount == 0 for e in patching._ENTRIES.values())


def test_patch_applies_and_unpatch_restores_exact_objects(fake_torch: types.ModuleType) -> None:
    reexport = sys.modules["fake_torch_reexport"]
    gradsafe.patch("alpha")
    assert fake_torch.fn_a is _ours_a and fake_torch.fn_b is _ours_b
    assert reexport.fn_a is _ours_a  # names re-imported elsewhere are patched too
    assert gradsafe.is_object_patched("fake_torch_mod", "fn_a")
    assert gradsafe.get_original("fake_torch_mod", "fn_a") is _original_a
    gradsafe.unpatch("alpha")
    assert fake_torch.fn_a is _original_a and fake_torch.fn_b is _original_b
    assert reexport.fn_a is _original_a
    assert not gradsafe.is_object_patched("fake_torch_mod", "fn_a")
    assert gradsafe.get_original("fake_torch_mod", "fn_a") is _original_a


def test_context_manager_restores_on_exception(fake_torch: types.ModuleType) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with gradsafe.patch("alpha", "beta"):
            assert fake_torch.fn_a is _ours_a
            assert TABLE == {"present": "ours", "absent": "ours too"}
            raise RuntimeError("boom")
    assert fake_torch.fn_a is _original_a
    assert TABLE == {"present": "upstream strategy"}  # absent key removed again
    assert fake_torch.calls == ["cache cleared", "cache cleared"]


def test_nesting_is_reference_counted(fake_torch: types.ModuleType) -> None:
    outer = gradsafe.patch("alpha")
    with gradsafe.patch("alpha"):
        with gradsafe.patch():  # every patch, alpha included
            assert fake_torch.fn_a is _ours_a
        assert fake_torch.fn_a is _ours_a
        assert gradsafe.status()["alpha"].refcount == 2
    assert fake_torch.fn_a is _ours_a
    outer.release()
    outer.release()  # releasing twice is harmless
    assert fake_torch.fn_a is _original_a


def test_unpatch_releases_one_reference_and_keeps_enclosing_with(
    fake_torch: types.ModuleType,
) -> None:
    with gradsafe.patch("alpha"):
        gradsafe.patch("alpha")
        gradsafe.patch("alpha")
        gradsafe.unpatch("alpha")
        assert fake_torch.fn_a is _ours_a
        gradsafe.unpatch()
        assert fake_torch.fn_a is _ours_a  # the with block still holds it
        assert gradsafe.status()["alpha"].refcount == 1
    assert fake_torch.fn_a is _original_a
    gradsafe.unpatch("alpha")  # nothing held: no-op
    assert fake_torch.fn_a is _original_a


def test_unpatch_never_takes_a_with_blocks_reference(fake_torch: types.ModuleType) -> None:
    with gradsafe.patch("alpha"):
        gradsafe.unpatch("alpha")  # no bare patch() holds alpha: nothing to undo
        gradsafe.unpatch()
        assert fake_torch.fn_a is _ours_a
    assert fake_torch.fn_a is _original_a


def test_patch_all_then_unpatch_all(fake_torch: types.ModuleType) -> None:
    gradsafe.patch()
    assert fake_torch.fn_a is _ours_a and TABLE["present"] == "ours"
    gradsafe.unpatch()
    assert fake_torch.fn_a is _original_a and TABLE == {"present": "upstream strategy"}


def test_unknown_name_lists_valid_names_and_applies_nothing(fake_torch: types.ModuleType) -> None:
    with pytest.raises(ValueError, match="alpha, beta, gamma, delta"):
        gradsafe.patch("alpha", "pipeline")
    assert fake_torch.fn_a is _original_a
    with pytest.raises(ValueError, match="valid names"):
        gradsafe.unpatch("nope")


def test_skips_are_reported_not_raised(fake_torch: types.ModuleType) -> None:
    handle = gradsafe.patch("gamma", "delta", "alpha")
    assert handle.names == ("alpha",)
    report = gradsafe.status()
    assert report["gamma"].skipped == "torch 9 already fixed it"
    assert report["delta"].skipped is not None and "fake_torch_mod.not_there" in report["delta"].skipped
    assert not report["gamma"].active and not report["delta"].active
    handle.release()


def test_status_is_structured_and_printable(fake_torch: types.ModuleType) -> None:
    idle = gradsafe.status()["alpha"]
    assert not idle.active
    assert [t.state for t in idle.targets] == ["planned"] * 3
    with gradsafe.patch("alpha"):
        active = gradsafe.status()["alpha"]
        assert active.active and active.refcount == 1
        assert [t.where for t in active.targets] == [
            "fake_torch_mod.fn_a",
            "fake_torch_reexport.fn_a",
            "fake_torch_mod.fn_b",
        ]
        assert all(t.state == "replaced" for t in active.targets)
        text = str(gradsafe.status())
        assert "alpha: active (refcount 1)" in text
        assert "fake_torch_reexport.fn_a: replaced" in text
        assert "gamma: skipped: torch 9 already fixed it" in text


def test_foreign_replacement_is_kept_warned_and_reported(fake_torch: types.ModuleType) -> None:
    def theirs() -> str:
        return "someone else's"

    handle = gradsafe.patch("alpha")
    fake_torch.fn_b = theirs
    assert gradsafe.status()["alpha"].targets[2].state == "conflict"
    with pytest.warns(PatchConflictWarning, match="fake_torch_mod.fn_b was replaced"):
        handle.release()
    assert fake_torch.fn_b is theirs  # not clobbered
    assert fake_torch.fn_a is _original_a  # the rest restored
    conflicts = gradsafe.status()["alpha"].conflicts
    assert len(conflicts) == 1 and "fn_b" in conflicts[0]
    assert "conflict:" in str(gradsafe.status())


def test_patch_over_foreign_patch_restores_theirs(fake_torch: types.ModuleType) -> None:
    def theirs() -> str:
        return "someone else's"

    fake_torch.fn_a = theirs
    with gradsafe.patch("alpha"):
        assert gradsafe.get_original("fake_torch_mod", "fn_a") is theirs
    assert fake_torch.fn_a is theirs


def test_failed_apply_rolls_back(fake_torch: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    class Frozen(dict):  # a mapping whose writes fail midway through a plan
        def __setitem__(self, key: object, value: object) -> None:
            raise TypeError("read-only table")

    frozen = Frozen(present="upstream strategy")
    bad = Patch(
        name="alpha",
        summary="fails on its second slot",
        plan=lambda: [
            AttrTarget("fake_torch_mod", "fn_a", _ours_a),
            ItemTarget("frozen", lambda: frozen, "present", "ours"),
        ],
    )
    monkeypatch.setitem(patching._ENTRIES, "alpha", patching.Patcher(bad))
    with pytest.raises(TypeError, match="read-only"):
        gradsafe.patch("alpha")
    assert fake_torch.fn_a is _original_a
    assert not gradsafe.status()["alpha"].active


def test_threads_balance(fake_torch: types.ModuleType) -> None:
    barrier = threading.Barrier(8)
    seen: list[bool] = []

    def worker() -> None:
        barrier.wait()
        for _ in range(200):
            with gradsafe.patch("alpha", "beta"):
                seen.append(fake_torch.fn_a is _ours_a and TABLE["present"] == "ours")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 1600 and all(seen)
    assert fake_torch.fn_a is _original_a and TABLE == {"present": "upstream strategy"}
    assert not patching._HANDLES


def test_import_has_no_side_effects() -> None:
    code = (
        "import sys, torch\n"
        "import torch.distributed.pipelining._backward as b, torch.cuda\n"
        "before = (b.stage_backward_input, b.stage_backward_weight, torch.cuda.make_graphed_callables)\n"
        "import gradsafe\n"
        "after = (b.stage_backward_input, b.stage_backward_weight, torch.cuda.make_graphed_callables)\n"
        "assert before == after, 'import patched something'\n"
        "caps = [m for m in sys.modules if m.startswith('gradsafe.') and m != 'gradsafe.patching']\n"
        "assert not caps, caps\n"
        "assert all(not p.active for p in gradsafe.status().patches)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_real_patch_names() -> None:
    assert gradsafe.patch_names() == ("pipelining", "dtensor", "cuda_graphs")
