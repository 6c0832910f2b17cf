"""Doctor row for H5: a capture order TransformerEngine's count check accepts and its capture then fails.

TransformerEngine's ``make_graphed_callables(_order=...)`` is the upstream
here, not torch. Where TransformerEngine is installed and a GPU is present,
the doctor runs its own ``transformer_engine/pytorch/graph.py`` on the order
(:func:`load_te_graph`, :func:`run_te_order`). Elsewhere (gradsafe's CI has
neither) its capture loop is modelled below from that file
(NVIDIA/TransformerEngine main, August 2026), with one layer per chunk as
TransformerEngine requires when wgrad is delayed:

* validation, at each dgrad entry ``-c`` of a chunk with delayed wgrad (not
  yet validated): scan forward, counting further ``-c`` entries and
  ``-c-0.5`` entries, until the two counts are equal (all those dgrads are
  then valid) or wgrads outnumber dgrads (error); running out is an error.
  Nothing else is checked about where a wgrad entry sits.
* index: a wgrad entry of chunk ``c`` picks graph index
  ``(dgrads of c so far) - 1``, the microbatch of chunk ``c``'s most recent
  dgrad, and looks it up in ``need_bwd_dw_graph``, a dict keyed by the
  forwards' indices: before chunk 1's first dgrad the index is -1 and the
  lookup raises ``KeyError: -1`` (before a later chunk's first dgrad it is
  the previous chunk's last microbatch).
* capture: into ``bwd_dw_graphs[index]``; a second capture into one
  ``CUDAGraph`` raises torch's "This CUDAGraph instance already owns a
  captured graph", which is what an order that passes the count check with
  two wgrad entries for one microbatch gets.

The reproduction is written here once; tests and the benchmark import it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from gradsafe.checks import Check, Outcome
from gradsafe.cuda_graphs.capture_order import CaptureOrder, CaptureOrderError, Rule

# The seed report's example: both delayed wgrad entries after both dgrads of chunk 1.
WRONG_TE_ORDER: tuple[float, ...] = (1, 1, -1, -1, -1.5, -1.5)

UPSTREAM_SOURCE = (
    "TransformerEngine make_graphed_callables(_order=): its own graph.py where it is installed "
    "and a GPU is present, else its validation and capture loop modelled from graph.py "
    "(the cell says which)"
)

ALREADY_CAPTURED = (
    "This CUDAGraph instance already owns a captured graph. To capture a new graph, "
    "create a new instance."
)


def _delayed(order: Sequence[float], delayed_chunks: Iterable[int] | None) -> set[float]:
    if delayed_chunks is None:
        return {-(v + 0.5) for v in order if v < 0 and v != int(v)}
    return set(delayed_chunks)


def _scan(order: Sequence[float], i: int) -> tuple[list[int], int, bool]:
    """TransformerEngine's validation scan from dgrad ``i``: (same-chunk dgrads, wgrads, balanced)."""
    value = order[i]
    same_dgrads, wgrads = [i], 0
    for j in range(i + 1, len(order)):
        other = order[j]
        if other > 0:
            continue
        if other == value:
            same_dgrads.append(j)
        if other + 0.5 == value:
            wgrads += 1
        if len(same_dgrads) == wgrads:
            return same_dgrads, wgrads, True
        if len(same_dgrads) < wgrads:
            break
    return same_dgrads, wgrads, False


def _count_error(value: float, same_dgrads: list[int], wgrads: int) -> str:
    return (
        f"Number of wgrad graph({wgrads}) doesn't match number of dgrad graphs "
        f"({len(same_dgrads)}) for chunk {value}."
    )


def te_count_check(
    order: Sequence[float], delayed_chunks: Iterable[int] | None = None
) -> str | None:
    """TransformerEngine's wgrad validation, modelled: its error message, or None if it accepts.

    ``delayed_chunks`` are TransformerEngine's 1-based chunk ids whose modules
    delay wgrad (default: the chunks that have a wgrad entry).
    """
    delayed = _delayed(order, delayed_chunks)
    validated: set[int] = set()
    for i, value in enumerate(order):
        if value >= 0 or value != int(value) or -value not in delayed or i in validated:
            continue
        same_dgrads, wgrads, balanced = _scan(order, i)
        if not balanced:
            return _count_error(value, same_dgrads, wgrads)
        validated.update(same_dgrads)
    return None


