"""What ``gradsafe verify``'s report and command line show: real differences only, its own scope."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _factories import ReentrantOnInput, _batches, hooked_first_stage
from _ranks import worker_env
from torch import nn

from gradsafe.__main__ import main
from gradsafe.verify import _api, verify
from gradsafe.verify._graph_scan import HOOKS_IN_W
from gradsafe.verify._run import Split

HERE = Path(__file__).parent


def _crashing_split() -> Split:
    def crash(*args: Any) -> Any:
        raise RuntimeError("split exploded")

    return Split(crash, crash, crash)


def test_a_crashed_split_is_one_line_not_a_row_per_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_api, "_torch_split", _crashing_split)
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)]
    report = verify(stages, _batches(), orders=("w-after-b",))
    assert report.ok, str(report)
    assert report.upstream["w-after-b"].verdict == "crash"
    text = str(report)
    section = text.split("Gradients that differ from fused")[1].split("\n\n")[0]
    assert section.splitlines()[1:] == [
        "  none",
        "  8 gradient(s) equal fused in every run that finished (worst relative error 0)",
    ], text
    assert text.count("split exploded") == 1, text


def test_a_refused_model_prints_no_pass_lines() -> None:
    torch.manual_seed(0)
    report = verify(ReentrantOnInput(), _batches(), orders=("w-after-b",))
    text = str(report)
    assert report.refused is not None and not report.ok
    assert "equal fused in every run that finished" not in text
    assert "every count equals fused" not in text
    assert text.count("not compared: gradsafe's split finished no run") == 2


def test_a_hook_on_the_fused_first_stage_is_not_flagged_as_a_hook_in_w() -> None:
    report = verify(*hooked_first_stage(), orders=("w-after-b",))
    assert report.ok, str(report)
    assert HOOKS_IN_W not in report.hazards, str(report)


def test_the_unsplit_first_stage_and_the_hazards_one_process_cannot_see_are_named() -> None:
    report = verify(*hooked_first_stage(), orders=("w-after-b",))
    text = str(report)
    assert "Stage 0 runs fused" in text and "not checked here" in text
    assert "H6:" in text and "H7:" in text and "--schedule ZBVZeroBubble" in text
    data = report.to_json()
    assert data["unsplit_stages"] == [0] and set(data["not_seen"]) >= {"H6", "H7"}
    single = verify(nn.Linear(4, 4), _batches(), orders=("w-after-b",))
    assert single.to_json()["unsplit_stages"] == [] and "Stage 0 runs fused" not in str(single)


def test_a_factory_error_is_one_line_with_a_hint_and_its_traceback_on_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "_factories:raises_in_factory"]) == 2
    err = capsys.readouterr().err
    assert "KeyError: 'no such checkpoint: step-7'" in err and "--traceback" in err
    assert "Traceback (most recent call last)" not in err
    assert main(["verify", "_factories:raises_in_factory", "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "raises_in_factory" in err


@pytest.mark.parametrize(
    "args",
    [
        ["verify"],
        ["verify", "no_colon_here"],
        ["verify", "_factories:param_only_output", "--orders", "w-sideways"],
        ["verify", "--torchtitan", "llama3"],
        # before, the schedule ran and the flag was ignored (exit 0, nothing measured)
        ["verify", "_factories:tied_v", "--schedule", "ZBVZeroBubble", "--work"],
        ["verify", "_factories:param_only_output", "--time", "--work"],
    ],
)
def test_argument_errors_exit_2_before_torch_is_imported(args: list[str]) -> None:
    code = f"import sys; from gradsafe.__main__ import main; rc = main({args!r}); print(rc, 'torch' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=worker_env(),
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert "gradsafe verify: " in proc.stderr


def test_torchtitan_without_torchtitan_gives_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchtitan" else real(name, *a),
    )
    assert main(["verify", "--torchtitan", "llama3", "--schedule", "ZBVZeroBubble"]) == 2
    assert 'pip install "gradsafe[torchtitan]"' in capsys.readouterr().err


def test_json_into_a_closed_pipe_exits_without_a_broken_pipe_traceback() -> None:
    # As `gradsafe verify ... --json | head -1`: the reader has gone before the report is printed.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradsafe",
            "verify",
            "_factories:param_only_output",
            "--json",
            "--orders",
            "w-after-b",
        ],
        env=worker_env(),
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert "BrokenPipeError" not in err.decode(), err.decode()
    assert proc.returncode == 0


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda t: self.b(torch.tanh(self.a(t))), x, use_reentrant=False)


def test_work_gives_ws_share_of_backward_matmul_flops_and_the_re_runs_per_stage() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    report = verify(plain, _batches(), orders=("w-after-b",), work=True)
    assert report.work is not None
    (fused,) = report.work["fused"]["fused"]
    assert (fused.b_flops, fused.w_share, fused.recomputed) == (0, 1.0, 0)
    for impl in ("gradsafe", "upstream"):
        (split,) = report.work[impl]["w-after-b"]
        # A linear layer's input and weight gradients cost the same matmul FLOPs.
        assert split.w_share == 0.5 and split.b_flops + split.w_flops == fused.w_flops
    assert "Backward matmul FLOPs per stage" in str(report)
    assert report.to_json()["work"]["gradsafe"]["w-after-b"][0]["w_share"] == 0.5


def test_work_shows_torchs_split_recomputing_a_checkpoint_three_times() -> None:
    torch.manual_seed(0)
    report = verify(_Checkpointed(), _batches(), orders=("w-after-b",), work=True)
    assert report.work is not None
    (fused,) = report.work["fused"]["fused"]
    (ours,) = report.work["gradsafe"]["w-after-b"]
    (theirs,) = report.work["upstream"]["w-after-b"]
    assert fused.recomputed == ours.recomputed == 8  # 2 linears x 4 microbatches
    assert theirs.recomputed == 3 * fused.recomputed
    assert ours.b_flops + ours.w_flops == fused.w_flops < theirs.b_flops + theirs.w_flops


def test_work_text_gives_b_w_recomputed_and_fused_flops_and_both_w_shares() -> None:
    torch.manual_seed(0)
    report = verify(_Checkpointed(), _batches(), orders=("w-after-b",), work=True)
    (ours,) = report.work["gradsafe"]["w-after-b"] if report.work else ()
    # B recomputes the region's first linear (early stop) and runs both input gradients.
    assert (ours.b_flops, ours.w_flops, ours.b_recomputed_flops) == (2304, 1536, 768)
    assert ours.w_share == pytest.approx(0.4) and ours.w_share_of_gradients == pytest.approx(0.5)
    rows = {
        line.split("  ")[1].strip(): line.split()
        for line in str(report).splitlines()
        if line.startswith(("  fused ", "  gradsafe ", "  torch's split "))
    }
    assert rows["fused"][3:7] == ["0", "3840", "768", "1.00"]
    assert rows["gradsafe"][3:10] == ["2304", "1536", "768", "1.00", "0.400", "0.500", "8"]
    # torch's split recomputes the region in W once per call: 1.4x the fused backward's FLOPs.
    assert rows["torch's split"][4:12] == ["2304", "3072", "2304", "1.40", "0.571", "0.500", "24"]


def test_work_with_time_is_refused() -> None:
    with pytest.raises(ValueError, match=r"work=True.*not in timed runs"):
        verify(nn.Linear(4, 4), _batches(), work=True, time_backward=True)


def test_work_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "_factories:param_only_output", "--work", "--orders", "w-after-b"]) == 0
    assert "W share of backward" in capsys.readouterr().out
    assert main(["verify", "_factories:param_only_output", "--work", "--time"]) == 2
    assert "not in timed runs" in capsys.readouterr().err
