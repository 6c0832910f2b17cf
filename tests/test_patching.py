"""The patch registry: lifecycle, handles, threads, foreign replacements, passive status, contexts."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import types
import warnings
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradsafe
from gradsafe.patching import (
    AttrTarget,
    ItemTarget,
    Patch,
    PatchConflictWarning,
    PatchRegistry,
    Skip,
)


def _original_a() -> str:
    return "original a"


def _original_b() -> str:
    return "original b"


def _ours_a() -> str:
    return "ours a"


def _ours_b() -> str:
    return "ours b"


def _theirs() -> str:
    return "someone else's"


TABLE: dict[str, object] = {}


class Fake:
    """A fake torch (a module with two names, a re-export, a table) and a registry patching it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mod = types.ModuleType("fake_torch_mod")
        self.mod.fn_a = _original_a  # type: ignore[attr-defined]
        self.mod.fn_b = _original_b  # type: ignore[attr-defined]
        self.reexport = types.ModuleType("fake_torch_reexport")
        self.reexport.fn_a = _original_a  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "fake_torch_mod", self.mod)
        monkeypatch.setitem(sys.modules, "fake_torch_reexport", self.reexport)
        TABLE.clear()
        TABLE["present"] = "upstream strategy"
        self.calls: list[str] = []
        self.plans: list[str] = []
        self.contexts: list[tuple[bool, bool, str]] = []

        def plan_alpha() -> list[AttrTarget]:
            import torch

            self.plans.append("alpha")
            self.contexts.append(
                (
                    torch.is_grad_enabled(),
                    torch.is_inference_mode_enabled(),
                    str(torch.empty(0).device),
                )
            )
            return [
                AttrTarget("fake_torch_mod", "fn_a", _ours_a),
                AttrTarget("fake_torch_reexport", "fn_a", _ours_a),
                AttrTarget("fake_torch_mod", "fn_b", _ours_b),
            ]

        def plan_gamma() -> Skip:
            self.plans.append("gamma")
            return Skip("torch 9 already fixed it")

        self.alpha = Patch("alpha", "fake functions", plan_alpha)
        self.beta = Patch(
            "beta",
            "fake strategy table",
            lambda: [
                ItemTarget("TABLE", lambda: TABLE, "present", "ours"),
                ItemTarget("TABLE", lambda: TABLE, "absent", "ours too"),
            ],
            after_change=lambda: self.calls.append("cache cleared"),
        )
        self.gamma = Patch("gamma", "never applies", plan_gamma)
        self.delta = Patch(
            "delta", "target missing", lambda: [AttrTarget("fake_torch_mod", "not_there", _ours_a)]
        )
        self.emulation = Patch(
            "emulation", "a testing patch", lambda: [AttrTarget("fake_torch_mod", "fn_b", _theirs)]
        )
        self.registry = PatchRegistry(
            [self.alpha, self.beta, self.gamma, self.delta], testing=[self.emulation]
        )

    def pristine(self) -> bool:
        return (
            self.mod.fn_a is _original_a
            and self.mod.fn_b is _original_b
            and self.reexport.fn_a is _original_a
            and TABLE == {"present": "upstream strategy"}
        )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fake]:
    made = Fake(monkeypatch)
    yield made
    # every test leaves nothing applied
    assert all(p.refcount == 0 for p in made.registry.status().patches)


def test_patch_applies_and_unpatch_restores_exact_objects(fake: Fake) -> None:
    reg = fake.registry
    reg.patch("alpha")
    assert fake.mod.fn_a is _ours_a and fake.mod.fn_b is _ours_b
    assert fake.reexport.fn_a is _ours_a  # names re-imported elsewhere are patched too
    assert reg.is_object_patched("fake_torch_mod", "fn_a")
    assert reg.get_original("fake_torch_mod", "fn_a") is _original_a
    reg.unpatch("alpha")
    assert fake.pristine()
    assert not reg.is_object_patched("fake_torch_mod", "fn_a")
    assert reg.get_original("fake_torch_mod", "fn_a") is _original_a


def test_context_manager_restores_on_exception(fake: Fake) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with fake.registry.patch("alpha", "beta"):
            assert fake.mod.fn_a is _ours_a
            assert TABLE == {"present": "ours", "absent": "ours too"}
            raise RuntimeError("boom")
    assert fake.pristine()  # the absent key is removed again
    assert fake.calls == ["cache cleared", "cache cleared"]


