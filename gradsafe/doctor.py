"""``gradsafe doctor``: reproduce each hazard on the installed torch, without and with gradsafe.

Each capability writes its hazard reproductions once, in
``gradsafe/<capability>/_hazards.py``, as ``CHECKS`` (listed in
:data:`gradsafe.capabilities.CAPABILITIES`). A :class:`~gradsafe.checks.Check`
runs a reproduction against upstream and with gradsafe, each returning an
:class:`~gradsafe.checks.Outcome`. A crash is an outcome too
(upstream crashes are one of the hazards), so exceptions are caught and
reported, never raised.
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from gradsafe import capabilities
from gradsafe.checks import Outcome
from gradsafe.patching import REGISTRY, Skip

__all__ = ["PatchPlan", "Report", "Row", "run"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One hazard's reproduction on the installed torch, without and with gradsafe."""

    hazard: str
    capability: str
    upstream_source: str
    upstream: Outcome
    gradsafe: Outcome
    seconds: float

    @property
    def hazard_here(self) -> bool:
        """Upstream is not right on this torch (wrong, a crash, or not measured)."""
        return self.upstream.correct is not True


@dataclasses.dataclass(frozen=True)
class PatchPlan:
    """What ``gradsafe.patch(name)`` replaces on this torch, or why it is skipped."""

    name: str
    replaces: tuple[str, ...]
    skipped: str | None

    def __str__(self) -> str:
        if self.skipped is not None:
            return f"{self.name}: skipped: {self.skipped}"
        return f"{self.name}: replaces {', '.join(self.replaces)}"

    def short(self) -> str:
        """One line: the reason for a skip, or how many torch slots it replaces."""
        if self.skipped is not None:
            return str(self)
        slots = len(self.replaces)
        return f"{self.name}: replaces {slots} torch slot{'s' * (slots != 1)}"


