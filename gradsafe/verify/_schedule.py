"""``gradsafe verify --schedule``: torch's real PipelineStage and schedule on local gloo ranks.

The stages run one step of the schedule on ``ranks`` CPU processes
(127.0.0.1, a free port, bounded timeouts), once with torch's own split and once
under ``gradsafe.patch("pipelining")``; each rank's parameter gradients are
compared with a single-process fused reference in which only stages on the same
rank share parameters (as they do across ranks' memories).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gradsafe.verify import _isolate, _run
from gradsafe.verify._factory import load_factory

__all__ = ["SCHEDULES", "ScheduleReport", "placement", "verify_schedule"]

# Which stages each rank holds: V shape (rank r: r and 2R-1-r) or a loop (r, r+R).
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = (*V_SHAPED, "InterleavedZeroBubble")


def placement(schedule: str, ranks: int) -> dict[int, list[int]]:
    if schedule in V_SHAPED:
        return {r: [r, 2 * ranks - 1 - r] for r in range(ranks)}
    return {r: [r, r + ranks] for r in range(ranks)}


_TIMEOUT_S = 300
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}
_MODES = ("gradsafe", "upstream")
_REFUSAL = "SplitBackwardError"


@dataclasses.dataclass(frozen=True)
class RankResult:
    """One rank in one mode: ``right``, ``WRONG`` (with the parameters), or ``crash`` (message)."""

    verdict: str
    params: tuple[str, ...] = ()
    message: str = ""


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """Per rank, gradsafe's and torch's schedule step against the single-process reference."""

    schedule: str
    ranks: int
    dtype: str
    torch_version: str
    tolerance: float
    results: Mapping[str, Mapping[int, RankResult]]  # mode -> rank -> result
    errors: Mapping[str, Mapping[str, float | str | None]]  # parameter -> mode -> relative error

    @property
    def refused(self) -> str | None:
        for result in self.results["gradsafe"].values():
            if result.message.startswith(_REFUSAL):
                return result.message
        return None

    @property
    def ok(self) -> bool:
        return all(r.verdict == "right" for r in self.results["gradsafe"].values())

    @property
    def refused_only(self) -> bool:
        """gradsafe refused the model on some rank (exit 2)."""
        return self.refused is not None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["results"] = {
            m: {str(r): dataclasses.asdict(v) for r, v in per.items()}
            for m, per in self.results.items()
        }
        data["ok"] = self.ok
        data["refused"] = self.refused
        data["format"] = "gradsafe.verify-schedule/2"  # 2: the step scales (scale_grads=True)
        return data

    def __str__(self) -> str:
        lines = [
            (
                f"gradsafe verify --schedule {self.schedule}: {self.ranks} gloo ranks, {self.dtype}, "
                f"torch {self.torch_version}, tolerance {self.tolerance:g} (relative), against one process"
            ),
            "",
            "  rank  gradsafe.patch('pipelining')  torch's split",
        ]
        for rank in range(self.ranks):
            cells = [_cell(self.results[m][rank]) for m in _MODES]
            lines.append(f"  {rank:<4}  {cells[0]:<28}  {cells[1]}")
        messages = {
            f"{m} rank {r}: {v.message}": None
            for m in _MODES
            for r, v in self.results[m].items()
            if v.message
        }
        lines += [f"  {' '.join(msg.split())[:300]}" for msg in messages]
        wrong = {
            n: e for n, e in self.errors.items() if any(_bad(v, self.tolerance) for v in e.values())
        }
        if wrong:
            lines += ["", "  gradient" + " " * 30 + "gradsafe      torch's split"]
            lines += [
                f"  {n:<38}  {_fmt(e.get('gradsafe')):<12}  {_fmt(e.get('upstream'))}"
                for n, e in wrong.items()
            ]
        lines += ["", "OK: every rank's gradients equal the reference." if self.ok else "NOT OK."]
        return "\n".join(lines)


def _bad(value: float | str | None, tol: float) -> bool:
    return isinstance(value, str) or (isinstance(value, float) and not value <= tol)


def _fmt(value: float | str | None) -> str:
    return "-" if value is None else value if isinstance(value, str) else f"{value:.2g}"


def _cell(result: RankResult) -> str:
    if result.verdict == "WRONG":
        return "WRONG " + ", ".join(result.params[:3]) + (" ..." if len(result.params) > 3 else "")
    return result.verdict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), package_root, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def verify_schedule(
    spec: str,
    schedule: str,
    ranks: int,
    dtype: torch.dtype = torch.float64,
    progress: Callable[[str], None] | None = None,
) -> ScheduleReport:
    """Run ``spec``'s stages through torch's ``Schedule{schedule}`` on ``ranks`` gloo processes.

    ``spec`` is ``PACKAGE.MODULE:FACTORY`` (the workers build the stages with it
    and load the parent's initial state). The factory must return ``2 * ranks``
    stages and microbatches of equal batch size (the schedule re-splits their
    concatenation along dim 0). Dropout draws other numbers in a schedule than
    in one process: use a model without it (or eval mode) here.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {list(SCHEDULES)}")
    say = progress or (lambda line: None)
    stages, batches, loss = _stages_and_microbatches(spec, schedule, ranks)
    say("verify --schedule: single-process reference ...")
    with _isolate.python_rng_kept():
        reference = _reference(spec, stages, placement(schedule, ranks), batches, loss, dtype)
    results: dict[str, dict[int, RankResult]] = {}
    errors: dict[str, dict[str, float | str | None]] = {}
    tol = _TOLERANCE[dtype]
    with tempfile.TemporaryDirectory() as workdir:
        torch.save(
            {"states": [m.state_dict() for m in stages], "microbatches": batches},
            Path(workdir) / "init.pt",
        )
        for mode in _MODES:
            say(f"verify --schedule: {schedule} on {ranks} gloo ranks, {mode} ...")
            outs = _launch(mode, spec, schedule, ranks, dtype, workdir)
            results[mode] = {}
            for rank, out in enumerate(outs):
                results[mode][rank] = _rank_result(out, reference, tol, errors, mode)
    return ScheduleReport(
        schedule, ranks, str(dtype).removeprefix("torch."), torch.__version__, tol, results, errors
    )


def _stages_and_microbatches(
    spec: str, schedule: str, ranks: int
) -> tuple[list[Any], list[tuple[Any, ...]], Callable[[Any, int], torch.Tensor]]:
    """The factory's stages, microbatches and loss, or the error naming what the schedule needs."""
    stages, microbatches, *rest = load_factory(spec)
    stages = list(stages)
    _run.refuse_gradients_kept_elsewhere(stages)
    if len(stages) != 2 * ranks:
        raise ValueError(
            f"{schedule} on {ranks} ranks runs {2 * ranks} stages (two per rank); {spec} returned {len(stages)}"
        )
    batches = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in microbatches]
    if (
        any(not isinstance(t, torch.Tensor) for b in batches for t in b)
        or len({b[0].shape[0] for b in batches}) != 1
    ):
        raise ValueError(
            "--schedule needs microbatches of tensors with one batch size (dim 0): the schedule re-splits them"
        )
    return stages, batches, rest[0] if rest else _run.projection_loss