def test_nesting_is_reference_counted(fake: Fake) -> None:
    reg = fake.registry
    outer = reg.patch("alpha")
    with reg.patch("alpha"):
        with reg.patch():  # every patch, alpha included
            assert fake.mod.fn_a is _ours_a
        assert reg.status()["alpha"].refcount == 2
    assert fake.mod.fn_a is _ours_a
    outer.release()
    outer.release()  # releasing twice is harmless
    assert fake.pristine()


def test_unpatch_releases_one_bare_reference_and_keeps_enclosing_with(fake: Fake) -> None:
    reg = fake.registry
    with reg.patch("alpha"):
        reg.patch("alpha")
        reg.patch("alpha")
        reg.unpatch("alpha")
        assert reg.status()["alpha"].refcount == 2
        reg.unpatch()
        reg.unpatch()  # nothing bare left: no-op, the with block keeps its reference
        assert fake.mod.fn_a is _ours_a and reg.status()["alpha"].refcount == 1
    assert fake.pristine()


def test_handle_reentered_patches_every_block(fake: Fake) -> None:
    reg = fake.registry
    ctx = reg.patch("alpha")
    for _ in range(3):
        with ctx:
            assert fake.mod.fn_a is _ours_a
            with ctx:  # nested re-entry takes its own reference
                assert reg.status()["alpha"].refcount == 2
            assert fake.mod.fn_a is _ours_a
        assert fake.pristine()
    assert ctx.names == ()


def test_with_block_reference_survives_other_threads_unpatch(fake: Fake) -> None:
    """The race: patch() is called, then before __enter__ another thread unpatches."""
    reg = fake.registry
    handle = reg.patch("alpha")
    other = threading.Thread(target=lambda: reg.unpatch("alpha"))
    other.start()
    other.join()  # another thread's unpatch() cannot take this thread's reference
    with handle:
        assert fake.mod.fn_a is _ours_a
    assert fake.pristine()


