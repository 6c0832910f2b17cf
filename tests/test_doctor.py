"""The doctor framework: rows, verdicts, crash capture, JSON and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from gradsafe import doctor, patching
from gradsafe.doctor import Check, Outcome, patched_check
from gradsafe.patching import AttrTarget, Patch, Skip


def _raise() -> Outcome:
    raise RuntimeError("Trying to backward through the graph a second time\nmore text")


@pytest.fixture
def fake_checks(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType("fake_checks")
    mod.CHECKS = (  # type: ignore[attr-defined]
        Check("fine", "alpha", lambda: Outcome(True, ""), lambda: Outcome(True, "")),
        Check("crashy", "alpha", _raise, lambda: Outcome(True, "same grads")),
        Check("other", "beta", lambda: Outcome(False, "2x"), lambda: Outcome(True, "")),
    )
    monkeypatch.setitem(sys.modules, "fake_checks", mod)
    monkeypatch.setattr(doctor, "_CHECK_MODULES", ("fake_checks",))
    return mod


def test_crash_is_a_finding_and_verdict_follows_gradsafe_column(
    fake_checks: types.ModuleType,
) -> None:
    report = doctor.run()
    assert [r.hazard for r in report.rows] == ["fine", "crashy", "other"]
    crash = report.rows[1].upstream
    assert crash.correct is False
    assert crash.detail == "crash: RuntimeError: Trying to backward through the graph a second time"
    assert report.ok
    assert "gradsafe removes every hazard above" in str(report)


def test_only_selects_capabilities(fake_checks: types.ModuleType) -> None:
    assert [r.hazard for r in doctor.run(["beta"]).rows] == ["other"]


def test_a_wrong_or_unmeasured_gradsafe_row_fails_the_report(
    fake_checks: types.ModuleType,
) -> None:
    fake_checks.CHECKS += (Check("bad", "alpha", _raise, _raise),)
    report = doctor.run()
    assert not report.ok and "NOT OK" in str(report)
    fake_checks.CHECKS = (Check("pending", "alpha", lambda: Outcome(None, "x"), lambda: Outcome(None, "x")),)
    assert not doctor.run().ok


def test_json_is_complete(fake_checks: types.ModuleType) -> None:
    data = json.loads(json.dumps(doctor.run().as_json()))
    assert data["ok"] is True and data["torch"]
    assert data["rows"][1]["upstream"]["correct"] is False
    assert set(data["rows"][0]) == {"hazard", "capability", "upstream", "gradsafe", "seconds"}


def _value() -> str:
    return "upstream"


def test_patched_check_runs_upstream_then_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("fake_target")
    mod.value = _value  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_target", mod)
    fixed = Patch("alpha", "fix", lambda: [AttrTarget("fake_target", "value", lambda: "fixed")])
    noop = Patch("beta", "no-op", lambda: Skip("verified: upstream already right"))
    monkeypatch.setattr(patching, "_CAPABILITY_MODULES", {"alpha": "", "beta": ""})
    monkeypatch.setattr(patching, "_ENTRIES", {p.name: patching.Patcher(p) for p in (fixed, noop)})
    monkeypatch.setattr(patching, "_HANDLES", [])

    def repro() -> Outcome:
        got = mod.value()
        return Outcome(got != "upstream", got)

    check = patched_check("h", "alpha", "alpha", repro)
    assert check.upstream() == Outcome(False, "upstream")
    assert check.gradsafe() == Outcome(True, "fixed")
    assert mod.value is _value
    with patching.patch("alpha"):  # upstream cannot be measured while patched
        assert check.upstream().correct is None
    skipped = patched_check("h", "beta", "beta", repro).gradsafe()
    assert skipped.correct is False  # a skipped patch is still measured, not assumed right
    assert "patch skipped: verified: upstream already right" in skipped.detail


def test_cli_json_exit_code_matches_verdict() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gradsafe", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(proc.stdout)
    assert {row["capability"] for row in data["rows"]} == {
        "pipelining",
        "dtensor",
        "cuda_graphs",
        "wgrad",
    }
    assert proc.returncode == (0 if data["ok"] else 1), proc.stderr


def test_cli_status_lists_every_patch() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gradsafe", "status"], capture_output=True, text=True, check=True
    )
    for name in patching.patch_names():
        assert proc.stdout.count(f"{name}:") >= 1


def test_runs_without_numpy() -> None:
    """numpy is not a dependency of torch or gradsafe: patching and the doctor must not need it."""
    code = (
        "import sys, json\n"
        "sys.modules['numpy'] = None  # makes `import numpy` fail\n"
        "import gradsafe\n"
        "with gradsafe.patch():\n"
        "    pass\n"
        "from gradsafe import doctor\n"
        "report = doctor.run()\n"
        "print(json.dumps(report.as_json()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.splitlines()[-1])["rows"]
    crashed = [r["hazard"] for r in rows if "No module named 'numpy'" in r["gradsafe"]["detail"]]
    assert not crashed
    assert all(r["gradsafe"]["correct"] for r in rows), rows
