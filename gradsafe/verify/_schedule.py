"""``gradsafe verify --schedule``: torch's real PipelineStage and schedule on local gloo ranks.

The stages run one step of the schedule on ``ranks`` CPU processes
(127.0.0.1, a file rendezvous, bounded timeouts), once with torch's own split and once
under ``gradsafe.patch("pipelining")``; each rank's parameter gradients are
compared with a single-process fused reference in which only stages on the same
rank share parameters (as they do across ranks' memories).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradsafe.verify import _isolate, _run
from gradsafe.verify._factory import load_factory
from gradsafe.verify._report import (
    CRASH,
    EXACT,
    REFUSED,
    RIGHT,
    SCHEDULE,
    WRONG,
    GradRow,
    OrderResult,
    VerifyReport,
)

__all__ = ["SCHEDULES", "placement", "verify_schedule"]

# Which stages each rank holds: V shape (rank r: r and 2R-1-r) or a loop (r, r+R).
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = (*V_SHAPED, "InterleavedZeroBubble", "Interleaved1F1B")


def placement(schedule: str, ranks: int) -> dict[int, list[int]]:
    if schedule in V_SHAPED:
        return {r: [r, 2 * ranks - 1 - r] for r in range(ranks)}
    return {r: [r, r + ranks] for r in range(ranks)}


_TIMEOUT_S = 300
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}
_MODES = ("gradsafe", "upstream")
_REFUSAL = "SplitBackwardError: "


def _env() -> dict[str, str]:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), package_root, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over 127.0.0.1 only
    return env


def verify_schedule(
    spec: str,
    schedule: str,
    ranks: int,
    dtype: torch.dtype = torch.float64,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Run ``spec``'s stages through torch's ``Schedule{schedule}`` on ``ranks`` gloo processes.

    ``spec`` is ``PACKAGE.MODULE:FACTORY`` (the workers build the stages with it
    and load the parent's initial state). The factory must return ``2 * ranks``
    stages and microbatches of equal batch size (the schedule re-splits their
    concatenation along dim 0). Dropout draws other numbers in a schedule than
    in one process: use a model without it (or eval mode) here. The report's
    mode is ``"schedule"``, one check per rank.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {list(SCHEDULES)}")
    say = progress or (lambda line: None)
    stages, batches, loss = _stages_and_microbatches(spec, schedule, ranks)
    say("verify --schedule: single-process reference ...")
    with _isolate.python_rng_kept():
        reference = _reference(spec, stages, placement(schedule, ranks), batches, loss, dtype)
    outs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        torch.save(
            {"states": [m.state_dict() for m in stages], "microbatches": batches},
            Path(workdir) / "init.pt",
        )
        for mode in _MODES:
            say(f"verify --schedule: {schedule} on {ranks} gloo ranks, {mode} ...")
            outs[mode] = _launch(mode, spec, schedule, ranks, dtype, workdir)
    return _report(reference, outs, schedule, ranks, dtype, len(batches))


def _report(
    reference: _run.RunResult,
    outs: dict[str, list[dict[str, Any]]],
    schedule: str,
    ranks: int,
    dtype: torch.dtype,
    microbatches: int,
) -> VerifyReport:
    """Each rank's gradients, per implementation, against the reference: one check per rank."""
    tol = _TOLERANCE[dtype]
    where = placement(schedule, ranks)
    # A rank reports its stages' parameters ("STAGE.NAME"); a loss's own parameters stay unchecked.
    names = {
        r: [n for n in reference.params if n.split(".")[0] in {str(i) for i in where[r]}]
        for r in range(ranks)
    }
    errors: dict[str, dict[str, dict[str, float | str | None]]] = {}
    oks: dict[str, dict[str, dict[str, bool | None]]] = {}
    results: dict[str, dict[str, OrderResult]] = {}
    for mode, per_rank in outs.items():
        results[mode] = {}
        for r, out in enumerate(per_rank):
            check = f"rank {r}"
            for name in names[r]:
                err, ok = (
                    (None, None)
                    if "crash" in out
                    else _run.compare(reference.params[name], out["grads"].get(name), tol)
                )
                errors.setdefault(name, {}).setdefault(mode, {})[check] = err
                oks.setdefault(name, {}).setdefault(mode, {})[check] = ok
            wrong = tuple(n for n in names[r] if oks[n][mode][check] is False)
            results[mode][check] = _rank_result(mode, out, wrong)
    refusals = [r.message for r in results["gradsafe"].values() if r.verdict == REFUSED]
    return VerifyReport(
        mode=SCHEDULE,
        torch_version=torch.__version__,
        dtype=str(dtype).removeprefix("torch."),
        stages=2 * ranks,
        microbatches=microbatches,
        checks=tuple(f"rank {r}" for r in range(ranks)),
        tolerance=tol,
        gradsafe=results["gradsafe"],
        upstream=results["upstream"],
        grads=tuple(
            GradRow(n, reference.shapes[n], _max_abs(reference.params[n]), errors[n], oks[n])
            for n in errors
        ),
        hooks=None,
        hazards=None,
        refused=refusals[0].removeprefix(_REFUSAL) if refusals else None,
        schedule=schedule,
        ranks=ranks,
    )


