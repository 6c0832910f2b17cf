"""CaptureOrder: rules, TransformerEngine interop and property tests (hazard H5)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradsafe.cuda_graphs._capture_order_hazards import (
    ALREADY_CAPTURED,
    CHECKS,
    WRONG_TE_ORDER,
    TECapture,
    te_capture,
    te_count_check,
    te_wgrad_matches,
)
from gradsafe.cuda_graphs.capture_order import (
    CaptureEntry,
    CaptureOrder,
    CaptureOrderError,
    EntryKind,
    Rule,
)

F, D, W = CaptureEntry.forward, CaptureEntry.dgrad, CaptureEntry.wgrad

# TransformerEngine PR 2376's own example (MoE overlap, delayed wgrad on 3 chunks).
TE_PR_ORDER = [1, 1, 1, 1, 2, 3, 2, -3, -3.5, 3, -2, -2.5, 2, -3, -3.5, 3, -2, -2.5, 2, -3, -3.5, 3, -2, -2.5, 1, -3, -3.5, -2, -2.5, 1, -1, -1.5, 1, -1, -1.5, 1, -1, -1.5, 2, -1, 3, -1.5, 2, -3, -3.5, 3, -2, -2.5, 2, -3, -3.5, 3, -2, -2.5, 2, -3, -3.5, 3, -2, -2.5, -3, -3.5, -2, -2.5, -1, -1.5, -1, -1.5, -1, -1.5, -1, -1.5]  # fmt: skip


def refused(rule: Rule, position: int | None, build: object) -> CaptureOrderError:
    with pytest.raises(CaptureOrderError) as info:
        build()  # type: ignore[operator]
    assert info.value.rule is rule, str(info.value)
    assert info.value.position == position, str(info.value)
    assert rule.value in str(info.value)
    if position is not None:
        assert f"position {position}" in str(info.value)
    return info.value


# -- rules --------------------------------------------------------------------


def test_valid_order_keeps_entries_and_infers_delayed_chunks() -> None:
    order = CaptureOrder([F(0, 0), F(1, 0), D(1, 0), D(0, 0), W(0, 0)])
    assert order.delayed_wgrad_chunks == frozenset({0})
    assert order.chunks == (0, 1)
    assert order.microbatches(0) == (0,)
    assert str(order) == "F(c0,mb0) F(c1,mb0) D(c1,mb0) D(c0,mb0) W(c0,mb0)"


def test_wgrad_before_its_dgrad() -> None:
    refused(Rule.WGRAD_AFTER_DGRAD, 1, lambda: CaptureOrder([F(0, 0), W(0, 0), D(0, 0)]))


def test_wgrad_of_another_microbatch_does_not_count_as_after() -> None:
    build = lambda: CaptureOrder([F(0, 0), F(0, 1), D(0, 0), W(0, 1), D(0, 1), W(0, 0)])  # noqa: E731
    refused(Rule.WGRAD_AFTER_DGRAD, 3, build)


def test_strict_rule_is_optional() -> None:
    entries = [F(0, 0), F(0, 1), D(0, 0), D(0, 1), W(0, 0), W(0, 1)]
    assert len(CaptureOrder(entries)) == 6
    refused(Rule.WGRAD_BEFORE_NEXT_DGRAD, 3, lambda: CaptureOrder(entries, strict=True))


def test_missing_and_duplicate_wgrad() -> None:
    refused(
        Rule.ONE_WGRAD_PER_DGRAD,
        3,
        lambda: CaptureOrder([F(0, 0), F(0, 1), D(0, 0), D(0, 1), W(0, 0)]),
    )
    refused(
        Rule.ONE_WGRAD_PER_DGRAD,
        3,
        lambda: CaptureOrder([F(0, 0), D(0, 0), W(0, 0), W(0, 0)]),
    )


def test_forward_before_dgrad_and_one_entry_per_microbatch() -> None:
    refused(Rule.FORWARD_BEFORE_DGRAD, 0, lambda: CaptureOrder([D(0, 0), F(0, 0)]))
    refused(Rule.ONE_PER_MICROBATCH, 1, lambda: CaptureOrder([F(0, 0), F(0, 0), D(0, 0)]))
    refused(Rule.ONE_PER_MICROBATCH, 2, lambda: CaptureOrder([F(0, 0), D(0, 0), D(0, 0)]))
    refused(Rule.ONE_PER_MICROBATCH, 1, lambda: CaptureOrder([F(0, 0), F(0, 1), D(0, 0)]))


def test_wgrad_for_chunk_without_delayed_wgrad() -> None:
    entries = [F(0, 0), F(1, 0), D(1, 0), W(1, 0), D(0, 0)]
    refused(
        Rule.WGRAD_ONLY_FOR_DELAYED_CHUNKS,
        3,
        lambda: CaptureOrder(entries, delayed_wgrad_chunks={0}),
    )


def test_entries_must_be_typed() -> None:
    with pytest.raises(TypeError, match="position 1"):
        CaptureOrder([F(0, 0), ("D", 0, 0)])  # type: ignore[list-item]


# -- TransformerEngine ----------------------------------------------------------


def test_seed_example_passes_te_count_check_then_fails_its_capture() -> None:
    assert te_count_check(WRONG_TE_ORDER) is None
    assert te_wgrad_matches(WRONG_TE_ORDER) == [(4, 1, 1), (5, 1, 1)]
    # Both entries pick microbatch 1's wgrad graph: the second capture into it raises.
    captured = te_capture(WRONG_TE_ORDER)
    assert captured.passed_count_check and captured.position == 5
    assert captured.error == f"RuntimeError: {ALREADY_CAPTURED}"
    assert captured.wgrad_graphs == ((4, 1, 1),)


def test_seed_example_is_refused_by_gradsafe_up_front() -> None:
    error = refused(Rule.ONE_WGRAD_PER_DGRAD, 5, lambda: CaptureOrder.from_te_order(WRONG_TE_ORDER))
    assert "microbatch 1" in str(error) and "position 4" in str(error)


def test_te_model_refuses_unbalanced_counts() -> None:
    assert te_count_check([1, 1, -1, -1, -1.5]) is not None
    assert te_count_check([1, 1, -1, -1.5, -1.5, -1.5, -1]) is not None  # more wgrads than dgrads
    assert te_count_check([1, -1.5, -1]) is not None


def test_te_model_accepts_surplus_wgrad_after_balance() -> None:
    # The scan stops as soon as the counts balance, so a later extra wgrad is never seen.
    assert te_count_check([1, -1, -1.5, -1.5]) is None
    assert te_wgrad_matches([1, -1, -1.5, -1.5]) == [(2, 1, 0), (3, 1, 0)]
    assert te_capture([1, -1, -1.5, -1.5]).error == f"RuntimeError: {ALREADY_CAPTURED}"
    refused(Rule.ONE_WGRAD_PER_DGRAD, 3, lambda: CaptureOrder.from_te_order([1, -1, -1.5, -1.5]))


def test_te_model_accepts_surplus_wgrad_before_first_dgrad() -> None:
    # Count-only: a wgrad before chunk 1's first dgrad is never counted, so a 3rd one passes.
    order = [1, 1, -1.5, -1, -1, -1.5, -1.5]
    assert te_count_check(order) is None
    assert te_wgrad_matches(order)[0] == (2, 1, -1)
    # need_bwd_dw_graph is a dict keyed by forward index, so index -1 does not wrap around.
    assert te_capture(order) == TECapture("KeyError: -1", True, 2, ())
    refused(Rule.WGRAD_AFTER_DGRAD, 2, lambda: CaptureOrder.from_te_order(order))


def test_te_pr_example_parses_with_strict_rule() -> None:
    order = CaptureOrder.from_te_order(TE_PR_ORDER, strict=True)
    assert te_count_check(TE_PR_ORDER) is None
    assert order.chunks == (0, 1, 2)
    assert order.delayed_wgrad_chunks == frozenset({0, 1, 2})
    assert all(order.microbatches(c) == tuple(range(8)) for c in order.chunks)
    # "-1 (dgrad), 3, -1.5 (delayed wgrad)": the wgrad after a forward of another chunk.
    assert order.entries[39:42] == (D(0, 3), F(2, 4), W(0, 3))
    assert order.to_te_order().order == tuple(TE_PR_ORDER)


def test_to_te_order_without_delayed_wgrad_keeps_layers_per_chunk() -> None:
    order = CaptureOrder([F(0, 0), F(1, 0), D(1, 0), F(0, 1), D(0, 0), F(1, 1), D(1, 1), D(0, 1)])
    te = order.to_te_order(layers_per_chunk=[3, 2])
    assert te.order == (1, 2, -2, 1, -1, 2, -2, -1)
    assert te.kwargs() == {"_order": list(te.order), "_num_layers_per_chunk": [3, 2]}


def test_to_te_order_with_delayed_wgrad_makes_layers_chunks() -> None:
    order = CaptureOrder([F(0, 0), F(1, 0), D(1, 0), W(1, 0), D(0, 0), W(0, 0)])
    te = order.to_te_order(layers_per_chunk=[2, 1])
    assert te.order == (1, 2, 3, -3, -3.5, -2, -1, -2.5, -1.5)
    assert te.num_layers_per_chunk == (1, 1, 1)
    assert te_count_check(te.order) is None
    assert te_wgrad_matches(te.order) == [(4, 3, 0), (7, 2, 0), (8, 1, 0)]


def test_to_te_order_refuses_what_te_cannot_express() -> None:
    late_wgrad = CaptureOrder([F(0, 0), F(0, 1), D(0, 0), D(0, 1), W(0, 0), W(0, 1)])
    refused(Rule.WGRAD_BEFORE_NEXT_DGRAD, 4, late_wgrad.to_te_order)
    out_of_order = CaptureOrder([F(0, 1), F(0, 0), D(0, 0), D(0, 1)])
    refused(Rule.TE_FORMAT, 0, out_of_order.to_te_order)
    uneven = CaptureOrder([F(0, 0), F(0, 1), F(1, 0), D(1, 0), D(0, 0), D(0, 1)])
    refused(Rule.TE_FORMAT, None, uneven.to_te_order)
    gap = CaptureOrder([F(0, 0), F(2, 0), D(2, 0), D(0, 0)])
    refused(Rule.TE_FORMAT, None, gap.to_te_order)
    with pytest.raises(ValueError, match="layers_per_chunk"):
        gap.to_te_order(layers_per_chunk=[1])


@pytest.mark.parametrize(
    ("order", "rule", "position"),
    [
        ([1.0, -1], Rule.TE_FORMAT, 0),  # TransformerEngine raises TypeError for a float forward
        ([1, 0, -1], Rule.TE_FORMAT, 1),
        ([1, -1, -1.25], Rule.TE_FORMAT, 2),
        ([1, -1, -0.5], Rule.TE_FORMAT, 2),
        ([1, -1, True], Rule.TE_FORMAT, 2),
        ([1, -1.5, -1], Rule.WGRAD_AFTER_DGRAD, 1),
        ([1, -1, 3, -3], Rule.TE_FORMAT, None),
        ([1, -2], Rule.FORWARD_BEFORE_DGRAD, 1),
        ([1, 1, -1, -1, -1.5], Rule.ONE_WGRAD_PER_DGRAD, 2),
    ],
)
def test_from_te_order_refuses(order: list[float], rule: Rule, position: int | None) -> None:
    refused(rule, position, lambda: CaptureOrder.from_te_order(order))


def test_from_te_order_checks_declared_delayed_chunks() -> None:
    order = [1, 2, -2, -2.5, -1]
    refused(
        Rule.WGRAD_ONLY_FOR_DELAYED_CHUNKS,
        3,
        lambda: CaptureOrder.from_te_order(order, delayed_wgrad_chunks={0}),
    )


def test_doctor_row() -> None:
    (check,) = CHECKS
    assert check.upstream().correct is False
    assert check.gradsafe().correct is True
    assert "modelled" in check.upstream_source


# -- properties -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Generated:
    entries: tuple[CaptureEntry, ...]
    delayed: frozenset[int]
    strict: bool  # built so that every wgrad comes before its chunk's next dgrad


@st.composite
def capture_orders(draw: st.DrawFn, strict: bool | None = None) -> Generated:
    """A valid order: random interleaving of what a pipeline rank could legally capture next."""
    chunks = draw(st.integers(1, 3))
    microbatches = draw(st.integers(1, 4))
    delayed = frozenset(c for c in range(chunks) if draw(st.booleans()))
    strict = draw(st.booleans()) if strict is None else strict
    forwarded = [0] * chunks
    dgraded = [0] * chunks
    pending: list[list[int]] = [[] for _ in range(chunks)]
    entries: list[CaptureEntry] = []
    while True:
        moves: list[CaptureEntry] = []
        for c in range(chunks):
            if forwarded[c] < microbatches:
                moves.append(F(c, forwarded[c]))
            if dgraded[c] < forwarded[c] and not (strict and pending[c]):
                moves.append(D(c, dgraded[c]))
            moves += [W(c, mb) for mb in pending[c]]
        if not moves:
            break
        move = draw(st.sampled_from(moves))
        entries.append(move)
        if move.kind is EntryKind.FORWARD:
            forwarded[move.chunk] += 1
        elif move.kind is EntryKind.DGRAD:
            dgraded[move.chunk] += 1
            if move.chunk in delayed:
                pending[move.chunk].append(move.microbatch)
        else:
            pending[move.chunk].remove(move.microbatch)
    return Generated(tuple(entries), delayed, strict)


def is_strict(entries: tuple[CaptureEntry, ...]) -> bool:
    """Every wgrad before its chunk's next dgrad (chunks with no wgrad entry have nothing to wait for)."""
    delayed = {e.chunk for e in entries if e.kind is EntryKind.WGRAD}
    open_chunks: set[int] = set()
    for e in entries:
        if e.kind is EntryKind.DGRAD and e.chunk in open_chunks:
            return False
        if e.kind is EntryKind.WGRAD:
            open_chunks.discard(e.chunk)
        elif e.kind is EntryKind.DGRAD and e.chunk in delayed:
            open_chunks.add(e.chunk)
    return True


