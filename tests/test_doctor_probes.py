"""The doctor names the newest torch gradsafe was tested on, the probes of torch internals
that passed, and the fallbacks in force (issue 36, "torch 2.16")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch.utils.checkpoint as cp

from gradsafe import _torch_support, doctor
from gradsafe.checks import Outcome
from gradsafe.pipelining._torch import _probe

_ROW = doctor.Row("h", "pipelining", "installed torch", Outcome(False, ""), Outcome(True, ""), 0)


def _report(version: str, probes: tuple[doctor.ProbeResult, ...] = ()) -> doctor.Report:
    plans = (doctor.PatchPlan("pipelining", ("a.b",), None), doctor.PatchPlan("dtensor", (), "why"))
    return doctor.Report(version, "cpu", (_ROW,), plans, probes)


@pytest.mark.parametrize(
    ("version", "newer"),
    [
        ("2.15.0", False),
        ("2.15.1+cu128", False),
        ("2.11.0", False),
        ("2.16.0", True),
        ("2.16.0.dev20261201+cpu", True),
        ("3.0.0", True),
        ("unknown", False),
    ],
)
def test_the_report_says_when_torch_is_newer_than_any_tested_release(
    version: str, newer: bool
) -> None:
    report = _report(version)
    assert report.newer_than_tested is newer
    said = "newer than 2.15, the newest release gradsafe was tested on" in report.render()
    assert said is newer
    assert report.as_json()["newer_than_tested"] is newer
    assert report.as_json()["newest_tested_torch"] == "2.15"


def test_the_newest_tested_release_is_one_constant_the_supported_range_ends_at() -> None:
    newest = ".".join(map(str, _torch_support.NEWEST_TESTED_TORCH))
    assert doctor.NEWEST_TESTED == newest
    assert _torch_support.SUPPORTED_TORCH.endswith(f"-{newest}")


def test_probes_that_passed_and_fallbacks_in_force_are_named() -> None:
    probes = (
        doctor.ProbeResult("pipelining", "fine probe", None, "unused"),
        doctor.ProbeResult(
            "pipelining", "IN_W probe", "handles dropped otherwise", "IN_W runs as IN_B"
        ),
    )
    report = _report("2.16.0", probes)
    text = report.render()
    assert "passed: pipelining: fine probe" in text
    assert "IN_W probe: DIFFERS (handles dropped otherwise); fallback: IN_W runs as IN_B" in text
    fallbacks = text.split("Fallbacks in force:")[1]
    assert "IN_W runs as IN_B (handles dropped otherwise)" in fallbacks
    assert "dtensor: patch skipped (why)" in fallbacks
    data = report.as_json()
    assert [p["passed"] for p in data["probes"]] == [True, False]  # type: ignore[index]
    assert len(data["fallbacks"]) == 2  # type: ignore[arg-type]


def test_no_fallback_is_said_as_none() -> None:
    report = doctor.Report("2.13.0", "cpu", (_ROW,), (doctor.PatchPlan("p", ("a",), None),))
    assert "Fallbacks in force: none" in report.render()


@pytest.fixture
def fresh_probes() -> Iterator[None]:
    _probe.unpack_twice_unsupported.cache_clear()
    yield
    _probe.unpack_twice_unsupported.cache_clear()


def test_the_doctor_runs_the_checkpoint_probes_on_the_installed_torch() -> None:
    results = doctor._probes(["pipelining"])
    assert [r.name for r in results if r.passed] == [r.name for r in results]
    assert any("IN_W" in r.name for r in results)


def test_the_doctor_names_in_ws_fallback_on_a_torch_whose_holders_drop_otherwise(
    monkeypatch: pytest.MonkeyPatch, fresh_probes: None
) -> None:
    class Holder(cp._Holder):  # type: ignore[misc, name-defined]
        """A holder whose handles are deleted at unpack (never set to None)."""

        @property  # type: ignore[misc]
        def handles(self) -> dict[Any, Any]:
            return self._h

        @handles.setter
        def handles(self, value: dict[Any, Any]) -> None:
            self._h = _Popping(value)

    monkeypatch.setattr(cp, "_Holder", Holder)
    (in_w,) = [r for r in doctor._probes(["pipelining"]) if r.name.startswith("IN_W")]
    assert not in_w.passed
    report = _report(doctor.torch.__version__, (in_w,))
    assert (
        "CheckpointedWeights.IN_W runs as IN_B" in report.render().split("Fallbacks in force:")[1]
    )
    json.dumps(report.as_json())


class _Popping(dict[Any, Any]):
    def __setitem__(self, key: Any, value: Any) -> None:
        if value is None:
            self.pop(key, None)
        else:
            dict.__setitem__(self, key, value)
