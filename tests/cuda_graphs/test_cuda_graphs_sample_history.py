"""Sample arguments with autograd history (``hs.clone()``): graphed as the leaves the callable sees.

Upstream captures ``torch.autograd.grad(outputs, inputs=sample_args + params)``: a non-leaf
sample's history adds other slots' gradients into a slot it reaches. With
``sample_args=(hs, hs.clone())`` the first input's captured gradient also holds the second's,
so the weights before the block get it twice (called with ``(h, h)``) or get a term eager
never computes (``(h, 2 * h)``), silently; a history reaching a module parameter adds to that
parameter's gradient; one with saved tensors raises "backward through the graph a second time"
at warm-up. gradsafe detaches such samples first, in every ownership mode: fp64, exact.
``make_graphed_split_callables`` captures on a detached copy of each sample, so shared,
overlapping or derived samples are exact there too (all fail when it uses the samples as given).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradsafe
from gradsafe.cuda_graphs import (
    CaptureEntry,
    CaptureOrder,
    make_graphed_callables,
    make_graphed_split_callables,
)


class _Two(nn.Module):
    """``lin(a) * b``: both arguments reach the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) * b


_Samples = Callable[[torch.Tensor, _Two], tuple[torch.Tensor, torch.Tensor]]

_WITH_HISTORY: dict[str, _Samples] = {
    # Silent before: the clone's backward saves nothing, so warm-up and capture run.
    "(hs, hs.clone())": lambda hs, block: (hs, hs.clone()),
    "(hs, lin.weight[:2].clone())": lambda hs, block: (hs, block.lin.weight[:2].clone()),
    # Raised at warm-up before: the history's saved tensors are freed by the first pass.
    "(hs, 2 * hs)": lambda hs, block: (hs, 2 * hs),
}


