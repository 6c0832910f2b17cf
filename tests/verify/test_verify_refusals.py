"""``verify`` refuses parameters whose gradient lives outside ``.grad`` instead of passing them unchecked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsafe.testing import MegatronStyleDDP
from gradsafe.verify import verify
from gradsafe.wgrad import WeightGradStore
from gradsafe.wgrad._hazards import repro_linear
from gradsafe.wgrad.markers import mark_delayed_wgrad

_STORE = WeightGradStore()  # a kernel library's own store, not on the module


class _DelayedKernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        mark_delayed_wgrad(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(repro_linear(x, self.weight, fuse=False, store=_STORE))


def _batches() -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(3, 4, generator=generator),) for _ in range(2)]


def test_a_delayed_weight_is_refused_rather_than_compared_none_with_none() -> None:
    # Its gradient comes from the store's W pass, which no verify run calls: it was
    # None in every run and "exact", even with a split whose W did nothing.
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"cannot check weight: marked as delayed.*delay off"):
        verify(_DelayedKernel(), _batches())


def test_a_stage_under_a_megatron_style_wrapper_is_refused_and_left_as_it_was() -> None:
    # The wrapper's hooks act on the caller's parameter: run on verify's copies, they
    # added the caller's .grad into its main_grad and cleared it.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    MegatronStyleDDP(module)
    for p in module.parameters():
        p.grad = torch.full_like(p, 7.0)
    with pytest.raises(ValueError, match=r"cannot check 0\.weight, 0\.bias: it has a main_grad"):
        verify(module, _batches())
    for p in module.parameters():
        assert torch.equal(p.grad, torch.full_like(p, 7.0))
        assert not p.main_grad.any()


def test_one_tensor_as_the_microbatches_is_refused_not_split_into_rows() -> None:
    # Iterated, a (3, 4) tensor became three microbatches of shape (4,).
    with pytest.raises(TypeError, match=r"one tensor of shape \(3, 4\); pass a list"):
        verify(nn.Linear(4, 4), torch.randn(3, 4))  # type: ignore[arg-type]
