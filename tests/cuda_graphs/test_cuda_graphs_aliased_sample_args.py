"""Sample arguments sharing memory (``sample_args=(h, h)``): refused before torch runs anything.

Upstream captures one static buffer for both slots and gives each the tensor's whole gradient:
the tensor passed there, and the weights behind it, get their gradient twice (fp64: exactly 2x
eager), in every ownership mode. Distinct sample tensors are exact, even when the graphed
callable is then called with one tensor twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradsafe.cuda_graphs import make_graphed_callables


class _Two(nn.Module):
    """``lin(a) * b``: both arguments reach the output; counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.forwards = 0

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.lin(a) * b


_SHARED: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "one tensor twice": lambda h: (h, h),
    "overlapping views": lambda h: (h[:2], h[1:]),
}


@pytest.fixture
def fp64() -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("ownership", ["auto", "always", "never"])
@pytest.mark.parametrize("shared", sorted(_SHARED))
def test_sample_args_sharing_memory_are_refused_before_anything_runs(
    graph_device: torch.device, shared: str, ownership: str
) -> None:
    block = _Two().to(graph_device)
    h = torch.randn(3, 3, device=graph_device, requires_grad=True)
    with pytest.raises(ValueError, match="share memory .* separate sample tensor"):
        make_graphed_callables(block, _SHARED[shared](h), ownership=ownership)  # type: ignore[arg-type]
    assert block.forwards == 0 and h.grad is None
    assert all(p.grad is None for p in block.parameters())


@pytest.mark.usefixtures("fp64")
def test_a_modules_own_parameter_as_a_sample_arg_is_refused(graph_device: torch.device) -> None:
    block = _Two().to(graph_device)
    h = torch.randn(3, 3, device=graph_device, requires_grad=True)
    with pytest.raises(ValueError, match="sample_args\\[1\\] and parameter 'lin.weight'"):
        make_graphed_callables(block, (h, block.lin.weight))
    assert block.forwards == 0


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("ownership", ["auto", "always", "never"])
def test_distinct_sample_tensors_called_with_one_tensor_twice_match_eager(
    graph_device: torch.device, ownership: str
) -> None:
    """The fix the refusal names: the upstream weight before the block gets eager's gradient."""
    grads = []
    for graphed in (False, True):
        torch.manual_seed(0)
        before, block = nn.Linear(3, 3).to(graph_device), _Two().to(graph_device)
        x = torch.randn(2, 3, device=graph_device)
        if graphed:
            hs = torch.randn(2, 3, device=graph_device, requires_grad=True)
            samples = (hs, hs.detach().clone().requires_grad_())
            block = make_graphed_callables(block, samples, ownership=ownership)  # type: ignore[arg-type,assignment]
        for _ in range(2):  # two microbatches accumulate
            h = before(x)
            block(h, h).sum().backward()
        grads.append([p.grad.clone() for p in (*before.parameters(), *block.parameters())])  # type: ignore[union-attr]
    for eager, ours in zip(*grads):
        torch.testing.assert_close(ours, eager, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("fp64")
def test_interleaved_views_of_one_tensor_are_distinct_and_exact(graph_device: torch.device) -> None:
    """``x[:, 0]`` and ``x[:, 1]`` share a storage, not an element: graphed as usual."""
    grads = []
    for graphed in (False, True):
        torch.manual_seed(0)
        block = _Two().to(graph_device)
        a, b = torch.randn(2, 3, 3, device=graph_device).unbind()
        if graphed:
            base = torch.randn(3, 3, 2, device=graph_device)
            block = make_graphed_callables(block, (base[..., 0], base[..., 1]))  # type: ignore[assignment]
        block(a, b).sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])  # type: ignore[union-attr]
    for eager, ours in zip(*grads):
        torch.testing.assert_close(ours, eager, rtol=0, atol=1e-12)
