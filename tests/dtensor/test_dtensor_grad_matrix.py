"""Every gradient path through AccumulateGrad for DTensor parameters (fake process group).

Matrix: 1-D and 2-D meshes x placements (Replicate parameter with
Partial(sum/avg/max) gradient, Shard(0), Shard(1), [Shard(0), Shard(1)],
[Shard(0), Partial]) x gradient layout (contiguous, transposed, expanded,
channels_last) x ``.grad`` None or existing x a hook holding a reference x
``create_graph``. Values are checked on real gloo ranks
(test_dtensor_gloo_values.py); here, with rank 0 of a fake group, the
placements, the collectives and the strides.
"""

from __future__ import annotations

import pytest
import torch

import gradsafe
from dtensor_gradcases import Case, accumulation_reference, all_cases, run

pytestmark = pytest.mark.filterwarnings(r"ignore:Using backward\(\) with create_graph=True")

CASES = list(all_cases())


@pytest.fixture(scope="module")
def patched():
    with gradsafe.patch("dtensor"):
        yield


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_grad_matrix_with_gradsafe(fake_meshes, patched, case: Case) -> None:
    mesh_ndim, _, grad_pl = case.spec
    mesh = fake_meshes[mesh_ndim]
    if case.existing_grad:
        # The second backward adds into .grad; that add is AccumulateGrad's
        # own op and may need a collective (e.g. Partial(max) + Partial(max)).
        expected = accumulation_reference(case, mesh)
    else:
        expected = None
    if expected is not None and expected.placements is None:
        with pytest.raises(RuntimeError, match="in-place"):
            run(case, mesh)
        return
    outcome = run(case, mesh)
    if expected is None:
        assert outcome.placements == grad_pl
        assert outcome.collectives == 0
    else:
        assert outcome.placements == expected.placements
        assert outcome.collectives == expected.collectives
    # Layout contract: .grad has the parameter's strides, globally and locally.
    assert outcome.grad_stride == outcome.param_stride
    assert outcome.grad_local_stride == outcome.param_local_stride


def _goes_through_layout_fixup(case: Case) -> bool:
    # AccumulateGrad steals a gradient with the parameter's strides that
    # nothing else references, outside create_graph; otherwise new_empty_strided + copy_.
    return not case.existing_grad and (
        case.layout != "contiguous" or case.hook_holds_ref or case.create_graph
    )


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
        case.id for case in CASES if _goes_through_layout_fixup(case) and hazardous(case.spec[2])
    }
    assert failing == predicted
    assert predicted  # the matrix reaches the hazard at all
