"""Every gradient path through AccumulateGrad for DTensor parameters (fake process group).

Matrix: 1-D and 2-D meshes x placements (Replicate parameter with
Partial(sum/avg/max/min) gradient, Shard(0), Shard(1), [Shard(0), Shard(1)],
[Shard(0), Partial]) x gradient layout (contiguous, transposed, expanded,
channels_last) x ``.grad`` None or existing x a hook holding a reference x
``create_graph``. Each case runs without and with ``gradsafe.patch("dtensor")``
on the installed torch. Values are checked on real gloo ranks
(test_dtensor_gloo_values.py); here, with rank 0 of a fake group, the
placements, the collectives, the strides, and that gradsafe never raises
where the unpatched torch does not.
"""

from __future__ import annotations

import pytest
from dtensor_gradcases import Case, Outcome, all_cases, kept_by_gradsafe, run

import gradsafe

pytestmark = pytest.mark.filterwarnings(r"ignore:Using backward\(\) with create_graph=True")

CASES = list(all_cases())


def _run(case: Case, mesh) -> Outcome | RuntimeError:  # type: ignore[no-untyped-def]
    try:
        return run(case, mesh)
    except RuntimeError as exc:
        return exc


def _through_layout_fixup(case: Case) -> bool:
    # AccumulateGrad steals a gradient with the parameter's strides that
    # nothing else references, outside create_graph; otherwise new_empty_strided + copy_.
    return not case.existing_grad and (
        case.layout != "contiguous" or case.hook_holds_ref or case.create_graph
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_grad_matrix(fake_meshes, case: Case) -> None:
    mesh_ndim, _, grad_pl = case.spec
    mesh = fake_meshes[mesh_ndim]
    upstream = _run(case, mesh)
    with gradsafe.patch("dtensor"):
        ours = _run(case, mesh)
    if isinstance(upstream, RuntimeError):
        return  # a limit of the installed torch; gradsafe is not required to lift it
    # Never a new crash, never an extra collective.
    assert not isinstance(ours, RuntimeError), f"gradsafe raises where torch does not: {ours}"
    assert ours.collectives <= upstream.collectives
    if not case.existing_grad and kept_by_gradsafe(case):
        assert ours.placements == grad_pl
        assert ours.collectives == 0
    elif not kept_by_gradsafe(case):
        assert (ours.placements, ours.collectives) == (upstream.placements, upstream.collectives)
    # Layout contract: .grad has the parameter's strides, globally and locally.
    assert ours.grad_stride == ours.param_stride
    assert ours.grad_local_stride == ours.param_local_stride


def test_matrix_detects_the_prefix_hazard(fake_meshes, prefix_strategy) -> None:
    """Without gradsafe, the pre-fix strategy fails exactly the Partial cases through the fix-up."""
    failing = set()
    for case in CASES:
        if case.existing_grad:
            continue
        mesh_ndim, _, grad_pl = case.spec
        outcome = run(case, fake_meshes[mesh_ndim])
        if outcome.placements != grad_pl or outcome.collectives:
            failing.add(case.id)

    def hazardous(placements) -> bool:  # type: ignore[no-untyped-def]
        partial = any(p.is_partial() for p in placements)
        if prefix_strategy.kind == "op_strategy":
            return partial and not any(p.is_shard() for p in placements)
        return partial

    predicted = {
        case.id for case in CASES if _through_layout_fixup(case) and hazardous(case.spec[2])
    }
    assert failing == predicted
    assert predicted  # the matrix reaches the hazard at all