def _rank_result(mode: str, out: dict[str, Any], wrong: tuple[str, ...]) -> OrderResult:
    """One rank's verdict: crashed (gradsafe's refusal apart), wrong on ``wrong``, or equal."""
    if "crash" in out:
        message = str(out["crash"])
        refused = mode == "gradsafe" and message.startswith(_REFUSAL)
        return OrderResult(REFUSED if refused else CRASH, message=message)
    if wrong:
        return OrderResult(WRONG, wrong)
    return OrderResult(EXACT if mode == "gradsafe" else RIGHT)


def _max_abs(grad: torch.Tensor | None) -> float | None:
    """``GradRow.fused_max`` of one reference gradient (a sparse one made dense)."""
    if grad is None:
        return None
    return float(grad.to_dense().abs().max()) if grad.numel() else 0.0


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
    _refuse_nothing_to_compare(reference, len(stages))
    # A schedule's step (scale_grads=True, its default) gives the averaged loss's gradient.
    reference.params = {
        name: None if grad is None else grad / len(batches)
        for name, grad in reference.params.items()
    }
    return reference


def _refuse_nothing_to_compare(reference: _run.RunResult, stages: int) -> None:
    """The ranks report parameter gradients: a stage whose every one is None in the fused run
    would compare None with None and pass, whatever the schedule gave it."""
    for stage in range(stages):
        names = [n for n in reference.params if n.split(".")[0] == str(stage)]
        if names and all(reference.params[n] is None for n in names):
            raise ValueError(
                f"nothing to compare on stage {stage}: the fused backward gives none of its "
                f"{len(names)} parameter(s) a gradient, so every run would pass unchecked. Its "
                "output reaches none of them (it returns None, a number or a tensor detached "
                "from its parameters): return the output tensor(s) the next stage uses."
            )


def _refuse_consumed_gradients(reference: _run.RunResult) -> None:
    """The ranks report gradients only: a parameter whose hook consumed its gradient (stepped it
    and cleared ``.grad``) would compare None with None and pass, whatever the schedule gave it."""
    consumed = [
        name
        for name, grad in reference.params.items()
        # A parameter that did not move has no entry in values (see RunResult.values).
        if grad is None and f"value of {name} after the run" in reference.values
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
    # A file rendezvous: no free TCP port to race another run for.
    init_method = f"file://{Path(workdir).resolve() / f'{mode}-rendezvous'}"
    dtype_name = str(dtype).removeprefix("torch.")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradsafe.verify._worker",
                str(r),
                init_method,
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