def test_threads_with_barrier_race_patch_and_unpatch(fake: Fake) -> None:
    reg = fake.registry
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def with_blocks() -> None:
        barrier.wait()
        for _ in range(300):
            handle = reg.patch("alpha")
            with handle:
                if fake.mod.fn_a is not _ours_a:
                    errors.append(AssertionError("with block ran unpatched"))

    def bare_cycles() -> None:
        barrier.wait()
        for _ in range(300):
            reg.patch("alpha")
            reg.unpatch("alpha")

    threads = [threading.Thread(target=with_blocks), threading.Thread(target=bare_cycles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert reg.status()["alpha"].refcount == 0 and fake.pristine()


def test_threads_balance(fake: Fake) -> None:
    reg = fake.registry
    barrier = threading.Barrier(8)
    seen: list[bool] = []

    def worker() -> None:
        barrier.wait()
        for _ in range(200):
            with reg.patch("alpha", "beta"):
                seen.append(fake.mod.fn_a is _ours_a and TABLE["present"] == "ours")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 1600 and all(seen)
    assert fake.pristine()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["patch", "unpatch", "with", "reuse", "release"]), max_size=12),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2**16),
)
def test_random_interleavings_restore_exact_originals(programs: list[list[str]], seed: int) -> None:
    monkeypatch = pytest.MonkeyPatch()
    try:
        fake = Fake(monkeypatch)
        reg = fake.registry
        barrier = threading.Barrier(len(programs))
        failures: list[str] = []

        def run(program: list[str], rng: random.Random) -> None:
            handles = []
            barrier.wait()
            for op in program:
                if op == "patch":
                    handles.append(reg.patch(*rng.sample(["alpha", "beta"], rng.randint(1, 2))))
                elif op == "unpatch":
                    reg.unpatch()
                elif op == "release" and handles:
                    handles.pop(rng.randrange(len(handles))).release()
                elif op in ("with", "reuse"):
                    handle = handles[-1] if op == "reuse" and handles else reg.patch("alpha")
                    with handle:
                        if "alpha" in handle.names and fake.mod.fn_a is not _ours_a:
                            failures.append("alpha held but not applied")
            for handle in handles:
                handle.release()
            reg.unpatch()  # this thread's own bare references, if any are left

        rngs = [random.Random(seed + i) for i in range(len(programs))]
        threads = [threading.Thread(target=run, args=(p, r)) for p, r in zip(programs, rngs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures
        assert all(p.refcount == 0 for p in reg.status().patches)
        assert fake.pristine()
    finally:
        monkeypatch.undo()


def test_release_more_than_acquired_is_refused(fake: Fake) -> None:
    with pytest.raises(RuntimeError, match="released more often than it was acquired"):
        fake.registry._release("alpha")
    assert fake.registry.status()["alpha"].refcount == 0


def test_patch_all_then_unpatch_all(fake: Fake) -> None:
    fake.registry.patch()
    assert fake.mod.fn_a is _ours_a and TABLE["present"] == "ours"
    fake.registry.unpatch()
    assert fake.pristine()


def test_unknown_name_lists_valid_names_and_applies_nothing(fake: Fake) -> None:
    with pytest.raises(ValueError, match="alpha, beta, gamma, delta"):
        fake.registry.patch("alpha", "pipeline")
    assert fake.pristine()
    with pytest.raises(ValueError, match="valid names"):
        fake.registry.unpatch("nope")
    with pytest.raises(ValueError, match="valid names"):
        fake.registry.patch("emulation")  # testing patches are applied only through hold()


def test_skips_are_reported_and_decided_once(fake: Fake) -> None:
    reg = fake.registry
    for _ in range(5):
        handle = reg.patch("gamma", "delta", "alpha")
        assert handle.names == ("alpha",)
        handle.release()
    report = reg.status()
    assert report["gamma"].skipped == "torch 9 already fixed it"
    assert (
        report["delta"].skipped is not None
        and "fake_torch_mod.not_there" in report["delta"].skipped
    )
    assert report["gamma"].state == report["delta"].state == "skipped"
    assert fake.plans == ["gamma", "alpha"]  # each plan probed once per process


def test_status_is_passive(fake: Fake) -> None:
    reg = fake.registry
    assert {p.state for p in reg.status().patches} == {"unplanned"}
    assert "not probed yet" in str(reg.status())
    assert fake.plans == []  # status() probed nothing


def test_status_is_structured_and_printable(fake: Fake) -> None:
    reg = fake.registry
    reg.patch("gamma").release()
    with reg.patch("alpha"):
        active = reg.status()["alpha"]
        assert active.active and active.refcount == 1
        assert [t.where for t in active.targets] == [
            "fake_torch_mod.fn_a",
            "fake_torch_reexport.fn_a",
            "fake_torch_mod.fn_b",
        ]
        assert all(t.state == "replaced" for t in active.targets)
        text = str(reg.status())
        assert "alpha: active (refcount 1)" in text
        assert "fake_torch_reexport.fn_a: replaced" in text
        assert "gamma: skipped: torch 9 already fixed it" in text
    idle = reg.status()["alpha"]
    assert idle.state == "idle" and [t.state for t in idle.targets] == ["planned"] * 3


def test_foreign_replacement_is_kept_warned_and_reported(fake: Fake) -> None:
    reg = fake.registry
    handle = reg.patch("alpha")
    fake.mod.fn_b = _theirs  # type: ignore[attr-defined]
    assert reg.status()["alpha"].targets[2].state == "conflict"
    with pytest.warns(PatchConflictWarning, match="fake_torch_mod.fn_b was replaced"):
        handle.release()
    assert fake.mod.fn_b is _theirs  # not clobbered
    assert fake.mod.fn_a is _original_a  # the rest restored
    conflicts = reg.status()["alpha"].conflicts
    assert len(conflicts) == 1 and "fn_b" in conflicts[0]
    assert "conflict:" in str(reg.status())
    fake.mod.fn_b = _original_b  # type: ignore[attr-defined]


def test_torch_object_put_back_by_hand_is_no_conflict(fake: Fake) -> None:
    handle = fake.registry.patch("alpha")
    fake.mod.fn_b = _original_b  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle.release()
    assert fake.pristine() and not fake.registry.status()["alpha"].conflicts


def test_foreign_patch_undone_out_of_order_recovers(fake: Fake) -> None:
    reg = fake.registry
    handle = reg.patch("alpha")
    fake.mod.fn_a = _theirs  # type: ignore[attr-defined]  # someone patches over gradsafe
    with pytest.warns(PatchConflictWarning):
        handle.release()
    fake.mod.fn_a = _ours_a  # type: ignore[attr-defined]  # ...and undoes theirs after ours
    # gradsafe's object is left behind, unpatched: it must still reach torch's function,
    assert reg.get_original("fake_torch_mod", "fn_a") is _original_a
    # and the next patch cycle must restore torch's object, not gradsafe's.
    with reg.patch("alpha"):
        assert fake.mod.fn_a is _ours_a
    assert fake.pristine()


def test_patch_over_foreign_patch_restores_theirs(fake: Fake) -> None:
    fake.mod.fn_a = _theirs  # type: ignore[attr-defined]
    with fake.registry.patch("alpha"):
        assert fake.registry.get_original("fake_torch_mod", "fn_a") is _theirs
    assert fake.mod.fn_a is _theirs
    fake.mod.fn_a = _original_a  # type: ignore[attr-defined]


def test_failed_apply_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    class Frozen(dict):  # a mapping whose writes fail midway through a plan
        def __setitem__(self, key: object, value: object) -> None:
            raise TypeError("read-only table")

    fake = Fake(monkeypatch)
    frozen = Frozen(present="upstream strategy")
    bad = Patch(
        "bad",
        "fails on its second slot",
        lambda: [
            AttrTarget("fake_torch_mod", "fn_a", _ours_a),
            ItemTarget("frozen", lambda: frozen, "present", "ours"),
        ],
    )
    reg = PatchRegistry([bad])
    with pytest.raises(TypeError, match="read-only"):
        reg.patch("bad")
    assert fake.pristine() and not reg.status()["bad"].active


def test_testing_patch_is_seen_by_get_original(fake: Fake) -> None:
    reg = fake.registry
    with reg.hold("emulation"):
        assert fake.mod.fn_b is _theirs
        assert reg.is_object_patched("fake_torch_mod", "fn_b")
        assert reg.get_original("fake_torch_mod", "fn_b") is _original_b
    assert fake.pristine()


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "meta"])
def test_plans_run_in_plain_torch_context(fake: Fake, context: str) -> None:
    import torch

    ctx = {
        "no_grad": torch.no_grad(),
        "inference_mode": torch.inference_mode(),
        "meta": torch.device("meta"),
    }
    with ctx[context]:
        fake.registry.patch("alpha").release()
    assert fake.contexts == [(True, False, "cpu")]


