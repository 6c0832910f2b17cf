"""What ``gradsafe verify`` found, in either mode: a typed, immutable report, a table and a JSON form."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final, Literal

from gradsafe._shared.doc_links import doc

__all__ = ["GradRow", "HookRow", "Memory", "OrderResult", "Timing", "VerifyReport", "WorkShare"]

# Verdicts of one implementation in one W order.
EXACT = "exact"  # gradsafe: equal to fused within tolerance
RIGHT = "right"  # upstream: equal to fused
WRONG = "WRONG"
CRASH = "crash"
HOOKS = "counts differ"
REFUSED = "refused"

# What the single-process mode cannot see, and how to check it: both live in a schedule's
# step, which only ``--schedule`` runs.
NOT_SEEN = {
    "H6": "a schedule's first step runs every stage (and the loss, with any backward inside "
    "it) to infer shapes before training: the single-process mode runs no schedule",
    "H7": "a schedule's step ends by dividing each stage's gradients by the microbatch count, "
    "stage by stage, so a weight two stages of one rank share (tied embeddings in a V) is "
    "divided once per stage, partly before the other's backwards end: the single-process "
    "mode runs no step's end",
}
_NONE_FINISHED = "  not compared: gradsafe's split finished no run (refused or crashed, above)"


def schedule_hint(stages: int, factory: str | None) -> str:
    """How to check H6 and H7 on these stages: a ``--schedule`` command that runs them (two per
    rank), or what ``--schedule`` needs when their count does not fit."""
    if stages in (2, 4, 8):
        spec = factory or "PACKAGE.MODULE:FACTORY"
        return (
            f"check both with `python -m gradsafe verify {spec} --schedule ZBVZeroBubble "
            f"--ranks {stages // 2}` (torch's real schedule on local gloo ranks, these {stages} "
            "stages two per rank in a V; Interleaved1F1B, DualPipeV and InterleavedZeroBubble "
            "too)"
        )
    return (
        "check both with `--schedule` (torch's real schedule on local gloo ranks) from a factory "
        f"returning two stages per rank, 2, 4 or 8 stages (these are {stages})"
    )


@dataclasses.dataclass(frozen=True)
class GradRow:
    """One parameter's (or one stage input's) gradient against fused, per implementation and order.

    ``errors[impl][order]`` is the relative error ``max|split - fused| / max|fused|``
    (absolute where fused is all zeros), ``None`` where the run crashed or was
    refused, or the string ``"None pattern"`` where one side has a gradient and
    the other has none.
    """

    name: str
    shape: tuple[int, ...]
    fused_max: float | None  # max |fused gradient|; None: fused gives no gradient
    errors: Mapping[str, Mapping[str, float | str | None]]
    ok: Mapping[str, Mapping[str, bool | None]]


@dataclasses.dataclass(frozen=True)
class HookRow:
    """Calls of one hook: fused, and per implementation and order."""

    label: str
    fused: int
    calls: Mapping[str, Mapping[str, int | None]]


@dataclasses.dataclass(frozen=True)
class OrderResult:
    """One implementation in one check (a W order, or a schedule's rank): verdict, what differs,
    the error message if any."""

    verdict: str
    params: tuple[str, ...] = ()  # parameters / stage inputs whose gradient differs
    hooks: tuple[str, ...] = ()  # hook labels whose call counts differ
    message: str = ""
    where: str = ""  # the step that raised: "B of stage 0, microbatch 3" (single process)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Backward-phase wall and CPU seconds of one run (the process's CPU on a CUDA model)."""

    wall_s: float
    cpu_s: float


@dataclasses.dataclass(frozen=True)
class Memory:
    """Peak live tensor memory of one run, forwards and backwards of every microbatch.

    Bytes of the tensor storages operators created from the first forward on
    (activations, saved tensors, B's handoffs, gradients) that were alive at
    the same time, counted on any device by a dispatch mode; the copies'
    parameters and the microbatches are not counted. The harness keeps each
    stage's output until the run ends in every run alike, so differences
    between runs are what the W order and the split keep alive.
    """

    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class WorkShare:
    """One stage's backward in one run: matmul FLOPs run in B and in W (a fused backward, and
    the fused first of several stages, count all in W), how many of them recomputed forwards,
    W's share of them in two named senses, and how many module forwards ran again during the
    backward (checkpoint recomputations, nested modules each).

    ``w_share`` is W's share of the backward's FLOPs, recomputation included
    (``w / (b + w)``: what a zero-bubble schedule can move into its bubbles);
    ``w_share_of_gradients`` leaves recomputation out (W's gradient FLOPs over
    all gradient FLOPs: where the weight-gradient work runs). They differ where B
    recomputes: a fully checkpointed MLP stage under ``IN_W`` has 0.4 and 0.5.

    For a split (gradsafe's, torch's), ``uncheckpointed_w_share`` is the same stage's W share
    in one extra run of gradsafe's split with activation checkpointing turned off, and
    ``w_share_low`` flags a W share under half of it, which leaves a zero-bubble schedule less
    W to fill its bubbles with (weight gradients run in B, or B's recomputation dominates).
    ``not_measured`` says why that reference is missing ("" when measured, and off splits).
    """

    stage: int
    b_flops: int
    w_flops: int
    w_share: float | None  # w_flops / (b_flops + w_flops); None without matmuls
    recomputed: int
    uncheckpointed_w_share: float | None = None
    w_share_low: bool = False
    not_measured: str = ""
    b_recomputed_flops: int = 0  # of b_flops, run inside a recomputed forward
    w_recomputed_flops: int = 0  # of w_flops, likewise
    w_share_of_gradients: float | None = None  # recomputation left out; None without any
    unsplit_compiled: int = 0  # torch.compile'd regions whose backward B ran whole


# The two modes of ``gradsafe verify``: what the checks (``VerifyReport.checks``) are.
SINGLE_PROCESS: Final = "single-process"  # the stages in one process, in each W order
SCHEDULE: Final = "schedule"  # torch's real schedule, one step on gloo ranks (``--schedule``)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What ``gradsafe verify`` found, in either mode: :func:`gradsafe.verify.verify` and
    ``verify --torchtitan`` (``mode`` ``"single-process"``: the stages in one process, each
    check a W order) and ``verify --schedule`` (``mode`` ``"schedule"``: one step of torch's
    real schedule on gloo ranks, each check a rank, ``"rank 0"``, ``"rank 1"``, ...).

    ``ok`` is True when gradsafe's split equals the fused backward in every
    check: every gradient compared within the tolerance for ``dtype`` with the
    same None pattern, and (single process) every hook, recomputation and
    custom-Function backward called as often. ``gradsafe`` and ``upstream``
    (torch's own split) map each check to its :class:`OrderResult`; ``grads``
    holds one row per gradient compared (single process: parameters, stage
    inputs, parameter moves; schedule: each rank's parameters, against the
    averaged loss's fused gradient). ``refused`` holds gradsafe's refusal
    message when it cannot split this model (then ``ok`` is False).

    Fields one mode does not measure are None: ``hooks`` and ``hazards`` on a
    schedule; ``schedule`` and ``ranks`` in one process; ``timing``,
    ``memory`` and ``work`` unless asked for (single process only); ``factory``
    (the ``PACKAGE.MODULE:FACTORY`` the command line built the stages with, which
    the H6/H7 hint's ``--schedule`` command names) outside the command line.
    """

    mode: Literal["single-process", "schedule"]  # SINGLE_PROCESS or SCHEDULE
    torch_version: str
    dtype: str
    stages: int
    microbatches: int
    checks: tuple[str, ...]  # the keys of gradsafe and upstream: W orders, or "rank R"
    tolerance: float
    gradsafe: Mapping[str, OrderResult]
    upstream: Mapping[str, OrderResult]
    grads: tuple[GradRow, ...]
    hooks: tuple[HookRow, ...] | None
    hazards: Mapping[str, tuple[str, ...]] | None
    refused: str | None
    schedule: str | None = None  # torch's Schedule<NAME>
    ranks: int | None = None
    timing: Mapping[str, Mapping[str, Timing]] | None = None
    memory: Mapping[str, Mapping[str, Memory]] | None = None  # as timing; crashed runs left out
    work: Mapping[str, Mapping[str, tuple[WorkShare, ...]]] | None = None  # as memory, per stage
    factory: str | None = None  # the command line's PACKAGE.MODULE:FACTORY (None: the API's caller)

    @property
    def ok(self) -> bool:
        """gradsafe's split equals fused in every check and refused nothing (exit 0)."""
        return self.refused is None and all(r.verdict == EXACT for r in self.gradsafe.values())

    @property
    def refused_only(self) -> bool:
        """gradsafe refused the model and got nothing wrong where it did not refuse (exit 2).

        On a schedule a refusing rank stops its peers mid-step: their crash is that refusal's.
        """
        tolerated = (EXACT, REFUSED, CRASH) if self.mode == SCHEDULE else (EXACT, REFUSED)
        return self.refused is not None and all(
            r.verdict in tolerated for r in self.gradsafe.values()
        )

    @property
    def orders(self) -> tuple[str, ...]:
        """The W orders checked: ``checks`` in one process; none on a schedule (its own order)."""
        return self.checks if self.mode == SINGLE_PROCESS else ()

    @property
    def unsplit_stages(self) -> tuple[int, ...]:
        """Stages no run splits: in one process the first of several, whose inputs need no
        gradient, runs fused as a schedule runs it (verify it as a one-stage list to check its
        split). A schedule runs every stage its own way: none."""
        return (0,) if self.mode == SINGLE_PROCESS and self.stages > 1 else ()

    @property
    def not_seen(self) -> Mapping[str, str] | None:
        """The hazards this mode cannot see, each with why (one process: H6, H7); None on a
        schedule, which sees both."""
        return NOT_SEEN if self.mode == SINGLE_PROCESS else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict; keys and their meaning are stable across gradsafe versions
        (format 3: one format for every mode; docs/verify.md maps the earlier ones to it)."""
        data = dataclasses.asdict(self)
        data["ok"] = self.ok
        data["refused_only"] = self.refused_only
        data["unsplit_stages"] = list(self.unsplit_stages)
        data["not_seen"] = (
            None
            if self.not_seen is None
            else {**self.not_seen, "how to check": schedule_hint(self.stages, self.factory)}
        )
        data["format"] = "gradsafe.verify/3"
        return _plain(data)

    def __str__(self) -> str:
        lines = [self._head(), "", *self._verdict_lines()]
        if self.refused is not None:
            lines += ["", f"gradsafe refuses this model: {self.refused}"]
        if self.hazards is not None:
            lines += ["", *self._hazard_lines()]
        worst = "; worst over orders" if self.mode == SINGLE_PROCESS else ""
        lines += ["", f"Gradients that differ from fused (relative error{worst}):"]
        lines += self._gradient_lines()
        if self.hooks is not None:
            lines += [
                "",
                f"Hooks, recomputations, custom-Function backwards: {len(self.hooks)} counted",
                *self._hook_lines(),
            ]
        if self.timing:
            lines += ["", *_timing_lines(self.timing)]
        if self.memory:
            lines += ["", *_memory_lines(self.memory)]
        if self.work:
            lines += ["", *_work_lines(self.work)]
        if self.mode == SINGLE_PROCESS:
            lines += ["", *self._scope_lines()]
        return "\n".join([*lines, "", self._conclusion()])

    def _head(self) -> str:
        common = (
            f"{self.dtype}, torch {self.torch_version}, tolerance {self.tolerance:g} (relative)"
        )
        if self.mode == SCHEDULE:
            return (
                f"gradsafe verify --schedule {self.schedule}: {self.ranks} gloo "
                f"rank{'s' * (self.ranks != 1)}, {common}, "
                "against one process"
            )
        return (
            f"gradsafe verify: {self.stages} stage(s), {self.microbatches} microbatch(es), {common}"
        )

    def _conclusion(self) -> str:
        if not self.ok:
            return "NOT OK."
        if self.mode == SCHEDULE:
            return "OK: every rank's gradients equal the reference."
        return "OK: gradsafe equals the fused backward."

    def _hazard_lines(self) -> list[str]:
        found = [
            f"  {name}: {', '.join(params[:6])}"
            + (f" (and {len(params) - 6} more)" if len(params) > 6 else "")
            for name, params in (self.hazards or {}).items()
        ]
        where = doc("hazards.md")
        return [f"Hazards found (H1 variants, see {where}):", *(found or ["  none"])]

    def _scope_lines(self) -> list[str]:
        """What this mode did not check: the unsplit first stage, and the hazards of a step."""
        lines = [
            f"Stage {s} runs fused (its inputs need no gradient, as in a schedule): its split is "
            "not checked here; pass it alone (a one-stage list) to check it."
            for s in self.unsplit_stages
        ]
        lines.append("Not seen in one process (no schedule runs here):")
        lines += [f"  {name}: {why}" for name, why in NOT_SEEN.items()]
        return [*lines, f"  {schedule_hint(self.stages, self.factory)}."]

    def _verdict_lines(self) -> list[str]:
        """Each check's verdict per implementation, then every distinct error message once."""
        schedule = self.mode == SCHEDULE
        lines = _table(
            # On a schedule the gradsafe column is torch's schedule under gradsafe's patch.
            ["rank", "gradsafe.patch('pipelining')", "torch's split"]
            if schedule
            else ["W order", "gradsafe", "torch's split"],
            [
                [check, _cell(self.gradsafe[check]), _cell(self.upstream[check])]
                for check in self.checks
            ],
        )
        # One process: the same error in every order once; a schedule: each rank's own.
        messages = {
            f"{impl}{f' {check}' if schedule else ''}: {r.message}": None
            for impl, per in (("gradsafe", self.gradsafe), ("torch's split", self.upstream))
            for check, r in per.items()
            if r.message
        }
        return lines + [f"  {' '.join(m.split())[:300]}" for m in messages]

    def _gradient_lines(self) -> list[str]:
        """The gradients some run got wrong, one row each; the others counted in one line."""
        # A crashed or refused run (ok None) is one line of the verdict table, not a row per gradient.
        shown = [
            r
            for r in self.grads
            if any(ok is False for per in r.ok.values() for ok in per.values())
        ]
        none_finished = self._gradsafe_finished_none()
        lines = (
            ([] if none_finished else ["  none"])
            if not shown
            else _table(
                ["gradient", "shape", "max|fused|", "gradsafe", "torch's split"],
                [
                    [
                        row.name,
                        "x".join(map(str, row.shape)) or "scalar",
                        "None" if row.fused_max is None else f"{row.fused_max:.3g}",
                        _worst(row, "gradsafe"),
                        _worst(row, "upstream"),
                    ]
                    for row in shown
                ],
            )
        )
        exact = [r for r in self.grads if r not in shown]
        if none_finished:
            lines.append(_NONE_FINISHED)
        elif exact:
            worst = max(
                (
                    v
                    for r in exact
                    for per in r.errors.values()
                    for v in per.values()
                    if isinstance(v, float)
                ),
                default=0.0,
            )
            lines.append(
                f"  {len(exact)} gradient(s) equal fused in every run that finished "
                f"(worst relative error {worst:.2g})"
            )
        return lines

    def _gradsafe_finished_none(self) -> bool:
        """No check of gradsafe's ran to the end (all refused or crashed): nothing of it compared."""
        return all(r.verdict in (REFUSED, CRASH) for r in self.gradsafe.values())

    def _hook_lines(self) -> list[str]:
        differing = [
            h
            for h in self.hooks or ()
            if any(c is not None and c != h.fused for m in h.calls.values() for c in m.values())
        ]
        if not differing:
            return [
                _NONE_FINISHED if self._gradsafe_finished_none() else "  every count equals fused"
            ]
        return _table(
            ["counted", "fused", "gradsafe", "torch's split"],
            [
                [h.label, str(h.fused), _calls(h, "gradsafe"), _calls(h, "upstream")]
                for h in differing
            ],
        )


def _timing_lines(timing: Mapping[str, Mapping[str, Timing]]) -> list[str]:
    fused = timing["fused"]["fused"]
    lines = [
        "Backward time (CPU / wall, x fused; CPU: the calling thread's, on CUDA the process's):"
    ]
    for impl, per in timing.items():
        for order, t in per.items():
            lines.append(
                f"  {impl:8} {order:12} {t.cpu_s:8.3f} s cpu ({t.cpu_s / max(fused.cpu_s, 1e-9):.2f}x)"
                f" {t.wall_s:8.3f} s wall ({t.wall_s / max(fused.wall_s, 1e-9):.2f}x)"
            )
    return lines


def _memory_lines(memory: Mapping[str, Mapping[str, Memory]]) -> list[str]:
    fused_peak = memory["fused"]["fused"].peak_bytes
    lines = ["Peak live tensor memory (MiB, x fused):"]
    for impl, per_order in memory.items():
        for order, m in per_order.items():
            lines.append(
                f"  {impl:8} {order:12} {m.peak_bytes / 2**20:10.3f} MiB"
                f" ({m.peak_bytes / max(fused_peak, 1):.2f}x)"
            )
    return lines


_RUN_NAMES = {"upstream": "torch's split", "uncheckpointed": "gradsafe, no AC"}


def _work_rows(work: Mapping[str, Mapping[str, tuple[WorkShare, ...]]]) -> list[list[str]]:
    """One row per run and stage of ``--work``'s table."""
    fused = {w.stage: w.b_flops + w.w_flops for w in work["fused"]["fused"]}
    return [
        [
            _RUN_NAMES.get(impl, impl),
            order,
            str(w.stage),
            str(w.b_flops),
            str(w.w_flops),
            str(w.b_recomputed_flops + w.w_recomputed_flops),
            f"{(w.b_flops + w.w_flops) / fused[w.stage]:.2f}" if fused.get(w.stage) else "-",
            "-"
            if impl == "fused" or w.w_share is None
            else f"{w.w_share:.3f}" + (" LOW" if w.w_share_low else ""),
            "-"
            if impl == "fused" or w.w_share_of_gradients is None
            else f"{w.w_share_of_gradients:.3f}",
            str(w.recomputed),
        ]
        for impl, per_order in work.items()
        for order, stages in per_order.items()
        for w in stages
    ]


def _work_lines(work: Mapping[str, Mapping[str, tuple[WorkShare, ...]]]) -> list[str]:
    shares = [w for per_order in work.values() for stages in per_order.values() for w in stages]
    rows = _work_rows(work)
    lines = [
        "Backward matmul FLOPs per stage (a fused backward, and the fused first of several "
        "stages, count all in W):",
        "  recomputed: of B and W, those run in forwards re-run in the backward; x fused: B+W "
        "over the fused backward's;",
        "  W share of backward: W/(B+W), recomputation included (what a zero-bubble schedule "
        "moves into its bubbles); of gradients: recomputation left out;",
        "  gradsafe, no AC: gradsafe's split with activation checkpointing off; LOW: a W share "
        "of backward under half of that run's.",
        *_table(
            [
                "run",
                "order",
                "stage",
                "B",
                "W",
                "recomputed",
                "x fused",
                "W share of backward",
                "of gradients",
                "forwards re-run",
            ],
            rows,
        ),
    ]
    if any(w.w_share_low for w in shares):
        lines.append(
            "  LOW: W carries under half the share it carries on the same stage without "
            "checkpointing, so a zero-bubble schedule has that much less W to fill its bubbles "
            "with. Either weight gradients run in B (CheckpointedWeights.IN_B, a custom Function "
            "without a delayed path, a compiled region; gradsafe's default IN_W runs checkpointed "
            f"ones in W: {doc('pipelining.md')}) or B's recomputation is most of the work "
            "(matmuls with no weight gradient recomputed, such as a table built in the forward)."
        )
    whole = {w.stage: w.unsplit_compiled for w in shares if w.unsplit_compiled}
    lines += [
        f"  stage {stage}: {count} torch.compile'd region(s) ran their backward whole in B, "
        "compiled without gradsafe's split (before gradsafe.patch(), or on a torch whose "
        "AOTAutograd the split does not fit: `gradsafe doctor` says which), so W gets none of "
        "their weight gradients."
        for stage, count in sorted(whole.items())
    ]
    missing = {w.not_measured for w in shares if w.not_measured}
    lines += [f"  Uncheckpointed share not measured: {why}." for why in missing]
    return lines


def _cell(result: OrderResult) -> str:
    """One check's verdict of one implementation, as the table shows it."""
    if result.verdict in (CRASH, REFUSED) and result.where:
        return f"{result.verdict} in {result.where}"
    parts = [result.verdict]
    if result.params:
        parts.append(", ".join(result.params[:4]) + (" ..." if len(result.params) > 4 else ""))
    if result.hooks:
        parts.append(f"({len(result.hooks)} count(s))")
    return " ".join(parts)


def _worst(row: GradRow, impl: str) -> str:
    values = list(row.errors.get(impl, {}).values())
    if any(v == "None pattern" for v in values):
        return "None pattern!"
    numbers = [v for v in values if isinstance(v, float)]
    if not numbers:
        return "-"
    bad = any(ok is False for ok in row.ok.get(impl, {}).values())
    return f"{max(numbers):.2g}" + (" WRONG" if bad else "")


def _calls(row: HookRow, impl: str) -> str:
    return " ".join("-" if c is None else str(c) for c in row.calls.get(impl, {}).values())


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return ["  " + fmt.format(*header).rstrip(), "  " + "  ".join("-" * w for w in widths)] + [
        "  " + fmt.format(*r).rstrip() for r in rows
    ]


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