def _reference(
    spec: str,
    stages: list[Any],
    where: dict[int, list[int]],
    batches: list[tuple[Any, ...]],
    loss: Callable[[Any, int], torch.Tensor],
    dtype: torch.dtype,
) -> _run.RunResult:
    """The fused single-process run the ranks are compared with.

    Stages on one rank share what they share; across ranks nothing is shared.
    Each rank's stages come from a build of their own, as on the ranks: a deep
    copy would drop the hooks the factory put on the parameters.
    """
    ordered: list[Any] = [None] * len(stages)
    for indices in where.values():
        built, _, *rest = load_factory(spec)
        for i in indices:
            ordered[i] = list(built)[i]
            ordered[i].load_state_dict(stages[i].state_dict())
        if len(stages) - 1 in indices and rest:
            loss = rest[0]  # the loss of the build that holds the last stage (it may close over it)
    reference = _run.run(ordered, batches, loss, dtype, None, None, 0)
    if reference.error is not None:
        raise RuntimeError(
            f"the fused reference backward failed ({reference.where}): {reference.error!r}"
        )
    _refuse_consumed_gradients(reference)
    # A schedule's step (scale_grads=True, its default) gives the averaged loss's gradient.
    reference.params = {
        name: None if grad is None else grad / len(batches)
        for name, grad in reference.params.items()
    }
    return reference


def _rank_result(
    out: dict[str, Any],
    reference: _run.RunResult,
    tol: float,
    errors: dict[str, dict[str, float | str | None]],
    mode: str,
) -> RankResult:
    """One rank's gradients against the reference; each one's error recorded for ``mode``."""
    if "crash" in out:
        return RankResult("crash", message=str(out["crash"]))
    wrong = []
    for name, got in out["grads"].items():
        err, ok = _run.compare(reference.params.get(name), got, tol)
        errors.setdefault(name, {})[mode] = err
        if not ok:
            wrong.append(name)
    return RankResult("WRONG" if wrong else "right", tuple(wrong))


def _refuse_consumed_gradients(reference: _run.RunResult) -> None:
    """The ranks report gradients only: a parameter whose hook consumed its gradient (stepped it
    and cleared ``.grad``) would compare None with None and pass, whatever the schedule gave it."""
    consumed = [
        name
        for name, grad in reference.params.items()
        if grad is None and bool(reference.values[f"value of {name} after the run"].ne(0).any())
    ]
    if consumed:
        raise ValueError(
            f"--schedule compares parameter gradients, but {', '.join(consumed[:4])}"
            f"{' ...' if len(consumed) > 4 else ''} moved during the backward and kept no .grad "
            "(a hook stepped it: an optimizer step in backward), so there is no gradient to "
            "compare. Run the single-process `gradsafe verify` (without --schedule), which "
            "compares parameter values too, or leave the hook out of the factory for this check."
        )


def _launch(
    mode: str, spec: str, schedule: str, ranks: int, dtype: torch.dtype, workdir: str
) -> list[dict[str, Any]]:
    port = str(_free_port())
    dtype_name = str(dtype).removeprefix("torch.")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradsafe.verify._worker",
                str(r),
                port,
                str(ranks),
                schedule,
                mode,
                spec,
                dtype_name,
                workdir,
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(ranks)
    ]
    logs: list[str] = []
    # One deadline for the run, not one per rank: waiting on each in turn would allow ranks x it.
    deadline = time.monotonic() + _TIMEOUT_S
    for proc in procs:
        try:
            left = max(0.0, deadline - time.monotonic())
            logs.append(proc.communicate(timeout=left)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            logs.append(f"timed out after {_TIMEOUT_S} s")
    outs: list[dict[str, Any]] = []
    for r in range(ranks):
        path = Path(workdir) / f"{mode}-rank{r}.pt"
        if path.exists():
            outs.append(torch.load(path, weights_only=False))
            path.unlink()
        else:
            tail = logs[r][-1500:] if r < len(logs) else ""
            outs.append(
                {"crash": f"rank {r} wrote no result (a peer crashed or it timed out): {tail}"}
            )
    return outs
