"""The order in which CUDA graphs of a pipeline rank are captured, typed and validated (hazard H5).

Graphs captured into one memory pool may only reuse each other's memory in the
order they were captured, so a rank's forward, dgrad (input-gradient, the
schedule's ``I``/``B``) and delayed wgrad (weight-gradient, the schedule's
``W``) graphs must be captured in the order the schedule will replay them.
TransformerEngine encodes that order as a list of floats (``c`` forward of
chunk ``c``, ``-c`` its dgrad, ``-c-0.5`` its delayed wgrad, chunks 1-based)
and checks only that each chunk has as many wgrad as dgrad entries; which
microbatch a wgrad entry belongs to is implied by position. Orders that pass
that count but map two wgrad entries to one microbatch (or a wgrad to no
dgrad yet) then fail in the middle of its capture, with an error that names
neither the entry nor the rule.

:class:`CaptureOrder` names the microbatch of every entry, validates the
order (the error names the position and the rule), derives it from a
``torch.distributed.pipelining`` schedule's action list, and converts to and
from TransformerEngine's list. Pure Python; no GPU is needed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "CaptureEntry",
    "CaptureOrder",
    "CaptureOrderError",
    "EntryKind",
    "Rule",
    "TEOrder",
]


class EntryKind(enum.Enum):
    """What one captured graph computes."""

    FORWARD = "F"
    DGRAD = "D"  # input gradients; the whole backward for a chunk without delayed wgrad
    WGRAD = "W"  # delayed weight gradients


class Rule(enum.Enum):
    """The rules a capture order is checked against; an error names the one broken."""

    ONE_PER_MICROBATCH = "one-forward-and-one-dgrad-per-microbatch"
    FORWARD_BEFORE_DGRAD = "forward-before-dgrad"
    WGRAD_AFTER_DGRAD = "wgrad-after-its-dgrad"
    ONE_WGRAD_PER_DGRAD = "one-wgrad-per-dgrad"
    WGRAD_ONLY_FOR_DELAYED_CHUNKS = "wgrad-only-for-delayed-chunks"
    # Optional (strict=True): a chunk's wgrad comes before that chunk's next dgrad. It is what
    # TransformerEngine's wgrad matching needs; Megatron-built orders satisfy it.
    WGRAD_BEFORE_NEXT_DGRAD = "wgrad-before-next-dgrad"
    # What TransformerEngine's list format can express.
    TE_FORMAT = "transformer-engine-format"


class CaptureOrderError(ValueError):
    """A capture order breaks ``rule`` at ``position`` (None: the order as a whole)."""

    def __init__(self, rule: Rule, position: int | None, message: str) -> None:
        where = f"position {position}" if position is not None else "capture order"
        super().__init__(f"{where}: [{rule.value}] {message}")
        self.rule = rule
        self.position = position


@dataclasses.dataclass(frozen=True)
class CaptureEntry:
    """One graph: the forward, dgrad or wgrad of ``chunk`` (0-based, local to the rank) for ``microbatch``."""

    kind: EntryKind
    chunk: int
    microbatch: int

    @classmethod
    def forward(cls, chunk: int, microbatch: int) -> CaptureEntry:
        return cls(EntryKind.FORWARD, chunk, microbatch)

    @classmethod
    def dgrad(cls, chunk: int, microbatch: int) -> CaptureEntry:
        return cls(EntryKind.DGRAD, chunk, microbatch)

    @classmethod
    def wgrad(cls, chunk: int, microbatch: int) -> CaptureEntry:
        return cls(EntryKind.WGRAD, chunk, microbatch)

    def __str__(self) -> str:
        return f"{self.kind.value}(c{self.chunk},mb{self.microbatch})"


@dataclasses.dataclass(frozen=True)
class TEOrder:
    """TransformerEngine's ``_order`` and ``_num_layers_per_chunk`` for ``make_graphed_callables``.

    With delayed wgrad TransformerEngine needs one layer per chunk, so each
    chunk of ``L`` layers becomes ``L`` consecutive TransformerEngine chunks
    (its forward lists them first to last, its dgrad and wgrad last to
    first); ``sample_args`` are then indexed ``layer * num_microbatches + microbatch``.
    """

    order: tuple[float, ...]
    num_layers_per_chunk: tuple[int, ...]

    def kwargs(self) -> dict[str, list[Any]]:
        """Keyword arguments for ``transformer_engine.pytorch.make_graphed_callables``."""
        return {
            "_order": list(self.order),
            "_num_layers_per_chunk": list(self.num_layers_per_chunk),
        }


@dataclasses.dataclass(frozen=True)
class CaptureOrder:
    """A validated capture order for one pipeline rank.

    Args:
        entries: the graphs in capture order.
        delayed_wgrad_chunks: chunks that have a delayed-wgrad module, i.e.
            whose weight gradients are their own graph. Default: the chunks
            that have a wgrad entry.
        strict: also require each wgrad to be captured before its chunk's
            next dgrad (the stricter rule Megatron's orders follow, and what
            TransformerEngine's list format can express).
        stage_indices: for an order derived from a pipeline schedule, the
            schedule's stage index of each chunk (chunk ``i`` is
            ``stage_indices[i]``); empty otherwise.

    Raises:
        CaptureOrderError: the first position, in capture order, at which a rule is broken.

    Example::

        >>> from gradsafe.cuda_graphs import CaptureEntry, CaptureOrder, CaptureOrderError
        >>> F, B, W = CaptureEntry.forward, CaptureEntry.dgrad, CaptureEntry.wgrad
        >>> print(CaptureOrder([F(0, 0), F(0, 1), B(0, 0), W(0, 0), B(0, 1), W(0, 1)]))
        F(c0,mb0) F(c0,mb1) D(c0,mb0) W(c0,mb0) D(c0,mb1) W(c0,mb1)
        >>> try:
        ...     CaptureOrder([F(0, 0), W(0, 0), B(0, 0)])
        ... except CaptureOrderError as error:
        ...     print(error.position, error.rule.value)
        1 wgrad-after-its-dgrad
    """

    entries: tuple[CaptureEntry, ...]
    delayed_wgrad_chunks: frozenset[int] = dataclasses.field(default=frozenset())
    strict: bool = False
    stage_indices: tuple[int, ...] = ()

    def __init__(
        self,
        entries: Iterable[CaptureEntry],
        *,
        delayed_wgrad_chunks: Iterable[int] | None = None,
        strict: bool = False,
        stage_indices: Sequence[int] = (),
    ) -> None:
        entries = tuple(entries)
        for position, entry in enumerate(entries):
            if not isinstance(entry, CaptureEntry):
                raise TypeError(
                    f"CaptureOrder: position {position} is {entry!r}; build entries with "
                    "CaptureEntry.forward/dgrad/wgrad(chunk, microbatch)"
                )
        if delayed_wgrad_chunks is None:
            delayed = frozenset(e.chunk for e in entries if e.kind is EntryKind.WGRAD)
        else:
            delayed = frozenset(delayed_wgrad_chunks)
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "delayed_wgrad_chunks", delayed)
        object.__setattr__(self, "strict", strict)
        object.__setattr__(self, "stage_indices", tuple(stage_indices))
        _validate(self)

    def __iter__(self) -> Iterator[CaptureEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __str__(self) -> str:
        return " ".join(str(e) for e in self.entries)

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(sorted({e.chunk for e in self.entries}))

    def microbatches(self, chunk: int) -> tuple[int, ...]:
        """The microbatches ``chunk`` runs, in the order their forwards are captured."""
        return tuple(
            e.microbatch for e in self.entries if e.chunk == chunk and e.kind is EntryKind.FORWARD
        )

    # -- pipeline schedules -------------------------------------------------

    @classmethod
    def from_actions(cls, actions: Iterable[Any], *, strict: bool = False) -> CaptureOrder:
        """The capture order of one rank's ``torch.distributed.pipelining`` action list.

        ``actions`` are ``_Action`` objects (or their strings, e.g. ``"0F1"``);
        ``None`` and communication actions are skipped, ``OVERLAP_F_B`` is
        taken in the order of its sub-actions. Chunks are the rank's stage
        indices in ascending order. ``F`` is a forward, ``I`` a dgrad, ``W`` a
        wgrad. A stage that has any ``I`` or ``W`` action has delayed wgrad,
        and its full backward ``B`` (which schedules use where ``W`` follows
        ``I`` at once) is a dgrad then a wgrad; on any other stage ``B`` is
        a dgrad whose graph computes the weight gradients too.
        """
        compute = list(_flatten_actions(actions))
        stages = sorted({stage for stage, _, _ in compute})
        chunk_of = {stage: chunk for chunk, stage in enumerate(stages)}
        delayed = {
            stage for stage, kind, _ in compute if kind in ("BACKWARD_INPUT", "BACKWARD_WEIGHT")
        }
        entries: list[CaptureEntry] = []
        for stage, kind, microbatch in compute:
            chunk = chunk_of[stage]
            if kind == "FORWARD":
                entries.append(CaptureEntry.forward(chunk, microbatch))
            elif kind == "BACKWARD_INPUT":
                entries.append(CaptureEntry.dgrad(chunk, microbatch))
            elif kind == "BACKWARD_WEIGHT":
                entries.append(CaptureEntry.wgrad(chunk, microbatch))
            else:  # FULL_BACKWARD
                entries.append(CaptureEntry.dgrad(chunk, microbatch))
                if stage in delayed:
                    entries.append(CaptureEntry.wgrad(chunk, microbatch))
        return cls(
            entries,
            delayed_wgrad_chunks={chunk_of[s] for s in delayed},
            strict=strict,
            stage_indices=stages,
        )

    @classmethod
    def from_schedule(cls, schedule: Any, rank: int, *, strict: bool = False) -> CaptureOrder:
        """The capture order of ``rank`` under ``schedule``, a ``torch.distributed.pipelining`` schedule.

        Reads the action list the schedule's runtime executes
        (``pipeline_order_with_comms`` where the schedule has one, else
        ``pipeline_order``). Single-stage schedules (``Schedule1F1B``,
        ``ScheduleGPipe``) run a fixed loop, not their ``pipeline_order``,
        which only describes it.
        """
        for attr in ("pipeline_order_with_comms", "pipeline_order"):
            table = getattr(schedule, attr, None)
            if isinstance(table, Mapping):
                break
        else:
            raise TypeError(
                f"CaptureOrder.from_schedule: {type(schedule).__name__} has no per-rank action list "
                "(pipeline_order); build the order with CaptureOrder.from_actions or CaptureOrder(...)"
            )
        if rank not in table:
            raise ValueError(
                f"CaptureOrder.from_schedule: rank {rank} is not in the schedule's {attr} "
                f"(ranks {sorted(table)})"
            )
        return cls.from_actions(table[rank], strict=strict)

    @classmethod
    def from_schedule_class(
        cls,
        schedule_cls: type,
        *,
        rank: int,
        ranks: int,
        microbatches: int,
        stages_per_rank: int = 2,
        strict: bool = False,
    ) -> CaptureOrder:
        """The capture order ``rank`` would get from ``schedule_cls``, without a process group.

        Builds the schedule on placeholder stages that carry only their
        indices (every rank's action list is computed from the group size,
        so one instance describes all ranks) and reads it with
        :meth:`from_schedule`. The instance is discarded; it cannot run.
        ``stages_per_rank`` is for multi-stage schedules; a single-stage
        schedule class gets one stage.
        """
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        if not 0 <= rank < ranks:
            raise ValueError(
                f"CaptureOrder.from_schedule_class: rank {rank} is not in range({ranks})"
            )
        single = issubclass(schedule_cls, PipelineScheduleSingle)
        per_rank = 1 if single else stages_per_rank
        num_stages = ranks * per_rank
        stages = [_PlaceholderStage(k * ranks, num_stages, ranks) for k in range(per_rank)]
        try:
            schedule = schedule_cls(
                stages[0] if single else stages, n_microbatches=microbatches, loss_fn=_no_loss
            )
        except (AttributeError, TypeError) as exc:
            raise TypeError(
                f"CaptureOrder.from_schedule_class: {schedule_cls.__name__} needs more of its stages "
                f"than their indices ({exc}); build it with real stages (torch's fake process group "
                "works) and call CaptureOrder.from_schedule"
            ) from exc
        return cls.from_schedule(schedule, rank, strict=strict)

    # -- TransformerEngine ----------------------------------------------------

    def to_te_order(self, layers_per_chunk: int | Sequence[int] = 1) -> TEOrder:
        """TransformerEngine's ``_order`` (chunk ids 1-based) and ``_num_layers_per_chunk``.

        TransformerEngine gives a chunk's forwards and dgrads microbatches in
        the order they appear and matches a wgrad entry to its chunk's most
        recent dgrad, so every chunk must run microbatches ``0, 1, ...`` in
        order, the same number of them, and each wgrad must come before its
        chunk's next dgrad (the ``strict`` rule).

        Raises:
            CaptureOrderError: the order cannot be expressed in TransformerEngine's format.
        """
        chunks = self.chunks
        if isinstance(layers_per_chunk, int):
            layers = [layers_per_chunk] * len(chunks)
        else:
            layers = list(layers_per_chunk)
        if len(layers) != len(chunks) or any(n < 1 for n in layers):
            raise ValueError(
                f"to_te_order: layers_per_chunk must be a positive int or one per chunk "
                f"({len(chunks)}), got {layers_per_chunk!r}"
            )
        _check_te_expressible(self)
        if not any(e.kind is EntryKind.WGRAD for e in self.entries):
            order: list[float] = [
                (e.chunk + 1) if e.kind is EntryKind.FORWARD else -(e.chunk + 1)
                for e in self.entries
            ]
            return TEOrder(tuple(order), tuple(layers))
        # Delayed wgrad: TransformerEngine needs one layer per chunk, so layers become chunks.
        first_layer = [sum(layers[:c]) for c in range(len(chunks))]
        order = []
        for e in self.entries:
            ids = [first_layer[e.chunk] + layer + 1 for layer in range(layers[e.chunk])]
            if e.kind is EntryKind.FORWARD:
                order += ids
            elif e.kind is EntryKind.DGRAD:
                order += [-i for i in reversed(ids)]
            else:
                order += [-i - 0.5 for i in reversed(ids)]
        return TEOrder(tuple(order), (1,) * sum(layers))

    @classmethod
    def from_te_order(
        cls,
        order: Sequence[float],
        *,
        delayed_wgrad_chunks: Iterable[int] | None = None,
        strict: bool = False,
    ) -> CaptureOrder:
        """Parse TransformerEngine's ``_order`` the way TransformerEngine indexes it, and validate it.

        A forward or dgrad entry of chunk ``c`` gets the microbatch numbered by
        how many entries of its kind chunk ``c`` had before; a wgrad entry
        gets the microbatch of chunk ``c``'s most recent dgrad (that is what
        TransformerEngine's index arithmetic selects). The returned order's
        wgrad entries therefore say which microbatch TransformerEngine will
        capture for them. Chunks are 0-based (TransformerEngine's id minus 1).

        Args:
            delayed_wgrad_chunks: 0-based chunks that have a delayed-wgrad
                module (TransformerEngine checks this against its modules);
                default: the chunks that have a wgrad entry.

        Raises:
            CaptureOrderError: an order TransformerEngine would refuse, or one
                whose count it accepts and whose capture then fails (e.g.
                ``[1, 1, -1, -1, -1.5, -1.5]``: both wgrad entries match
                microbatch 1, and the second capture into its graph raises).
        """
        # Over 60 lines on purpose: one pass that repeats TransformerEngine's
        # index arithmetic, its two refusals next to the counts they read.
        forwards: dict[int, int] = {}
        dgrads: dict[int, int] = {}
        wgrad_taken: dict[tuple[int, int], int] = {}
        entries: list[CaptureEntry] = []
        for position, value in enumerate(order):
            kind, chunk = _parse_te_value(position, value)
            if kind is EntryKind.FORWARD:
                entries.append(CaptureEntry.forward(chunk, forwards.get(chunk, 0)))
                forwards[chunk] = forwards.get(chunk, 0) + 1
            elif kind is EntryKind.DGRAD:
                entries.append(CaptureEntry.dgrad(chunk, dgrads.get(chunk, 0)))
                dgrads[chunk] = dgrads.get(chunk, 0) + 1
            else:
                microbatch = dgrads.get(chunk, 0) - 1
                if microbatch < 0:
                    raise CaptureOrderError(
                        Rule.WGRAD_AFTER_DGRAD,
                        position,
                        f"{value} comes before any dgrad of chunk {chunk + 1}; TransformerEngine "
                        "matches a wgrad entry to its chunk's most recent dgrad, so its index here "
                        "is one below the chunk's first (KeyError: -1 in TransformerEngine for "
                        "chunk 1, the previous chunk's last graph otherwise). Move it after that "
                        "chunk's dgrad.",
                    )
                if (chunk, microbatch) in wgrad_taken:
                    raise CaptureOrderError(
                        Rule.ONE_WGRAD_PER_DGRAD,
                        position,
                        f"{value} is matched by TransformerEngine to chunk {chunk + 1}'s most recent "
                        f"dgrad, microbatch {microbatch}, which position "
                        f"{wgrad_taken[(chunk, microbatch)]} already has; TransformerEngine's count "
                        'check passes, and its capture then fails ("This CUDAGraph instance '
                        "already owns a captured graph\"). Put each wgrad before its chunk's next "
                        "dgrad.",
                    )
                wgrad_taken[(chunk, microbatch)] = position
                entries.append(CaptureEntry.wgrad(chunk, microbatch))
        result = cls(entries, delayed_wgrad_chunks=delayed_wgrad_chunks, strict=strict)
        _check_te_expressible(result)
        return result


def _no_loss(output: Any, target: Any) -> Any:
    return output


class _PlaceholderStage:
    """Just enough of a pipeline stage for a schedule's constructor to compute its action lists."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int) -> None:
        import torch

        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = torch.nn.Module()


_COMPUTE = ("FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FULL_BACKWARD")


def _flatten_actions(actions: Iterable[Any]) -> Iterable[tuple[int, str, int]]:
    """(stage, computation type name, microbatch) of each compute action, sub-actions in order."""
    for action in actions:
        if action is None:
            continue
        if isinstance(action, str):
            from gradsafe.cuda_graphs._structure import schedule_action

            action = schedule_action(action)
            if action is None:
                continue
        if getattr(action, "sub_actions", None):
            yield from _flatten_actions(action.sub_actions)
            continue
        # Enum member names are the same on every torch that has these schedules; values are not.
        kind = action.computation_type.name
        if kind not in _COMPUTE:
            continue
        if action.microbatch_index is None:
            raise ValueError(
                f"CaptureOrder.from_actions: compute action {action} has no microbatch"
            )
        yield action.stage_index, kind, action.microbatch_index


def _parse_te_value(position: int, value: float) -> tuple[EntryKind, int]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CaptureOrderError(Rule.TE_FORMAT, position, f"{value!r} is not a chunk id")
    if value > 0:
        # TransformerEngine raises TypeError for a float forward id, even 2.0.
        if not isinstance(value, int):
            raise CaptureOrderError(
                Rule.TE_FORMAT, position, f"forward entry {value!r} must be an int chunk id"
            )
        return EntryKind.FORWARD, value - 1
    if value == int(value) and value < 0:
        return EntryKind.DGRAD, -int(value) - 1
    if value <= -1.5 and value + 0.5 == int(value + 0.5):
        return EntryKind.WGRAD, -int(value + 0.5) - 1
    raise CaptureOrderError(
        Rule.TE_FORMAT,
        position,
        f"{value!r} is neither c (forward), -c (dgrad) nor -c-0.5 (wgrad) for a chunk id c >= 1",
    )


def _validate(order: CaptureOrder) -> None:
    positions = _Positions(order)
    for position, e in enumerate(order.entries):
        if e.kind is EntryKind.FORWARD:
            positions.forward(position, e)
        elif e.kind is EntryKind.DGRAD:
            positions.dgrad(position, e)
        else:
            positions.wgrad(position, e)
    positions.check_complete()


class _Positions:
    """One pass of :func:`_validate` over the entries: where each was seen so far, and the rule each breaks."""

    def __init__(self, order: CaptureOrder) -> None:
        self.order = order
        self.forward_at: dict[tuple[int, int], int] = {}
        self.dgrad_at: dict[tuple[int, int], int] = {}
        self.wgrad_at: dict[tuple[int, int], int] = {}
        # Strict rule: per delayed chunk, the dgrad whose wgrad has not been captured yet.
        self.open_dgrad: dict[int, tuple[int, int]] = {}

    def forward(self, position: int, e: CaptureEntry) -> None:
        key = (e.chunk, e.microbatch)
        if key in self.forward_at:
            raise CaptureOrderError(
                Rule.ONE_PER_MICROBATCH,
                position,
                f"{e} repeats the forward at position {self.forward_at[key]}",
            )
        self.forward_at[key] = position

    def dgrad(self, position: int, e: CaptureEntry) -> None:
        key = (e.chunk, e.microbatch)
        if key in self.dgrad_at:
            raise CaptureOrderError(
                Rule.ONE_PER_MICROBATCH,
                position,
                f"{e} repeats the dgrad at position {self.dgrad_at[key]}",
            )
        if key not in self.forward_at:
            raise CaptureOrderError(
                Rule.FORWARD_BEFORE_DGRAD,
                position,
                f"{e} comes before the forward of chunk {e.chunk} microbatch {e.microbatch}",
            )
        if self.order.strict and e.chunk in self.open_dgrad:
            earlier, microbatch = self.open_dgrad[e.chunk]
            raise CaptureOrderError(
                Rule.WGRAD_BEFORE_NEXT_DGRAD,
                position,
                f"{e} comes before the wgrad of chunk {e.chunk} microbatch {microbatch} "
                f"(dgrad at position {earlier}); a strict order captures each wgrad before its "
                "chunk's next dgrad",
            )
        self.dgrad_at[key] = position
        if e.chunk in self.order.delayed_wgrad_chunks:
            self.open_dgrad[e.chunk] = (position, e.microbatch)

    def wgrad(self, position: int, e: CaptureEntry) -> None:
        key = (e.chunk, e.microbatch)
        if e.chunk not in self.order.delayed_wgrad_chunks:
            raise CaptureOrderError(
                Rule.WGRAD_ONLY_FOR_DELAYED_CHUNKS,
                position,
                f"{e}: chunk {e.chunk} has no delayed-wgrad module (its dgrad graph computes the "
                "weight gradients); remove the entry or declare the chunk in delayed_wgrad_chunks",
            )
        if key in self.wgrad_at:
            raise CaptureOrderError(
                Rule.ONE_WGRAD_PER_DGRAD,
                position,
                f"{e} repeats the wgrad at position {self.wgrad_at[key]}",
            )
        if key not in self.dgrad_at:
            raise CaptureOrderError(
                Rule.WGRAD_AFTER_DGRAD,
                position,
                f"{e} comes before the dgrad of chunk {e.chunk} microbatch {e.microbatch}, "
                "which records what the wgrad needs",
            )
        self.wgrad_at[key] = position
        if self.open_dgrad.get(e.chunk, (None, None))[1] == e.microbatch:
            del self.open_dgrad[e.chunk]

    def check_complete(self) -> None:
        """Every forward has its dgrad, every dgrad of a delayed chunk its wgrad."""
        for key, position in sorted(self.forward_at.items(), key=lambda kv: kv[1]):
            if key not in self.dgrad_at:
                raise CaptureOrderError(
                    Rule.ONE_PER_MICROBATCH,
                    position,
                    f"{self.order.entries[position]} has no dgrad of chunk {key[0]} microbatch {key[1]}",
                )
        for key, position in sorted(self.dgrad_at.items(), key=lambda kv: kv[1]):
            if key[0] in self.order.delayed_wgrad_chunks and key not in self.wgrad_at:
                raise CaptureOrderError(
                    Rule.ONE_WGRAD_PER_DGRAD,
                    position,
                    f"{self.order.entries[position]} has no wgrad, but chunk {key[0]} delays its wgrad",
                )


def _check_te_expressible(order: CaptureOrder) -> None:
    """TransformerEngine numbers microbatches by occurrence and expects chunks 1..max, equally long."""
    chunks = order.chunks
    if chunks != tuple(range(len(chunks))):
        raise CaptureOrderError(
            Rule.TE_FORMAT,
            None,
            f"chunks {list(chunks)} are not 0..{len(chunks) - 1}; TransformerEngine takes the "
            "number of chunks from the largest id",
        )
    counts = {c: len(order.microbatches(c)) for c in chunks}
    if len(set(counts.values())) > 1:
        raise CaptureOrderError(
            Rule.TE_FORMAT,
            None,
            f"microbatches per chunk {counts} differ; TransformerEngine runs every chunk on the "
            "same number of microbatches",
        )
    seen: dict[tuple[EntryKind, int], int] = {}
    last_dgrad: dict[int, int] = {}
    for position, e in enumerate(order.entries):
        if e.kind is EntryKind.WGRAD:
            if last_dgrad.get(e.chunk) != e.microbatch:
                raise CaptureOrderError(
                    Rule.WGRAD_BEFORE_NEXT_DGRAD,
                    position,
                    f"{e}: TransformerEngine matches a wgrad entry to its chunk's most recent dgrad "
                    f"(microbatch {last_dgrad.get(e.chunk)}); capture each wgrad before its chunk's "
                    "next dgrad",
                )
            continue
        expected = seen.get((e.kind, e.chunk), 0)
        if e.microbatch != expected:
            raise CaptureOrderError(
                Rule.TE_FORMAT,
                position,
                f"{e}: TransformerEngine numbers a chunk's {e.kind.name.lower()} entries by "
                f"occurrence, so this one would be microbatch {expected}",
            )
        seen[(e.kind, e.chunk)] = expected + 1
        if e.kind is EntryKind.DGRAD:
            last_dgrad[e.chunk] = e.microbatch
