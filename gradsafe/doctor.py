"""``gradsafe doctor``: reproduce each hazard on the installed torch, without and with gradsafe.

Each capability writes its hazard reproductions once, in
``gradsafe/<capability>/_hazards.py``, as ``CHECKS`` (listed in
:data:`gradsafe.capabilities.CAPABILITIES`). A :class:`~gradsafe.checks.Check`
runs a reproduction against upstream and with gradsafe, each returning an
:class:`~gradsafe.checks.Outcome`. A crash is an outcome too
(upstream crashes are one of the hazards), so exceptions are caught and
reported, never raised.

The report also says whether the installed torch is newer than any gradsafe
was tested on (:data:`~gradsafe._torch_support.NEWEST_TESTED_TORCH`), which
behavioural probes of torch internals passed (each capability's ``probes``),
and the fallbacks in force: a probe that differs, a patch skipped.
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
from gradsafe._shared.doc_links import doc
from gradsafe._torch_support import NEWEST_TESTED_TORCH, newer_than_tested
from gradsafe.checks import Outcome, Probe
from gradsafe.patching import REGISTRY, Skip

__all__ = ["PatchPlan", "ProbeResult", "Report", "Row", "run"]

#: The newest torch release gradsafe was tested on, as the report prints it.
NEWEST_TESTED = ".".join(map(str, NEWEST_TESTED_TORCH))


@dataclasses.dataclass(frozen=True)
class Row:
    """One hazard's reproduction on the installed torch, without and with gradsafe."""

    hazard: str
    capability: str
    upstream_source: str
    upstream: Outcome
    gradsafe: Outcome
    seconds: float
    note: str = ""  # the check's note on its upstream figure

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


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """One behavioural probe of torch internals on the installed torch."""

    capability: str
    name: str
    differs: str | None
    fallback: str

    @property
    def passed(self) -> bool:
        return self.differs is None

    def __str__(self) -> str:
        if self.passed:
            return f"{self.capability}: {self.name}: passed"
        return (
            f"{self.capability}: {self.name}: DIFFERS ({self.differs}); fallback: {self.fallback}"
        )


def _next_steps() -> list[str]:
    """What the doctor says to do once every row is right with gradsafe."""
    return [
        "Next:",
        "  1. apply it around your training loop:  with gradsafe.patch(): train()",
        "     (or gradsafe.patch() once at start-up)",
        "  2. check your own model:  gradsafe verify PACKAGE.MODULE:FACTORY",
        f"     ({doc('verify.md')})",
        "  3. a symptom (wrong ZBV gradients, NaN after the first step, ...) to its fix:",
        f"     {doc('troubleshooting.md')}",
    ]


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``gradsafe doctor`` found: one row per hazard and the patches on this torch."""

    torch_version: str
    machine: str
    rows: tuple[Row, ...]
    patches: tuple[PatchPlan, ...]
    probes: tuple[ProbeResult, ...] = ()

    @property
    def newer_than_tested(self) -> bool:
        """The installed torch is a release after the newest one gradsafe was tested on."""
        return newer_than_tested(self.torch_version)

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """What gradsafe does differently on this torch: each probe that differs, each patch skipped."""
        found = [f"{p.capability}: {p.fallback} ({p.differs})" for p in self.probes if not p.passed]
        found += [f"{p.name}: patch skipped ({p.skipped})" for p in self.patches if p.skipped]
        return tuple(found)

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
            "newest_tested_torch": NEWEST_TESTED,
            "newer_than_tested": self.newer_than_tested,
            "probes": [{**dataclasses.asdict(p), "passed": p.passed} for p in self.probes],
            "fallbacks": list(self.fallbacks),
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
        lines = [f"torch {self.torch_version} ({self.machine})", *self._newer(), ""]
        lines += [fmt.format(*header), "-+-".join("-" * w for w in widths)]
        cells = [[_cut(cell, w) for cell, w in zip(line, widths)] for line in body]
        lines += [fmt.format(*line) for line in cells]
        lines += [f"{mark} upstream column: {source}" for source, mark in marks.items()]
        lines += [f"{r.hazard}: {r.note}" for r in self.rows if r.note and r.hazard_here]
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
        return "\n".join([*lines, *self._probe_lines(), "", *self._closing()])

    def _newer(self) -> list[str]:
        if not self.newer_than_tested:
            return []
        return [
            f"This torch is newer than {NEWEST_TESTED}, the newest release gradsafe was tested "
            "on: the probes below choose each path, and the rows above are what was measured here."
        ]

    def _probe_lines(self) -> list[str]:
        passed = [f"{p.capability}: {p.name}" for p in self.probes if p.passed]
        lines = ["", "Probes of torch internals (docs/architecture.md lists each):"]
        lines += [f"  passed: {name}" for name in passed]
        lines += [f"  {p}" for p in self.probes if not p.passed]
        if not self.probes:
            lines.append("  none for the selected capabilities")
        lines.append("Fallbacks in force:" + ("" if self.fallbacks else " none"))
        return lines + [f"  {f}" for f in self.fallbacks]

    def _closing(self) -> list[str]:
        if not self.ok:
            return [
                "NOT OK: the rows whose 'with gradsafe' cell is not 'right' are hazards gradsafe "
                "does not remove on this torch (or could not measure); `gradsafe doctor --json` "
                "has the whole cells. Please report them with that output.",
                f"Symptoms and fixes: {doc('troubleshooting.md')}",
            ]
        hazards = sum(row.hazard_here for row in self.rows)
        verdict = f"gradsafe removes every hazard above ({hazards} on this torch"
        quiet = len(self.rows) - hazards
        if quiet:
            verdict += (
                f"; {quiet} row{'s' * (quiet != 1)} not a hazard here, right with gradsafe too"
            )
        return [verdict + ").", "", *_next_steps()]

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
                    check.note,
                )
            )
    machine = f"{platform.machine()}, {'CUDA' if torch.cuda.is_available() else 'CPU only'}"
    return Report(torch.__version__, machine, tuple(rows), _plans(only), _probes(only))


def _probes(only: Sequence[str]) -> tuple[ProbeResult, ...]:
    results = []
    for capability in capabilities.CAPABILITIES:
        if only and capability.name not in only:
            continue
        for probe in capability.probes():
            results.append(
                ProbeResult(probe.capability, probe.name, _probe_differs(probe), probe.fallback)
            )
    return tuple(results)


def _probe_differs(probe: Probe) -> str | None:
    try:
        return probe.run()
    except Exception as exc:  # a probe's crash is a difference, reported, never raised
        return _crash(exc)
