"""``gradsafe verify --schedule``: torch's real schedules on 2 gloo ranks agree with the single-process mode."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _factories import four_prefix_stages
from _ranks import worker_env

from gradsafe.__main__ import main
from gradsafe.verify import VerifyReport, _schedule, verify
from gradsafe.verify._run import RunResult
from gradsafe.verify._schedule import verify_schedule

HERE = Path(__file__).parent
SPEC = "_factories:four_prefix_stages"


def _skip_if_gloo_cannot_run_v_shapes(data: dict[str, Any]) -> None:
    for per in (data["gradsafe"], data["upstream"]):
        for result in per.values():
            if "Pair is not connected" in result["message"]:
                pytest.skip(
                    f"this torch cannot run a V-shaped schedule on gloo: {result['message'][:200]}"
                )


def _single_process_wrong() -> set[str]:
    report = verify(*four_prefix_stages())
    assert report.ok, str(report)
    return {p for r in report.upstream.values() for p in r.params}


def _check_agrees(data: dict[str, Any], wrong_in_one_process: set[str]) -> None:
    _skip_if_gloo_cannot_run_v_shapes(data)
    assert data["ok"], data
    assert data["format"] == "gradsafe.verify/3" and data["mode"] == "schedule"
    assert data["checks"] == ["rank 0", "rank 1"] and data["ranks"] == 2
    assert {r["verdict"] for r in data["gradsafe"].values()} == {"exact"}
    wrong_on_ranks = {p for r in data["upstream"].values() for p in r["params"]}
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
    assert isinstance(report, VerifyReport) and report.schedule == "DualPipeV"
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
    _skip_if_gloo_cannot_run_v_shapes(report.to_json())
    assert report.ok, str(report)
    assert {r.verdict for r in report.upstream.values()} == {"right"}, str(report)


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
    _skip_if_gloo_cannot_run_v_shapes(report.to_json())
    assert report.ok, str(report)
    assert report.upstream["rank 0"].verdict == "WRONG", str(report)
    assert set(report.upstream["rank 0"].params) == {"0.table", "3.table"}
    assert report.upstream["rank 1"].verdict == "right", str(report)


@pytest.mark.distributed
def test_schedule_reports_torchs_first_step_wrong_on_a_loss_that_runs_a_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # H6: the first step's metadata inference runs the loss (and its inner backward)
    # on garbage, which lands in the head's gradient under torch; not under gradsafe.
    monkeypatch.chdir(HERE)
    report = verify_schedule("_factories:backward_in_loss", "ZBVZeroBubble", 2)
    _skip_if_gloo_cannot_run_v_shapes(report.to_json())
    assert report.ok, str(report)
    assert report.upstream["rank 0"].params == ("3.head.weight",), str(report)


def _rank_outputs(**grads: float) -> dict[str, Any]:
    return {"grads": {name: torch.full((2,), value) for name, value in grads.items()}}


def _schedule_report(gradsafe_outs: list[dict[str, Any]]) -> VerifyReport:
    """A ZBV report on 2 ranks from made-up rank outputs (no gloo): stage s holds ``s.w``."""
    reference = RunResult(
        params={f"{s}.w": torch.ones(2) for s in range(4)} | {"loss.t": torch.ones(1)},
        shapes={f"{s}.w": (2,) for s in range(4)} | {"loss.t": (1,)},
        inputs={},
        counts=collections.Counter(),
    )
    right = [_rank_outputs(**{"0.w": 1, "3.w": 1}), _rank_outputs(**{"1.w": 1, "2.w": 1})]
    upstream = [_rank_outputs(**{"0.w": 0.5, "3.w": 1}), right[1]]
    outs = {"gradsafe": gradsafe_outs, "upstream": upstream}
    return _schedule._report(reference, outs, "ZBVZeroBubble", 2, torch.float64, 4)


def test_the_schedule_report_is_the_one_report_keyed_by_rank_with_its_own_fields() -> None:
    report = _schedule_report(
        [_rank_outputs(**{"0.w": 1, "3.w": 1}), _rank_outputs(**{"1.w": 1, "2.w": 1})]
    )
    assert isinstance(report, VerifyReport) and report.ok and not report.refused_only
    assert report.mode == "schedule" and report.checks == ("rank 0", "rank 1")
    assert report.orders == () and report.unsplit_stages == () and report.not_seen is None
    assert report.upstream["rank 0"].verdict == "WRONG" and report.upstream["rank 0"].params == (
        "0.w",
    )
    # Each rank's parameters are rows of the same GradRow type (a loss's own are not sent back).
    rows = {r.name: r for r in report.grads}
    assert set(rows) == {"0.w", "1.w", "2.w", "3.w"}
    assert rows["0.w"].errors == {"gradsafe": {"rank 0": 0.0}, "upstream": {"rank 0": 0.5}}
    assert rows["0.w"].fused_max == 1.0 and rows["0.w"].shape == (2,)
    data = report.to_json()
    assert data["format"] == "gradsafe.verify/3" and data["schedule"] == "ZBVZeroBubble"
    assert data["ranks"] == 2 and data["stages"] == 4 and data["microbatches"] == 4
    assert data["hooks"] is None and data["hazards"] is None and data["not_seen"] is None
    assert data["gradsafe"]["rank 1"]["verdict"] == "exact"
    text = str(report)
    assert text.startswith("gradsafe verify --schedule ZBVZeroBubble: 2 gloo ranks, float64")
    assert "WRONG 0.w" in text and "Hooks" not in text and "Not seen in one process" not in text
    assert text.endswith("OK: every rank's gradients equal the reference.")


def test_a_refusal_on_one_rank_is_the_reports_refusal_and_its_peers_crash_is_exit_2() -> None:
    refusal = (
        "SplitBackwardError: a reentrant checkpoint on the input side; use use_reentrant=False"
    )
    report = _schedule_report([{"crash": refusal}, {"crash": "RuntimeError: Connection closed"}])
    assert report.gradsafe["rank 0"].verdict == "refused"
    assert report.gradsafe["rank 1"].verdict == "crash"
    assert report.refused == refusal.removeprefix("SplitBackwardError: ")
    assert not report.ok and report.refused_only  # the command line's exit 2
    assert "gradsafe refuses this model: a reentrant checkpoint" in str(report)


def test_a_wrong_rank_is_not_ok_and_not_a_refusal() -> None:
    report = _schedule_report(
        [_rank_outputs(**{"0.w": 1, "3.w": 2}), _rank_outputs(**{"1.w": 1, "2.w": 1})]
    )
    assert report.gradsafe["rank 0"].verdict == "WRONG" and report.gradsafe["rank 0"].params == (
        "3.w",
    )
    assert not report.ok and not report.refused_only  # the command line's exit 1
    assert str(report).endswith("NOT OK.")


@pytest.mark.distributed
def test_the_h7_hint_under_two_tied_stages_names_a_command_that_runs_them_on_one_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(HERE)
    assert main(["verify", "_factories:tied_v_one_rank", "--orders", "w-after-b"]) == 0
    hinted = re.search(r"`python -m gradsafe verify (.*?)`", capsys.readouterr().out)
    assert hinted is not None
    args = hinted.group(1).split()
    assert args == ["_factories:tied_v_one_rank", "--schedule", "ZBVZeroBubble", "--ranks", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "gradsafe", "verify", *args, "--json"],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.stdout, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    _skip_if_gloo_cannot_run_v_shapes(data)
    assert proc.returncode == 0 and data["ranks"] == 1, data
    # H7: the tied table, divided once per stage of the one rank, partly before the other's B.
    assert data["upstream"]["rank 0"]["verdict"] == "WRONG"


def test_interleaved_1f1b_on_one_rank_is_offered(capsys: pytest.CaptureFixture[str]) -> None:
    # Accepted: the run gets as far as importing the factory (whose module is missing here).
    assert (
        main(["verify", "no_such_module:f", "--schedule", "Interleaved1F1B", "--ranks", "1"]) == 2
    )
    assert "no module named 'no_such_module'" in capsys.readouterr().err
    assert _schedule.placement("Interleaved1F1B", 1) == {0: [0, 1]}


def test_a_schedule_stage_with_no_gradient_to_compare_is_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(HERE)
    with pytest.raises(ValueError, match="nothing to compare on stage 0"):
        verify_schedule("_factories:detached_first_of_two", "ZBVZeroBubble", 1)


@pytest.mark.distributed
def test_zbv_on_compiled_stages_is_exact_under_gradsafe_where_torch_refuses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each stage torch.compile'd: torch's zero-bubble schedules refuse OptimizedModule stages
    # (2.12+); under the patch they take them and split each region's backward into B and W.
    monkeypatch.chdir(HERE)
    report = verify_schedule("_factories:compiled_mlp_stages", "ZBVZeroBubble", 2)
    _skip_if_gloo_cannot_run_v_shapes(report.to_json())
    assert report.ok, str(report)
    assert {r.verdict for r in report.gradsafe.values()} == {"exact"}, str(report)