# -- the real registry -------------------------------------------------------------------


def _run(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "meta"])
def test_real_patches_plan_under_user_contexts(context: str) -> None:
    import torch

    from gradsafe import capabilities

    # A fresh registry over the real patches, so each context probes anew.
    reg = PatchRegistry([capabilities.PIPELINING, capabilities.DTENSOR, capabilities.CUDA_GRAPHS])
    ctx = {
        "no_grad": torch.no_grad(),
        "inference_mode": torch.inference_mode(),
        "meta": torch.device("meta"),
    }
    with ctx[context]:
        handle = reg.patch()
    try:
        report = reg.status()
        assert report["pipelining"].active and report["cuda_graphs"].active, report
        assert report["dtensor"].state in ("active", "skipped"), report
        if report["dtensor"].skipped is not None:
            assert report["dtensor"].skipped.startswith("verified"), report
    finally:
        handle.release()


def test_real_patch_under_python_O() -> None:
    code = (
        "import gradsafe\n"
        "assert not __debug__\n"
        "with gradsafe.patch('pipelining'):\n"
        "    import torch.distributed.pipelining.stage as stage\n"
        "    import gradsafe.pipelining as ours\n"
        "    if stage.stage_backward_weight is not ours.stage_backward_weight:\n"
        "        raise SystemExit('pipelining patch not applied under -O')\n"
    )
    proc = _run(code, "-O")
    assert proc.returncode == 0, proc.stderr


def test_import_and_status_have_no_side_effects() -> None:
    code = (
        "import sys\n"
        "import gradsafe\n"
        "assert 'torch' not in sys.modules, 'import gradsafe imported torch'\n"
        "caps = [m for m in sys.modules if m.startswith('gradsafe.')]\n"
        "assert all(m.startswith(('gradsafe.capabilities', 'gradsafe.patching')) for m in caps), caps\n"
        "before = set(sys.modules)\n"
        "report = gradsafe.status()\n"
        "str(report)\n"
        "assert set(sys.modules) == before, set(sys.modules) - before\n"
        "assert {p.state for p in report.patches} == {'unplanned'}, report\n"
        "import torch, torch.distributed.pipelining._backward as b, torch.cuda\n"
        "assert b.stage_backward_weight.__module__.startswith('torch'), 'patched at import'\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr


def test_real_patch_names() -> None:
    assert gradsafe.patch_names() == ("pipelining", "dtensor", "cuda_graphs")


def test_emulation_is_in_the_registry() -> None:
    import torch

    from gradsafe.testing import emulate_cuda_graphs

    with emulate_cuda_graphs():
        assert gradsafe.is_object_patched("torch.cuda.graphs", "CUDAGraph")
        assert (
            gradsafe.get_original("torch.cuda.graphs", "CUDAGraph")
            is not torch.cuda.graphs.CUDAGraph
        )
        assert gradsafe.status()["cuda_graphs_emulation"].active
    assert not gradsafe.is_object_patched("torch.cuda.graphs", "CUDAGraph")
