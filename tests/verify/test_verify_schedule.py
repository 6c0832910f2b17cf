"""``gradsafe verify --schedule``: torch's real schedules on 2 gloo ranks agree with the single-process mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _factories import four_prefix_stages
from _ranks import worker_env

from gradsafe.verify import verify
from gradsafe.verify._schedule import ScheduleReport, verify_schedule

HERE = Path(__file__).parent
SPEC = "_factories:four_prefix_stages"


def _skip_if_gloo_cannot_run_v_shapes(results: dict[str, dict[str, dict[str, str]]]) -> None:
    for per in results.values():
        for result in per.values():
            if "Pair is not connected" in result["message"]:
                pytest.skip(
                    f"this torch cannot run a V-shaped schedule on gloo: {result['message'][:200]}"
                )


def _single_process_wrong() -> set[str]:
    report = verify(*four_prefix_stages())
    assert report.ok, str(report)
    return {p for r in report.upstream.values() for p in r.params}


def _check_agrees(data: dict, wrong_in_one_process: set[str]) -> None:  # type: ignore[type-arg]
    _skip_if_gloo_cannot_run_v_shapes(data["results"])
    assert data["ok"], data
    assert {r["verdict"] for r in data["results"]["gradsafe"].values()} == {"right"}
    wrong_on_ranks = {p for r in data["results"]["upstream"].values() for p in r["params"]}
    assert wrong_in_one_process == {"1.prefix", "2.prefix"}
    assert wrong_on_ranks == wrong_in_one_process


@pytest.mark.distributed
def test_zbv_on_two_gloo_ranks_agrees_with_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(HERE)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsafe",
            "verify",
            SPEC,
            "--schedule",
            "ZBVZeroBubble",
            "--ranks",
            "2",
            "--json",
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.stdout, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    _check_agrees(data, _single_process_wrong())
    assert proc.returncode == 0, proc.stderr


@pytest.mark.distributed
def test_dualpipev_on_two_gloo_ranks_agrees_with_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(HERE)
    report = verify_schedule(SPEC, "DualPipeV", 2)
    assert isinstance(report, ScheduleReport)
    _check_agrees(report.to_json(), _single_process_wrong())
    assert "rank" in str(report) and "OK" in str(report)


def test_schedule_refuses_parameters_whose_gradient_a_hook_consumed() -> None:
    # The ranks report .grad only: None against None would pass whatever the step was.
    with pytest.raises(ValueError, match=r"0\.0\.weight.*kept no \.grad.*without --schedule"):
        verify_schedule("_factories:stepped_in_backward", "ZBVZeroBubble", 2)


@pytest.mark.distributed
def test_schedule_reference_runs_the_hooks_the_factory_puts_on_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(HERE)
    # A deep copy drops parameter hooks: the reference must be built as the ranks build it.
    report = verify_schedule("_factories:doubled_by_hooks", "ZBVZeroBubble", 2)
    _skip_if_gloo_cannot_run_v_shapes(report.to_json()["results"])
    assert report.ok, str(report)
    assert {r.verdict for r in report.results["upstream"].values()} == {"right"}, str(report)


def test_a_gradsafe_rank_refuses_when_the_pipelining_patch_does_not_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A skipped patch leaves torch's own split in place: the column that reports
    # gradsafe's split must not report torch's.
    import dataclasses

    import gradsafe
    from gradsafe.verify._worker import apply_gradsafe

    skipped = dataclasses.replace(
        gradsafe.status()["pipelining"], state="skipped", refcount=0, skipped="probe failed: X"
    )
    monkeypatch.setattr(gradsafe, "patch", lambda *names: None)
    monkeypatch.setattr(gradsafe, "status", lambda: {"pipelining": skipped})
    with pytest.raises(RuntimeError, match=r"is skipped .*\(probe failed: X\).*torch's own split"):
        apply_gradsafe()


@pytest.mark.distributed
def test_schedule_reports_torchs_split_wrong_on_a_tied_v_and_gradsafes_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # H7: rank 0 of ZBV holds the embedding and the head tied to it; torch's step
    # (scale_grads=True, as users run it) divides the shared table once per stage.
    monkeypatch.chdir(HERE)
    report = verify_schedule("_factories:tied_v", "ZBVZeroBubble", 2)
    _skip_if_gloo_cannot_run_v_shapes(report.to_json()["results"])
    assert report.ok, str(report)
    assert report.results["upstream"][0].verdict == "WRONG", str(report)
    assert set(report.results["upstream"][0].params) == {"0.table", "3.table"}
    assert report.results["upstream"][1].verdict == "right", str(report)


@pytest.mark.distributed
def test_schedule_reports_torchs_first_step_wrong_on_a_loss_that_runs_a_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # H6: the first step's metadata inference runs the loss (and its inner backward)
    # on garbage, which lands in the head's gradient under torch; not under gradsafe.
    monkeypatch.chdir(HERE)
    report = verify_schedule("_factories:backward_in_loss", "ZBVZeroBubble", 2)
    _skip_if_gloo_cannot_run_v_shapes(report.to_json()["results"])
    assert report.ok, str(report)
    assert report.results["upstream"][0].params == ("3.head.weight",), str(report)
