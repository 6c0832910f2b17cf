"""Doctor row for H5: a CUDA-graph capture order whose wgrad entries pass a count-only check.

TransformerEngine's ``make_graphed_callables(_order=...)`` is the upstream
here, not torch: it is not installed in gradsafe's CI and needs a GPU, so its
two relevant pieces of logic are modelled below from
``transformer_engine/pytorch/graph.py`` (NVIDIA/TransformerEngine main,
August 2026), with one layer per chunk as TransformerEngine requires when
wgrad is delayed:

* validation: at each dgrad entry ``-c`` of a chunk with delayed wgrad (not
  yet validated), scan forward, counting further ``-c`` entries and
  ``-c-0.5`` entries, until the two counts are equal (all those dgrads are
  then valid) or wgrads outnumber dgrads (error); running out is an error.
  Nothing else is checked about where a wgrad entry sits.
* matching: a wgrad entry of chunk ``c`` captures the wgrad graph of index
  ``(dgrads of c so far) - 1``: the microbatch of chunk ``c``'s most recent dgrad.

The reproduction is written here once; tests and the benchmark import it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from gradsafe.cuda_graphs.capture_order import CaptureOrder, CaptureOrderError, Rule
from gradsafe.checks import Check, Outcome

# The seed report's example: both delayed wgrad entries after both dgrads of chunk 1.
WRONG_TE_ORDER: tuple[float, ...] = (1, 1, -1, -1, -1.5, -1.5)

UPSTREAM_SOURCE = (
    "TransformerEngine make_graphed_callables(_order=) validation and wgrad matching, "
    "modelled from graph.py (TransformerEngine not run)"
)


def te_count_check(order: Sequence[float], delayed_chunks: Iterable[int] | None = None) -> str | None:
    """TransformerEngine's wgrad validation, modelled: its error message, or None if it accepts.

    ``delayed_chunks`` are TransformerEngine's 1-based chunk ids whose modules
    delay wgrad (default: the chunks that have a wgrad entry).
    """
    if delayed_chunks is None:
        delayed = {-(v + 0.5) for v in order if v < 0 and v != int(v)}
    else:
        delayed = set(delayed_chunks)
    validated: set[int] = set()
    for i, value in enumerate(order):
        if value >= 0 or value != int(value) or -value not in delayed or i in validated:
            continue
        same_dgrads = [i]
        wgrads = 0
        balanced = False
        for j in range(i + 1, len(order)):
            other = order[j]
            if other > 0:
                continue
            if other == value:
                same_dgrads.append(j)
            if other + 0.5 == value:
                wgrads += 1
            if len(same_dgrads) == wgrads:
                validated.update(same_dgrads)
                balanced = True
                break
            if len(same_dgrads) < wgrads:
                break
        if not balanced:
            return (
                f"Number of wgrad graph({wgrads}) doesn't match number of dgrad graphs "
                f"({len(same_dgrads)}) for chunk {value}."
            )
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


def _upstream() -> Outcome:
    error = te_count_check(WRONG_TE_ORDER)
    if error is not None:
        return Outcome(True, f"refused {list(WRONG_TE_ORDER)}: {error}")
    matches = te_wgrad_matches(WRONG_TE_ORDER)
    targets = sorted({(c, mb) for _, c, mb in matches})
    described = ", ".join(f"pos {p} -> chunk {c} mb {mb}" for p, c, mb in matches)
    duplicated = len(targets) < len(matches)
    detail = f"accepted {list(WRONG_TE_ORDER)}; wgrad {described}"
    return Outcome(not duplicated, detail + (" (mb 0's wgrad never captured)" if duplicated else ""))


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
        "H5 capture order: 2 wgrad entries matched to 1 microbatch",
        "cuda_graphs",
        _upstream,
        _with_gradsafe,
        upstream_source=UPSTREAM_SOURCE,
    ),
)