def naive_te_floats(entries: tuple[CaptureEntry, ...]) -> list[float]:
    """What a user writing TransformerEngine's list by hand would write for ``entries``."""
    kind_value = {EntryKind.FORWARD: 1, EntryKind.DGRAD: -1, EntryKind.WGRAD: -1}
    extra = {EntryKind.FORWARD: 0, EntryKind.DGRAD: 0, EntryKind.WGRAD: -0.5}
    return [kind_value[e.kind] * (e.chunk + 1) + extra[e.kind] for e in entries]


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(capture_orders())
def test_valid_orders_are_accepted(gen: Generated) -> None:
    order = CaptureOrder(gen.entries, delayed_wgrad_chunks=gen.delayed, strict=gen.strict)
    assert order.entries == gen.entries
    if is_strict(gen.entries):
        CaptureOrder(gen.entries, delayed_wgrad_chunks=gen.delayed, strict=True)
    else:
        with pytest.raises(CaptureOrderError) as info:
            CaptureOrder(gen.entries, delayed_wgrad_chunks=gen.delayed, strict=True)
        assert info.value.rule is Rule.WGRAD_BEFORE_NEXT_DGRAD


@SETTINGS
@given(capture_orders(strict=True))
def test_te_round_trip(gen: Generated) -> None:
    order = CaptureOrder(gen.entries, delayed_wgrad_chunks=gen.delayed)
    te = order.to_te_order()
    assert te.order == tuple(naive_te_floats(gen.entries))
    # TransformerEngine's own checks (modelled) accept it and match every wgrad to its microbatch.
    assert te_count_check(te.order) is None
    wgrads = [e for e in gen.entries if e.kind is EntryKind.WGRAD]
    assert [(c - 1, mb) for _, c, mb in te_wgrad_matches(te.order)] == [
        (e.chunk, e.microbatch) for e in wgrads
    ]
    captured = te_capture(te.order)
    assert captured.error is None
    assert [(c - 1, mb) for _, c, mb in captured.wgrad_graphs] == [
        (e.chunk, e.microbatch) for e in wgrads
    ]
    back = CaptureOrder.from_te_order(te.order, strict=True)
    assert back.entries == gen.entries
    assert back.delayed_wgrad_chunks == frozenset(e.chunk for e in wgrads)