@pytest.fixture
def fp64() -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _grads(
    device: torch.device, samples: _Samples | None, ownership: str, same: bool
) -> list[torch.Tensor]:
    """Two microbatches through ``before`` then the (graphed) block; every weight's ``.grad``."""
    torch.manual_seed(0)
    before, block = nn.Linear(3, 3).to(device), _Two().to(device)
    x = torch.randn(2, 2, 3, device=device)
    if samples is not None:
        hs = torch.randn(2, 3, device=device, requires_grad=True)
        block = make_graphed_callables(block, samples(hs, block), ownership=ownership)  # type: ignore[arg-type,assignment]
    for microbatch in x:
        h = before(microbatch)
        block(h, h if same else 2 * h).sum().backward()
    return [p.grad.clone() for p in (*before.parameters(), *block.parameters())]  # type: ignore[union-attr]


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("ownership", ["auto", "always"])
@pytest.mark.parametrize("same", [True, False], ids=["called (h, h)", "called (h, 2h)"])
@pytest.mark.parametrize("samples", sorted(_WITH_HISTORY))
def test_samples_with_autograd_history_give_eager_gradients(
    graph_device: torch.device, samples: str, same: bool, ownership: str
) -> None:
    eager = _grads(graph_device, None, ownership, same)
    ours = _grads(graph_device, _WITH_HISTORY[samples], ownership, same)
    for e, o in zip(eager, ours):
        torch.testing.assert_close(o, e, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("samples", ["(hs, 2 * hs)", "(hs, hs.clone())"])
def test_samples_with_autograd_history_give_the_input_eager_gradients_under_ownership_never(
    graph_device: torch.device, samples: str
) -> None:
    """'never' keeps upstream's H3 aliasing of the block's own weights, not this: ``before`` is exact."""
    eager = _grads(graph_device, None, "never", same=True)
    ours = _grads(graph_device, _WITH_HISTORY[samples], "never", same=True)
    for e, o in zip(eager[:2], ours[:2]):  # before.weight, before.bias
        torch.testing.assert_close(o, e, rtol=0, atol=1e-12)


def _input_grad(
    make: Callable[..., Any] | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h.grad`` after ``block(h, h).sum().backward()`` graphed from ``(hs, hs.clone())``; ``lin(h)``."""
    torch.manual_seed(0)
    block = _Two().to(device)
    hs = torch.randn(2, 3, device=device, requires_grad=True)
    h = torch.randn(2, 3, device=device, requires_grad=True)
    graphed = block if make is None else make(block, (hs, hs.clone()))
    graphed(h, h).sum().backward()
    return h.grad, block.lin(h).detach()  # type: ignore[return-value]


@pytest.mark.usefixtures("fp64")
def test_torchs_own_make_graphed_callables_adds_a_derived_samples_gradient_to_its_source(
    graph_device: torch.device,
) -> None:
    """Upstream's (on a GPU too): h's gradient gets ``d/db = lin(h)`` twice; eager's has it once."""
    upstream = gradsafe.get_original("torch.cuda.graphs", "make_graphed_callables")
    upstream_grad, lin_h = _input_grad(upstream, graph_device)
    ours, _ = _input_grad(make_graphed_callables, graph_device)
    eager, _ = _input_grad(None, graph_device)
    torch.testing.assert_close(ours, eager, rtol=0, atol=1e-12)
    torch.testing.assert_close(upstream_grad - eager, lin_h, rtol=0, atol=1e-12)
    with gradsafe.patch("cuda_graphs"):
        patched, _ = _input_grad(torch.cuda.make_graphed_callables, graph_device)
    torch.testing.assert_close(patched, ours, rtol=0, atol=0)


@pytest.mark.usefixtures("fp64")
def test_a_non_leaf_sample_passed_again_is_read_in_place_and_its_history_gets_the_gradient(
    graph_device: torch.device,
) -> None:
    grads = []
    for graphed in (False, True):
        torch.manual_seed(0)
        block = _Two().to(graph_device)
        leaf_a, leaf_b = torch.randn(2, 2, 3, device=graph_device).unbind()
        leaf_a.requires_grad_(), leaf_b.requires_grad_()
        a, b = leaf_a * 3, leaf_b.clone()
        if graphed:
            block = make_graphed_callables(block, (a, b))  # type: ignore[assignment]
        block(a, b).sum().backward()
        grads.append([leaf_a.grad, leaf_b.grad, *(p.grad for p in block.parameters())])
    for eager, ours in zip(*grads):
        torch.testing.assert_close(ours, eager, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("fp64")
def test_graphing_leaves_a_samples_history_intact(graph_device: torch.device) -> None:
    """Upstream's warm-up would run, and free, the history of ``2 * hs`` reached from ``hs``."""
    block = _Two().to(graph_device)
    hs = torch.randn(2, 3, device=graph_device, requires_grad=True)
    doubled = 2 * hs
    make_graphed_callables(block, (hs, doubled))
    assert hs.grad is None
    doubled.sum().backward()
    torch.testing.assert_close(hs.grad, torch.full_like(hs, 2.0), rtol=0, atol=0)


_SPLIT_SAMPLES: dict[str, _Samples] = {
    **_WITH_HISTORY,
    # Refused by make_graphed_callables (test_cuda_graphs_aliased_sample_args.py).
    "(hs, hs)": lambda hs, block: (hs, hs),
    "overlapping views": lambda hs, block: _overlapping(torch.cat([hs, hs[:1]])),
}


def _overlapping(rows3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rows3[:2], rows3[1:]


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("samples", sorted(_SPLIT_SAMPLES))
def test_split_callables_copy_each_sample_so_shared_or_derived_samples_give_eager_gradients(
    graph_device: torch.device, samples: str
) -> None:
    """``make_graphed_split_callables`` captures on its own detached copy of each sample."""
    grads = []
    for graphed in (False, True):
        torch.manual_seed(0)
        before, block = nn.Linear(3, 3).to(graph_device), _Two().to(graph_device)
        x = torch.randn(2, 3, device=graph_device)
        stages = None
        if graphed:
            hs = torch.randn(2, 3, device=graph_device, requires_grad=True)
            entries = [
                CaptureEntry.forward(0, 0),
                CaptureEntry.dgrad(0, 0),
                CaptureEntry.wgrad(0, 0),
            ]
            stages = make_graphed_split_callables(
                [block], [_SPLIT_SAMPLES[samples](hs, block)], CaptureOrder(entries)
            )
        h = before(x)
        block(h, h).sum().backward()
        if stages is not None:
            stages.backward_weight(0)
        grads.append([p.grad.clone() for p in (*before.parameters(), *block.parameters())])  # type: ignore[union-attr]
    for eager, ours in zip(*grads):
        torch.testing.assert_close(ours, eager, rtol=0, atol=1e-12)
