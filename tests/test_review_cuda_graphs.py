"""Review findings on gradsafe.cuda_graphs.make_graphed_callables (emulated CUDA graphs, any torch)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.testing import emulate_cuda_graphs


@pytest.fixture(autouse=True)
def _emulated() -> Iterator[None]:
    torch.manual_seed(0)
    with emulate_cuda_graphs():
        yield


def _upstream(*args: Any, **kwargs: Any) -> Any:
    return torch.cuda.graphs.make_graphed_callables(*args, **kwargs)


def _sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


def _sin_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.sin() * y


@pytest.mark.parametrize("ownership", ["auto", "always"])
@pytest.mark.parametrize("fn", [_sin, _sin_mul], ids=["one input", "two inputs"])
def test_create_graph_backward_matches_upstream(fn: Callable[..., torch.Tensor], ownership: str) -> None:
    # With create_graph=True and incoming gradients that require grad,
    # upstream's once_differentiable backward returns its gradients through a
    # DelayedError node: first-order gradients are right, and differentiating
    # them again raises "trying to differentiate twice". gradsafe's backward
    # crashed (torch <= 2.14, one input: the single returned tensor was
    # iterated as if it were the tuple of slots) or cloned under no_grad,
    # which cut the DelayedError off: a gradient penalty through the graphed
    # callable was then silently treated as a constant.
    sample = tuple(torch.randn(3, requires_grad=True) for _ in range(fn.__code__.co_argcount))
    graphed = make_graphed_callables(fn, sample, ownership=ownership)
    inputs = tuple(torch.randn(3, dtype=torch.float32, requires_grad=True) for _ in sample)

    (gx,) = torch.autograd.grad((graphed(*inputs) ** 2).sum(), inputs[0], create_graph=True)

    ref_inputs = tuple(t.detach().double().requires_grad_() for t in inputs)
    (ref,) = torch.autograd.grad((fn(*ref_inputs) ** 2).sum(), ref_inputs[0])
    torch.testing.assert_close(gx.detach().double(), ref, rtol=1e-6, atol=1e-6)

    upstream_graphed = _upstream(fn, tuple(t.detach().clone().requires_grad_() for t in sample))
    (upstream_gx,) = torch.autograd.grad(
        (upstream_graphed(*inputs) ** 2).sum(), inputs[0], create_graph=True
    )
    assert gx.requires_grad == upstream_gx.requires_grad
    penalty_weight = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (upstream_gx * penalty_weight).sum().backward()
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (gx * penalty_weight).sum().backward()
