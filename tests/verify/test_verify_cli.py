"""``gradsafe verify MODULE:FACTORY``: exit 0 exact, 1 not exact, 2 refused or unusable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _ranks import worker_env
from test_verify import _dropping_split

from gradsafe.__main__ import main
from gradsafe.verify import _api

HERE = Path(__file__).parent


def test_exact_model_exits_0_with_a_progress_line_per_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "_factories:param_only_output"]) == 0
    out, err = capsys.readouterr()
    assert "H1 parameter-only output: prefix" in out and "OK: gradsafe equals" in out
    # the reference twice (is it reproducible?), then gradsafe and torch per order
    assert err.count("verify: ") == 2 + 2 * 3


def test_json_and_orders_and_a_loss_from_the_factory(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "verify",
            "_factories:reused_with_loss",
            "--json",
            "--orders",
            "w-lag-3",
            "--dtype",
            "float32",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"] and data["checks"] == ["w-lag-3"] and data["dtype"] == "float32"


def test_a_split_that_drops_a_gradient_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_api, "_gradsafe_split", _dropping_split)
    assert main(["verify", "_factories:reused_with_loss"]) == 1
    out = capsys.readouterr().out
    assert "lin.weight" in out and "NOT OK" in out


def test_refused_model_exits_2_with_the_reason() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gradsafe", "verify", "_factories:reentrant_on_input"],
        cwd=HERE,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gradsafe refuses this model" in proc.stdout and "use_reentrant=False" in proc.stdout


@pytest.mark.parametrize("spec", ["_factories:not_a_tuple", "_factories:missing", "no_colon"])
def test_unusable_factory_exits_2_naming_the_problem(
    spec: str, capsys: pytest.CaptureFixture[Any]
) -> None:
    assert main(["verify", spec]) == 2
    assert "gradsafe verify:" in capsys.readouterr().err


def test_a_forward_drawing_from_pythons_random_exits_2_as_not_reproducible(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Not exit 1 ("a gradsafe bug"): two fused runs already disagree.
    assert main(["verify", "_factories:python_random_forward", "--orders", "w-after-b"]) == 2
    err = capsys.readouterr().err
    assert "the model is not reproducible: two fused backwards" in err
    assert "lin.weight" in err and "Python's `random`" in err


def test_json_stdout_is_the_report_alone_when_the_factory_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "_factories:printing", "--json", "--orders", "w-after-b"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ok"] and "loading weights" in err


def test_a_missing_factory_module_names_where_python_looked_and_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "no_such_package.model:make"]) == 2
    err = capsys.readouterr().err
    assert "no module named 'no_such_package'; Python looked in " in err
    assert "PYTHONPATH=" in err and "no_such_package.py or no_such_package/" in err


@pytest.mark.parametrize("factory", ["returns_none", "detached_output"])
def test_a_stage_with_no_gradient_to_compare_exits_2_instead_of_exact(
    factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", f"_factories:{factory}", "--orders", "w-after-b"]) == 2
    captured = capsys.readouterr()
    assert "nothing to compare on stage 0" in captured.err and "OK" not in captured.out