def te_wgrad_matches(order: Sequence[float]) -> list[tuple[int, int, int]]:
    """(position, 1-based chunk, microbatch) TransformerEngine captures for each wgrad entry, modelled."""
    dgrads: Counter[float] = Counter()
    matches = []
    for position, value in enumerate(order):
        if value < 0 and value == int(value):
            dgrads[-value] += 1
        elif value < 0:
            chunk = -(value + 0.5)
            matches.append((position, int(chunk), dgrads[chunk] - 1))
    return matches


@dataclasses.dataclass(frozen=True)
class TECapture:
    """What TransformerEngine's ``make_graphed_callables(_order=...)`` did with an order.

    ``error`` is the exception it raised (``"KeyError: -1"``), None if every
    graph was captured; ``passed_count_check`` is False when that exception is
    the up-front count check; ``position`` is the order entry at which the model
    raised (None from a real run: TransformerEngine does not say);
    ``wgrad_graphs`` are the (position, 1-based chunk, microbatch) of the wgrad
    graphs captured before that.
    """

    error: str | None
    passed_count_check: bool = True
    position: int | None = None
    wgrad_graphs: tuple[tuple[int, int, int], ...] = ()


def te_capture(order: Sequence[float], delayed_chunks: Iterable[int] | None = None) -> TECapture:
    """TransformerEngine's capture loop over ``order``, modelled (one layer per chunk)."""
    delayed = _delayed(order, delayed_chunks)
    dgrads_and_forwards = [v for v in order if v == int(v)]
    chunks = int(max(dgrads_and_forwards))
    microbatches = len(dgrads_and_forwards) // chunks // 2
    if chunks * microbatches * 2 != len(dgrads_and_forwards):
        return TECapture(
            "ValueError: Pipeline-parallel order dimension mismatch", passed_count_check=False
        )
    # Keyed by forward index, as TransformerEngine's dict: a missing key raises KeyError.
    need_wgrad_graph = {
        c * microbatches + mb: (c + 1) in delayed
        for c in range(chunks)
        for mb in range(microbatches)
    }
    captured: set[int] = set()
    wgrad_graphs: list[tuple[int, int, int]] = []
    dgrads = [0] * chunks
    validated: set[int] = set()

    def failed(position: int, error: str, passed_count_check: bool = True) -> TECapture:
        return TECapture(error, passed_count_check, position, tuple(wgrad_graphs))

    for i, value in enumerate(order):
        if value > 0:
            continue  # forward graphs: one per (chunk, microbatch), by occurrence
        chunk = -math.ceil(value) - 1
        index = chunk * microbatches + dgrads[chunk]
        if value == math.ceil(value):
            if index not in need_wgrad_graph:
                return failed(i, f"KeyError: {index}")
            if need_wgrad_graph[index] and i not in validated:
                same_dgrads, wgrads, balanced = _scan(order, i)
                if not balanced:
                    return failed(
                        i, f"RuntimeError: {_count_error(value, same_dgrads, wgrads)}", False
                    )
                validated.update(same_dgrads)
            dgrads[chunk] += 1
            continue
        index -= 1
        if math.ceil(value) - value != 0.5:
            return failed(i, "ValueError: The order diff of wgrad and dgrad must be 0.5")
        if index not in need_wgrad_graph:
            return failed(i, f"KeyError: {index}")
        if not need_wgrad_graph[index]:
            return failed(
                i, "RuntimeError: No module needs wgrad computation but get float in order"
            )
        if index in captured:
            return failed(i, f"RuntimeError: {ALREADY_CAPTURED}")
        captured.add(index)
        wgrad_graphs.append((i, index // microbatches + 1, index % microbatches))
    return TECapture(None, True, None, tuple(wgrad_graphs))


@dataclasses.dataclass(frozen=True)
class TEGraph:
    """TransformerEngine's own ``graph.py`` and the module class the doctor graphs with it."""

    make_graphed_callables: object
    linear: type
    version: str
    path: str


def load_te_graph() -> TEGraph | str | None:
    """TransformerEngine's installed ``graph.py``; a reason when it is installed but cannot load; None if absent."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        graph = importlib.import_module("transformer_engine.pytorch.graph")
        te_torch = importlib.import_module("transformer_engine.pytorch")
        te = importlib.import_module("transformer_engine")
        return TEGraph(
            graph.make_graphed_callables,
            te_torch.Linear,
            str(getattr(te, "__version__", "unknown version")),
            str(getattr(graph, "__file__", "?")),
        )
    except Exception as exc:  # a broken install is reported, never raised
        return f"installed but not importable ({type(exc).__name__}: {exc})"


def _te_device() -> str | None:
    """Where TransformerEngine's kernels run: a GPU, or nowhere."""
    return "cuda" if torch.cuda.is_available() else None


def run_te_order(te: TEGraph, order: Sequence[float], device: str) -> TECapture | str:
    """Graph one delayed-wgrad ``Linear`` per chunk with TransformerEngine's own function and ``order``.

    Returns what it did, or a reason when the run could not be set up (then
    nothing of TransformerEngine's ordering was exercised).
    """
    integral = [v for v in order if v == int(v)]
    chunks = int(max(integral))
    microbatches = max(len(integral) // chunks // 2, 1)
    try:
        layers = tuple(
            te.linear(8, 8, delay_wgrad_compute=True, device=device)  # type: ignore[call-arg]
            for _ in range(chunks)
        )
        # sample_args are indexed chunk * microbatches + microbatch (one layer per chunk).
        sample_args = tuple(
            (torch.randn(4, 8, device=device, requires_grad=True),)
            for _ in range(chunks * microbatches)
        )
    except Exception as exc:
        return f"setting up TransformerEngine modules failed ({type(exc).__name__}: {exc})"
    try:
        te.make_graphed_callables(  # type: ignore[operator]
            layers, sample_args, _order=list(order), _num_layers_per_chunk=[1] * chunks
        )
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return TECapture(error, passed_count_check=not str(exc).startswith("Number of wgrad graph"))
    return TECapture(None)


def _describe(result: TECapture, where: str) -> Outcome:
    order = list(WRONG_TE_ORDER)
    if not result.passed_count_check:
        return Outcome(True, f"refused {order} up front: {result.error} ({where})")
    if result.error is None:
        return Outcome(False, f"accepted and captured {order} ({where})")
    at = f" at position {result.position}" if result.position is not None else ""
    return Outcome(
        False,
        f"accepted {order} (count check), then capture failed{at}: "
        f"{result.error.rstrip('.')}; no rule or position named up front ({where})",
    )


def _upstream() -> Outcome:
    te = load_te_graph()
    device = _te_device()
    if isinstance(te, TEGraph) and device is not None:
        ran = run_te_order(te, WRONG_TE_ORDER, device)
        if isinstance(ran, TECapture):
            return _describe(ran, f"TransformerEngine {te.version}, its {te.path}, run")
        fallback = ran
    elif isinstance(te, TEGraph):
        fallback = "TransformerEngine installed, no GPU to run it on"
    else:
        fallback = te if isinstance(te, str) else "TransformerEngine not installed"
    return _describe(te_capture(WRONG_TE_ORDER), f"modelled from graph.py; {fallback}")


def _with_gradsafe() -> Outcome:
    try:
        order = CaptureOrder.from_te_order(WRONG_TE_ORDER)
    except CaptureOrderError as exc:
        return Outcome(
            exc.rule is Rule.ONE_WGRAD_PER_DGRAD,
            f"refused at position {exc.position} [{exc.rule.value}]",
        )
    return Outcome(False, f"accepted as {order}")


CHECKS = (
    Check(
        "H5 capture order TransformerEngine's count check accepts",
        "cuda_graphs",
        _upstream,
        _with_gradsafe,
        upstream_source=UPSTREAM_SOURCE,
    ),
)
