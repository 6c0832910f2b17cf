"""Issue 13.1: one weight used fused, unfused and delayed in the same backward keeps every gradient.

Plain autograd in fp64 is the reference; both run under gradsafe.testing.MegatronStyleDDP
(AccumulateGrad hooks for undelayed weights, store hooks for delayed ones).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsafe.wgrad._hazards import USES, Use, check_mixed, kernel_with

PAIRS = list(itertools.combinations_with_replacement(USES, 2))


@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("uses", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_every_pair_of_uses_is_exact(uses: tuple[Use, Use], microbatches: int) -> None:
    assert check_mixed(uses, microbatches) == []


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(USES), min_size=1, max_size=5), st.integers(1, 4))
def test_any_mix_is_exact(uses: list[Use], microbatches: int) -> None:
    assert check_mixed(uses, microbatches) == []


def _flag_always(param, wgrad, *, accumulated_into_main_grad, delayed):  # type: ignore[no-untyped-def]
    """gradsafe before this fix: set the flag on every fused call, one dummy per call."""
    if delayed:
        return None
    if not accumulated_into_main_grad:
        return wgrad
    param.grad_added_to_main_grad = True
    return torch.zeros((), dtype=param.dtype).expand(param.shape)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_a_flag_set_without_watching_loses_the_unfused_use(microbatches: int) -> None:
    """The issue's case: a tied embedding next to a fused output head."""
    problems = check_mixed(("autograd", "now/fused"), microbatches, kernel=kernel_with(_flag_always))
    assert any(p.startswith("w (mixed): main_grad wrong") for p in problems)