#: What the doctor says to do once every row is right with gradsafe.
_NEXT_STEPS = (
    "Next:",
    "  1. apply it around your training loop:  with gradsafe.patch(): train()",
    "     (or gradsafe.patch() once at start-up)",
    "  2. check your own model:  gradsafe verify PACKAGE.MODULE:FACTORY  (docs/verify.md)",
    "  3. a symptom (wrong ZBV gradients, NaN after the first step, ...) to its fix:",
    "     docs/troubleshooting.md",
)


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``gradsafe doctor`` found: one row per hazard and the patches on this torch."""

    torch_version: str
    machine: str
    rows: tuple[Row, ...]
    patches: tuple[PatchPlan, ...]

    @property
    def ok(self) -> bool:
        """Some row ran, and every row is right with gradsafe."""
        return bool(self.rows) and all(row.gradsafe.correct is True for row in self.rows)

    def as_json(self) -> dict[str, object]:
        """The whole report (cells uncut, every slot each patch replaces) for ``--json``."""
        return {
            "torch": self.torch_version,
            "machine": self.machine,
            "ok": self.ok,
            "rows": [
                {**dataclasses.asdict(row), "hazard_here": row.hazard_here} for row in self.rows
            ],
            "patches": [dataclasses.asdict(p) for p in self.patches],
        }

    def render(self, width: int | None = None, *, verbose: bool = False) -> str:
        """The report as a table, then what to do next.

        Cells are cut to fit ``width`` columns (None: never cut). ``verbose``
        lists every torch slot each patch replaces instead of their count.
        """
        marks = _footnote_marks(self.rows)
        header = ("hazard", "upstream", "with gradsafe")
        body = [
            (r.hazard, marks.get(r.upstream_source, "") + _upstream_cell(r), r.gradsafe.label)
            for r in self.rows
        ]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(3)]
        if width is not None:
            # The hazard column takes at most a third; the two outcome columns
            # share the rest (6: the two " | " separators).
            widths[0] = min(widths[0], max(width // 3, 12))
            room = max(width - widths[0] - 6, 24)
            for i in (1, 2):
                widths[i] = min(widths[i], room // 2)
        fmt = " | ".join(f"{{:<{w}}}" for w in widths)
        lines = [f"torch {self.torch_version} ({self.machine})", ""]
        lines += [fmt.format(*header), "-+-".join("-" * w for w in widths)]
        cells = [[_cut(cell, w) for cell, w in zip(line, widths)] for line in body]
        lines += [fmt.format(*line) for line in cells]
        lines += [f"{mark} upstream column: {source}" for source, mark in marks.items()]
        if cells != [list(line) for line in body]:
            lines.append(
                "(cells cut to the terminal's width; `gradsafe doctor --json` has them whole)"
            )
        lines += [
            "",
            "Patches on this torch (what gradsafe.patch() does here"
            + ("):" if verbose else "; --verbose lists the slots):"),
        ]
        lines += [f"  {p if verbose else p.short()}" for p in self.patches] or [
            "  none: the selected capabilities have no patch"
        ]
        return "\n".join([*lines, "", *self._closing()])

    def _closing(self) -> list[str]:
        if not self.ok:
            return [
                "NOT OK: the rows whose 'with gradsafe' cell is not 'right' are hazards gradsafe "
                "does not remove on this torch (or could not measure); `gradsafe doctor --json` "
                "has the whole cells. Please report them with that output.",
                "Symptoms and fixes: docs/troubleshooting.md",
            ]
        hazards = sum(row.hazard_here for row in self.rows)
        verdict = f"gradsafe removes every hazard above ({hazards} on this torch"
        quiet = len(self.rows) - hazards
        if quiet:
            verdict += (
                f"; {quiet} row{'s' * (quiet != 1)} not a hazard here, right with gradsafe too"
            )
        return [verdict + ").", "", *_NEXT_STEPS]

    def __str__(self) -> str:
        return self.render()


def _upstream_cell(row: Row) -> str:
    label = row.upstream.label
    return label.replace("right", "right, not a hazard here", 1) if not row.hazard_here else label


def _footnote_marks(rows: Sequence[Row]) -> dict[str, str]:
    sources = dict.fromkeys(
        r.upstream_source for r in rows if r.upstream_source != "installed torch"
    )
    return {source: "*" * (i + 1) for i, source in enumerate(sources)}


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def terminal_width() -> int:
    """Columns of the terminal (``COLUMNS`` wins, as in ``shutil``; 160 when not a terminal)."""
    return shutil.get_terminal_size(fallback=(160, 24)).columns


def _run_one(run: Callable[[], Outcome]) -> Outcome:
    try:
        return run()
    except Exception as exc:  # a crash is a finding, not a doctor failure
        return Outcome(False, _crash(exc))


def _crash(exc: Exception) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"crash: {type(exc).__name__}: {first_line}"


def capability_names() -> tuple[str, ...]:
    """The names ``run`` (and ``gradsafe doctor --only``) accept."""
    return tuple(c.name for c in capabilities.CAPABILITIES)


def _plans(only: Sequence[str]) -> tuple[PatchPlan, ...]:
    plans = []
    for name in REGISTRY.names():
        if only and name not in only:  # a patch is named after its capability
            continue
        try:
            plan = REGISTRY.plan(name)
        except Exception as exc:  # reported like a crashing row, never raised
            plans.append(PatchPlan(name, (), f"gradsafe.patch() raises here: {_crash(exc)}"))
            continue
        if isinstance(plan, Skip):
            plans.append(PatchPlan(name, (), plan.reason))
        else:
            plans.append(PatchPlan(name, tuple(t.where for t in plan), None))
    return tuple(plans)


_STREAM_MISMATCH = "The AccumulateGrad node's stream does not match"


def run(only: Sequence[str] = ()) -> Report:
    """Run every check (or those of the capabilities ``only`` names) and return the report.

    The report's patches are those of the same capabilities.

    Raises:
        ValueError: ``only`` names something that is not a capability.
    """
    unknown = [name for name in only if name not in capability_names()]
    if unknown:
        raise ValueError(
            f"unknown capability {unknown[0]!r}; valid: {', '.join(capability_names())}"
        )
    rows = []
    for capability in capabilities.CAPABILITIES:
        if only and capability.name not in only:
            continue
        for check in capability.hazards():
            start = time.perf_counter()
            with warnings.catch_warnings():
                # The reproductions keep graphs alive on purpose; on a GPU torch
                # warns about their AccumulateGrad nodes' stream at every backward.
                warnings.filterwarnings("ignore", message=_STREAM_MISMATCH)
                upstream = _run_one(check.upstream)
                with_gradsafe = _run_one(check.gradsafe)
            rows.append(
                Row(
                    check.hazard,
                    check.capability,
                    check.upstream_source,
                    upstream,
                    with_gradsafe,
                    time.perf_counter() - start,
                )
            )
    machine = f"{platform.machine()}, {'CUDA' if torch.cuda.is_available() else 'CPU only'}"
    return Report(torch.__version__, machine, tuple(rows), _plans(only))