@SETTINGS
@given(capture_orders(strict=False))
def test_non_strict_orders_cannot_go_through_te_unchanged(gen: Generated) -> None:
    order = CaptureOrder(gen.entries, delayed_wgrad_chunks=gen.delayed)
    floats = naive_te_floats(gen.entries)
    if is_strict(gen.entries):
        assert CaptureOrder.from_te_order(floats).entries == gen.entries
        return
    with pytest.raises(CaptureOrderError) as info:
        order.to_te_order()
    assert info.value.rule is Rule.WGRAD_BEFORE_NEXT_DGRAD
    # Hand-written, the same order either fails gradsafe's parse or means other microbatches.
    try:
        parsed = CaptureOrder.from_te_order(floats)
    except CaptureOrderError as exc:
        assert exc.rule in (Rule.ONE_WGRAD_PER_DGRAD, Rule.WGRAD_AFTER_DGRAD)
    else:
        assert parsed.entries != gen.entries
    # ...while the count-only check (modelled) still accepts it: counts are all it sees.
    assert te_count_check(floats) is None
    matches = [(c - 1, mb) for _, c, mb in te_wgrad_matches(floats)]
    assert matches != [(e.chunk, e.microbatch) for e in gen.entries if e.kind is EntryKind.WGRAD]
    # ...and TransformerEngine's capture (modelled) then fails: two wgrads into one graph, or an
    # index before the chunk's first dgrad. Nothing is silently mis-captured.
    captured = te_capture(floats)
    assert captured.passed_count_check
    assert captured.error in (f"RuntimeError: {ALREADY_CAPTURED}", "KeyError: -1"), captured


