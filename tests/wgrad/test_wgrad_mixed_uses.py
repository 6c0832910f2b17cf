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

from gradsafe.wgrad._hazards import USES, Use, check_mixed, kernel_with, unwatched_policy

PAIRS = list(itertools.combinations_with_replacement(USES, 2))


@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("uses", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_every_pair_of_uses_is_exact(uses: tuple[Use, Use], microbatches: int) -> None:
    assert check_mixed(uses, microbatches) == []


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(USES), min_size=1, max_size=5), st.integers(1, 4))
def test_any_mix_is_exact(uses: list[Use], microbatches: int) -> None:
    assert check_mixed(uses, microbatches) == []


@pytest.mark.parametrize("microbatches", [1, 4])
def test_a_flag_set_without_watching_loses_the_unfused_use(microbatches: int) -> None:
    """The issue's case: a tied embedding next to a fused output head."""
    problems = check_mixed(
        ("autograd", "now/fused"), microbatches, kernel=kernel_with(unwatched_policy)
    )
    assert any(p.startswith("w (mixed): main_grad wrong") for p in problems)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_fused_use_inside_activation_checkpointing_keeps_the_outer_unfused_use(
    use_reentrant: bool,
) -> None:
    """Reentrant checkpointing runs the fused use in a backward of its own: its dummy must not hide the outer use."""
    from torch.utils.checkpoint import checkpoint

    from gradsafe.testing import MegatronStyleDDP, module_of
    from gradsafe.wgrad._hazards import repro_linear

    def run(fused: bool) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))
        ddp = MegatronStyleDDP(module_of([w]))
        for _ in range(3):
            x = torch.randn(2, 4, generator=g, dtype=torch.float64, requires_grad=True)
            ids = torch.randint(0, 4, (2,), generator=g)

            def block(h: torch.Tensor) -> torch.Tensor:
                if fused:
                    return torch.tanh(repro_linear(h, w, fuse=True, store=None))
                return torch.tanh(h @ w.t())

            h = x + torch.nn.functional.embedding(ids, w)
            h = checkpoint(block, h, use_reentrant=use_reentrant)
            h.pow(2).sum().backward()
        ddp.remove()
        return w.main_grad.clone()

    torch.testing.assert_close(run(fused=True), run(fused=False), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_every_mix_is_exact_without_the_flag(microbatches: int) -> None:
    """A wrapper without grad_added_to_main_grad: fused uses return None, main_grad still exact."""
    from gradsafe.wgrad._hazards import reference_mixed, run_mixed

    for uses in PAIRS:
        run = run_mixed(uses, microbatches, grad_added_flag=False)
        ref = reference_mixed(uses, microbatches)
        for got, want in zip(run.main_grads, ref.main_grads):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
