"""``gradsafe doctor``: reproduce each hazard on the installed torch, without and with gradsafe.

Each capability lists its checks in ``gradsafe/<capability>/_doctor.py`` as
``CHECKS``. A check is two zero-argument callables returning an
:class:`Outcome`: the reproduction against upstream torch, and the same
reproduction with gradsafe. A crash is an outcome too (upstream crashes are
one of the hazards), so exceptions are caught and reported, never raised.
"""

from __future__ import annotations

import dataclasses
import importlib
import platform
import time
from collections.abc import Callable, Sequence
from typing import Final

import torch

from gradsafe import patching

__all__ = ["Check", "Outcome", "Report", "Row", "patched_check", "run"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one run of a reproduction found.

    ``correct`` is True when the gradients (or behaviour) matched the
    reference, False when they did not, None when the run was not possible
    (e.g. not implemented yet, or gradsafe already active in this process).
    """

    correct: bool | None
    detail: str

    @property
    def label(self) -> str:
        verdict = {True: "right", False: "WRONG", None: "n/a"}[self.correct]
        return f"{verdict}: {self.detail}" if self.detail else verdict


@dataclasses.dataclass(frozen=True)
class Check:
    """One hazard's reproduction, run against upstream and with gradsafe.

    ``upstream_source`` says what the upstream column ran: the installed torch
    (the default), or a model of another library's behaviour when that library
    is not what is being measured (e.g. TransformerEngine's wgrad policy).
    """

    hazard: str
    capability: str
    upstream: Callable[[], Outcome]
    gradsafe: Callable[[], Outcome]
    upstream_source: str = "installed torch"


def patched_check(
    hazard: str, capability: str, patch_name: str, repro: Callable[[], Outcome]
) -> Check:
    """A check whose gradsafe run is ``repro`` under ``gradsafe.patch(patch_name)``."""

    def upstream() -> Outcome:
        if patching.status()[patch_name].active:
            return Outcome(None, f"not measured: gradsafe.patch({patch_name!r}) is active here")
        return repro()

    def with_gradsafe() -> Outcome:
        with patching.patch(patch_name) as handle:
            applied = patch_name in handle.names
            outcome = repro()
        if applied:
            return outcome
        # A skipped patch (e.g. upstream already right) must still be measured.
        reason = patching.status()[patch_name].skipped
        return Outcome(outcome.correct, f"{outcome.detail} (patch skipped: {reason})")

    return Check(hazard, capability, upstream, with_gradsafe)


@dataclasses.dataclass(frozen=True)
class Row:
    hazard: str
    capability: str
    upstream: Outcome
    gradsafe: Outcome
    seconds: float


@dataclasses.dataclass(frozen=True)
class Report:
    torch_version: str
    machine: str
    rows: tuple[Row, ...]

    @property
    def ok(self) -> bool:
        """Every row is right with gradsafe."""
        return all(row.gradsafe.correct is True for row in self.rows)

    def as_json(self) -> dict[str, object]:
        return {
            "torch": self.torch_version,
            "machine": self.machine,
            "ok": self.ok,
            "rows": [dataclasses.asdict(row) for row in self.rows],
        }

    def __str__(self) -> str:
        header = ("hazard", "torch", "upstream", "with gradsafe")
        body = [
            (r.hazard, self.torch_version, _cell(r.upstream.label), _cell(r.gradsafe.label))
            for r in self.rows
        ]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(4)]
        fmt = " | ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), "-+-".join("-" * w for w in widths)]
        lines += [fmt.format(*line) for line in body]
        verdict = "gradsafe removes every hazard above" if self.ok else "NOT OK: see WRONG/n/a rows"
        lines += ["", f"{verdict} (torch {self.torch_version}, {self.machine})"]
        return "\n".join(lines)


# Keeps the table readable in a terminal; `--json` carries the full details.
_CELL_WIDTH: Final = 64


def _cell(text: str) -> str:
    return text if len(text) <= _CELL_WIDTH else text[: _CELL_WIDTH - 3] + "..."


# One module per capability, in the order the table shows them.
_CHECK_MODULES: Final = (
    "gradsafe.pipelining._doctor",
    "gradsafe.dtensor._doctor",
    "gradsafe.cuda_graphs._doctor",
    "gradsafe.wgrad._doctor",
)


def checks() -> tuple[Check, ...]:
    """Every registered check."""
    found: list[Check] = []
    for module in _CHECK_MODULES:
        found += importlib.import_module(module).CHECKS
    return tuple(found)


def _run_one(run: Callable[[], Outcome]) -> Outcome:
    try:
        return run()
    except Exception as exc:  # a crash is a finding, not a doctor failure
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Outcome(False, f"crash: {type(exc).__name__}: {message}"[:160])


def run(capabilities: Sequence[str] = ()) -> Report:
    """Run every check (or those of ``capabilities``) and return the report."""
    rows = []
    for check in checks():
        if capabilities and check.capability not in capabilities:
            continue
        start = time.perf_counter()
        upstream = _run_one(check.upstream)
        with_gradsafe = _run_one(check.gradsafe)
        rows.append(
            Row(check.hazard, check.capability, upstream, with_gradsafe, time.perf_counter() - start)
        )
    machine = f"{platform.machine()}, {'CUDA' if torch.cuda.is_available() else 'CPU only'}"
    return Report(torch.__version__, machine, tuple(rows))