def _positions(gen: Generated, kind: EntryKind) -> list[int]:
    return [i for i, e in enumerate(gen.entries) if e.kind is kind]


@SETTINGS
@given(capture_orders(), st.data())
def test_corruptions_are_refused_with_their_rule(gen: Generated, data: st.DataObject) -> None:
    entries = list(gen.entries)
    wgrads = _positions(gen, EntryKind.WGRAD)
    corruptions = ["drop_dgrad", "dgrad_before_forward"]
    if wgrads:
        corruptions += ["wgrad_before_dgrad", "drop_wgrad", "repeat_wgrad"]
    if set(range(3)) - gen.delayed:
        corruptions.append("wgrad_for_undelayed_chunk")
    corruption = data.draw(st.sampled_from(corruptions))
    strict = False
    delayed = set(gen.delayed)
    if corruption == "wgrad_before_dgrad":
        i = data.draw(st.sampled_from(wgrads))
        w = entries.pop(i)
        dgrad_at = entries.index(D(w.chunk, w.microbatch))
        j = data.draw(st.integers(0, dgrad_at))
        entries.insert(j, w)
        expected = (Rule.WGRAD_AFTER_DGRAD, j)
    elif corruption == "drop_wgrad":
        i = data.draw(st.sampled_from(wgrads))
        w = entries.pop(i)
        expected = (Rule.ONE_WGRAD_PER_DGRAD, entries.index(D(w.chunk, w.microbatch)))
    elif corruption == "repeat_wgrad":
        i = data.draw(st.sampled_from(wgrads))
        j = data.draw(st.integers(i + 1, len(entries)))
        entries.insert(j, entries[i])
        expected = (Rule.ONE_WGRAD_PER_DGRAD, j)
    elif corruption == "wgrad_for_undelayed_chunk":
        chunk = min(set(range(3)) - gen.delayed)
        j = data.draw(st.integers(0, len(entries)))
        entries.insert(j, W(chunk, 0))
        expected = (Rule.WGRAD_ONLY_FOR_DELAYED_CHUNKS, j)
    elif corruption == "drop_dgrad":
        i = data.draw(st.sampled_from(_positions(gen, EntryKind.DGRAD)))
        d = entries.pop(i)
        if d.chunk in delayed:
            expected = (Rule.WGRAD_AFTER_DGRAD, entries.index(W(d.chunk, d.microbatch)))
        else:
            expected = (Rule.ONE_PER_MICROBATCH, entries.index(F(d.chunk, d.microbatch)))
    else:  # dgrad_before_forward
        i = data.draw(st.sampled_from(_positions(gen, EntryKind.DGRAD)))
        d = entries.pop(i)
        j = data.draw(st.integers(0, entries.index(F(d.chunk, d.microbatch))))
        entries.insert(j, d)
        expected = (Rule.FORWARD_BEFORE_DGRAD, j)
    with pytest.raises(CaptureOrderError) as info:
        CaptureOrder(entries, delayed_wgrad_chunks=delayed, strict=strict)
    assert (info.value.rule, info.value.position) == expected, str(info.value)


