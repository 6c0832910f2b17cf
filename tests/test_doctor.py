"""The doctor: rows from the capability table, verdicts, crash capture, JSON, CLI and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from gradsafe import capabilities, doctor
from gradsafe.capabilities import Capability
from gradsafe.checks import Check, Outcome, patched_check
from gradsafe.patching import AttrTarget, Patch, PatchRegistry, Skip

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke

_LONG = "Trying to backward through the graph a second time " + "x" * 300


def _raise() -> Outcome:
    raise RuntimeError(f"{_LONG}\nmore text")


@pytest.fixture
def fake_table(monkeypatch: pytest.MonkeyPatch) -> list[Check]:
    alpha: list[Check] = [
        Check("fine", "pipelining", lambda: Outcome(True, ""), lambda: Outcome(True, "")),
        Check("crashy", "pipelining", _raise, lambda: Outcome(True, "same grads")),
    ]
    beta = [
        Check(
            "other",
            "wgrad",
            lambda: Outcome(False, "2x"),
            lambda: Outcome(True, ""),
            upstream_source="model of another library's policy",
        ),
    ]
    table = (
        Capability("pipelining", None, lambda: tuple(alpha)),
        Capability("wgrad", None, lambda: tuple(beta)),
    )
    monkeypatch.setattr(capabilities, "CAPABILITIES", table)
    monkeypatch.setattr(doctor, "REGISTRY", PatchRegistry([]))
    return alpha


def test_crash_is_a_finding_and_verdict_follows_gradsafe_column(fake_table: list[Check]) -> None:
    report = doctor.run()
    assert [r.hazard for r in report.rows] == ["fine", "crashy", "other"]
    crash = report.rows[1].upstream
    assert crash.correct is False
    assert crash.detail == f"crash: RuntimeError: {_LONG}"  # the whole first line, never cut
    assert report.ok
    assert "gradsafe removes every hazard above" in str(report)


def test_only_selects_capabilities_and_refuses_unknown_names(fake_table: list[Check]) -> None:
    assert [r.hazard for r in doctor.run(["wgrad"]).rows] == ["other"]
    with pytest.raises(ValueError, match="unknown capability 'dtensr'; valid: pipelining, wgrad"):
        doctor.run(["dtensr"])


def test_a_wrong_unmeasured_or_empty_report_is_not_ok(fake_table: list[Check]) -> None:
    fake_table.append(Check("bad", "pipelining", _raise, _raise))
    report = doctor.run()
    assert not report.ok and "NOT OK" in str(report)
    fake_table[:] = [
        Check("pending", "pipelining", lambda: Outcome(None, "x"), lambda: Outcome(None, "x"))
    ]
    assert not doctor.run().ok
    fake_table.clear()
    assert not doctor.run(["pipelining"]).ok  # no row ran: nothing was shown right


def test_json_is_complete(fake_table: list[Check]) -> None:
    data = json.loads(json.dumps(doctor.run().as_json()))
    assert data["ok"] is True and data["torch"]
    assert data["rows"][1]["upstream"]["detail"].endswith("x" * 300)
    assert set(data["rows"][0]) == {
        "hazard",
        "capability",
        "upstream_source",
        "upstream",
        "gradsafe",
        "seconds",
        "note",
        "hazard_here",
    }
    assert [row["hazard_here"] for row in data["rows"]] == [False, True, True]
    assert data["rows"][2]["upstream_source"] == "model of another library's policy"


def test_table_fits_the_width_and_labels_modelled_upstreams(fake_table: list[Check]) -> None:
    report = doctor.run()
    narrow = report.render(100)
    assert max(len(line) for line in narrow.splitlines() if " | " in line) <= 100
    assert "--json" in narrow  # cut cells point to the whole text
    assert "*WRONG: 2x" in narrow
    assert "* upstream column: model of another library's policy" in narrow
    wide = report.render(None)
    assert _LONG in wide


def test_rows_right_upstream_are_not_a_hazard_here_and_not_counted(
    fake_table: list[Check],
) -> None:
    report = doctor.run()
    assert [r.hazard_here for r in report.rows] == [False, True, True]
    fine_row = next(line for line in str(report).splitlines() if line.startswith("fine "))
    assert "right, not a hazard here" in fine_row
    assert "not a hazard here" not in "".join(
        line for line in str(report).splitlines() if line.startswith(("crashy", "other"))
    )
    assert "2 on this torch; 1 row not a hazard here" in str(report)


def test_closing_lines_give_the_next_step(fake_table: list[Check]) -> None:
    closing = str(doctor.run()).split("gradsafe removes every hazard above")[1]
    assert "with gradsafe.patch(): train()" in closing
    assert "gradsafe verify PACKAGE.MODULE:FACTORY" in closing
    assert "docs/troubleshooting.md" in closing
    fake_table.append(Check("bad", "pipelining", _raise, _raise))
    failed = str(doctor.run())
    assert "NOT OK" in failed and "docs/troubleshooting.md" in failed
    assert "gradsafe verify" not in failed  # no next step on a torch gradsafe gets wrong


def test_patch_slots_are_counted_and_listed_only_verbose() -> None:
    slots = ("torch.distributed.pipelining._backward.stage_backward_input", "torch.x.y")
    plans = (doctor.PatchPlan("pipelining", slots, None), doctor.PatchPlan("dtensor", (), "why"))
    row = doctor.Row("h", "pipelining", "installed torch", Outcome(False, ""), Outcome(True, ""), 0)
    report = doctor.Report("2.x", "cpu", (row,), plans)
    assert slots[0] not in report.render()
    assert "pipelining: replaces 2 torch slots" in report.render()
    assert "dtensor: skipped: why" in report.render()
    assert all(slot in report.render(verbose=True) for slot in slots)
    assert report.as_json()["patches"][0]["replaces"] == slots  # --json keeps them whole


def _value() -> str:
    return "upstream"


def test_patched_check_runs_upstream_then_patched(
    monkeypatch: pytest.MonkeyPatch, fresh_registry: PatchRegistry
) -> None:
    mod = types.ModuleType("fake_target")
    mod.value = _value  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_target", mod)
    fixed = Patch("alpha", "fix", lambda: [AttrTarget("fake_target", "value", lambda: "fixed")])
    noop = Patch("beta", "no-op", lambda: Skip("verified: upstream already right"))
    registry = fresh_registry
    registry.register(fixed, noop)

    def repro() -> Outcome:
        got = mod.value()
        return Outcome(got != "upstream", got)

    check = patched_check("h", "alpha", "alpha", repro)
    assert check.upstream() == Outcome(False, "upstream")
    assert check.gradsafe() == Outcome(True, "fixed")
    assert mod.value is _value
    with registry.patch("alpha"):  # upstream cannot be measured while patched
        assert check.upstream().correct is None
    skipped = patched_check("h", "beta", "beta", repro).gradsafe()
    assert skipped.correct is False  # a skipped patch is still measured, not assumed right
    assert "patch skipped: verified: upstream already right" in skipped.detail


def _cli(*args: str, numpy: bool = True) -> subprocess.CompletedProcess[str]:
    # None in sys.modules is numpy absent as importlib sees it: find_spec() returns None
    # (torch._dynamo asks it) and an import raises ModuleNotFoundError.
    prelude = "" if numpy else "import sys; sys.modules['numpy'] = None; "
    code = prelude + "import sys; from gradsafe.__main__ import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )


def test_cli_json_exit_code_matches_verdict_and_lists_patches() -> None:
    proc = _cli("doctor", "--json")
    data = json.loads(proc.stdout)
    assert {row["capability"] for row in data["rows"]} == {
        "pipelining",
        "dtensor",
        "cuda_graphs",
        "wgrad",
    }
    assert [p["name"] for p in data["patches"]] == ["pipelining", "dtensor", "cuda_graphs"]
    assert proc.returncode == (0 if data["ok"] else 1), proc.stderr


def test_cli_refuses_unknown_capability_and_lists_valid_ones() -> None:
    proc = _cli("doctor", "--only", "dtensr")
    assert proc.returncode == 2
    assert "invalid choice: 'dtensr'" in proc.stderr and "wgrad" in proc.stderr


def test_cli_help_and_version_are_plain_text() -> None:
    import gradsafe

    for args in (("--help",), ("doctor", "--help")):
        proc = _cli(*args)
        assert proc.returncode == 0 and "``" not in proc.stdout and ":func:" not in proc.stdout
    listed = " ".join(_cli("doctor", "--help").stdout.split())
    assert "pipelining, dtensor, cuda_graphs, wgrad" in listed
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"gradsafe {gradsafe.__version__}"


@pytest.mark.parametrize("command", ["doctor", "verify"])
def test_a_subcommands_usage_error_shows_that_subcommands_usage(command: str) -> None:
    proc = _cli(command, "--bogus")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"usage: gradsafe {command} "), proc.stderr
    assert f"gradsafe {command}: error: unrecognized arguments: --bogus" in proc.stderr


def test_cli_verbose_lists_the_torch_slots_replaced() -> None:
    proc = _cli("doctor", "--only", "cuda_graphs", "--verbose")
    assert "torch.cuda.graphs.make_graphed_callables" in proc.stdout, proc.stdout + proc.stderr


def test_cli_without_a_command_prints_the_help_and_exits_2() -> None:
    proc = _cli()
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.startswith("usage: gradsafe") and "doctor" in proc.stdout
    assert "exits with status 2" in " ".join(proc.stdout.split())


def test_only_lists_the_selected_capabilities_patches(fake_table: list[Check]) -> None:
    registry = PatchRegistry(
        [Patch(name, "", lambda: Skip("not here")) for name in ("pipelining", "dtensor")]
    )
    doctor.REGISTRY = registry  # fake_table's monkeypatch restores it
    assert [p.name for p in doctor.run(["pipelining"]).patches] == ["pipelining"]
    assert [p.name for p in doctor.run().patches] == ["pipelining", "dtensor"]
    text = doctor.run(["wgrad"]).render()
    section = text.split("Patches on this torch")[1]
    assert (
        "pipelining" not in section and "none: the selected capabilities have no patch" in section
    )


def test_cli_only_shows_only_that_capabilitys_patches() -> None:
    proc = _cli("doctor", "--only", "dtensor", numpy=False)
    section = proc.stdout.split("Patches on this torch")[1]
    assert "  dtensor: " in section, proc.stdout
    assert "pipelining" not in section and "cuda_graphs" not in section
    assert "NumPy" not in proc.stderr and "numpy" not in proc.stdout.lower(), proc.stderr


def test_runs_without_numpy_and_says_nothing_about_it() -> None:
    """numpy is not a dependency of torch or gradsafe: patching and the doctor must not need it."""
    proc = _cli("doctor", "--json", numpy=False)
    assert "NumPy" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    crashed = [r["hazard"] for r in data["rows"] if "numpy" in r["gradsafe"]["detail"].lower()]
    assert not crashed
    assert data["ok"], data["rows"]


def test_status_marks_the_testing_patch_patch_does_not_take() -> None:
    import gradsafe

    status = gradsafe.status()
    testing = [p.name for p in status.patches if p.testing]
    assert testing == ["cuda_graphs_emulation"]
    assert not set(testing) & set(gradsafe.patch_names())
    assert "cuda_graphs_emulation (gradsafe.testing, not a patch() name):" in str(status)


def test_a_checks_note_on_its_upstream_figure_is_printed_under_the_table(
    fake_table: list[Check],
) -> None:
    fake_table.append(
        Check(
            "varies",
            "pipelining",
            lambda: Outcome(False, "0.4 off"),
            lambda: Outcome(True, ""),
            note="it varies",
        )
    )
    assert "varies: it varies" in str(doctor.run())


def test_the_h6_row_says_its_figure_varies_because_the_memory_is_uninitialised() -> None:
    from gradsafe.pipelining._hazards import CHECKS

    (h6,) = [c for c in CHECKS if c.hazard.startswith("H6")]
    assert "changes from run to run" in h6.note and "never initialised" in h6.note


def test_docs_are_named_by_url_or_source_distribution_without_a_checkout(
    fake_table: list[Check], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from gradsafe._shared import doc_links

    monkeypatch.setattr(doc_links, "_CHECKOUT_DOCS", tmp_path)  # a wheel install: no docs/
    assert doc_links.doc("verify.md").startswith("docs/verify.md of gradsafe's source")
    monkeypatch.setattr(
        doc_links, "_project_urls", lambda: {"source": "https://example.org/gradsafe"}
    )
    closing = str(doctor.run()).split("Next:")[1]
    assert "https://example.org/gradsafe/blob/main/docs/troubleshooting.md" in closing
    assert "https://example.org/gradsafe/blob/main/docs/verify.md" in closing