@SETTINGS
@given(capture_orders(strict=True), st.data())
def test_late_wgrad_is_refused_by_strict_rule_and_te_parse(
    gen: Generated, data: st.DataObject
) -> None:
    # Move a wgrad past its chunk's next dgrad: a legal order, but not Megatron's nor TE's.
    entries = list(gen.entries)
    candidates = [
        i
        for i, e in enumerate(entries)
        if e.kind is EntryKind.WGRAD and D(e.chunk, e.microbatch + 1) in entries
    ]
    if not candidates:
        return
    i = data.draw(st.sampled_from(candidates))
    w = entries.pop(i)
    next_dgrad = entries.index(D(w.chunk, w.microbatch + 1))
    j = data.draw(st.integers(next_dgrad + 1, entries.index(W(w.chunk, w.microbatch + 1))))
    entries.insert(j, w)
    CaptureOrder(entries, delayed_wgrad_chunks=gen.delayed)
    with pytest.raises(CaptureOrderError) as info:
        CaptureOrder(entries, delayed_wgrad_chunks=gen.delayed, strict=True)
    assert (info.value.rule, info.value.position) == (Rule.WGRAD_BEFORE_NEXT_DGRAD, next_dgrad)
    floats = naive_te_floats(tuple(entries))
    assert te_count_check(floats) is None
    with pytest.raises(CaptureOrderError) as info:
        CaptureOrder.from_te_order(floats)
    assert info.value.rule is Rule.ONE_WGRAD_PER_DGRAD
