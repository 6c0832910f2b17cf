"""make_graphed_callables under create_graph=True: double backward behaves as upstream (emulated CUDA graphs)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.testing import emulate_cuda_graphs

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke


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
def test_create_graph_backward_matches_upstream(
    fn: Callable[..., torch.Tensor], ownership: str
) -> None:
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


@pytest.mark.parametrize("ownership", ["auto", "always"])
def test_a_gradient_penalty_from_a_root_of_ones_raises_instead_of_dropping_second_order_terms(
    ownership: str,
) -> None:
    # autograd.grad(y.sum(), x, create_graph=True): the incoming gradients (ones)
    # do not require grad, so once_differentiable adds no error node and the
    # graphed backward's results were constants. Added to a later call's loss
    # (the WGAN-GP shape: the penalty from one call, the loss from the next),
    # the penalty's gradient was silently left out (fp64, against eager).
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).double()
    graphed = make_graphed_callables(
        body, (torch.randn(2, 4, dtype=torch.float64, requires_grad=True),), ownership=ownership
    )
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(graphed(x).sum(), x, create_graph=True)
    assert torch.equal(gx.detach(), torch.autograd.grad(body(x).sum(), x)[0])  # first order
    loss = graphed(torch.randn(2, 4, dtype=torch.float64)).pow(2).sum()
    with pytest.raises(RuntimeError, match="differentiate twice through a graphed callable"):
        (loss + gx.pow(2).sum()).backward()


def test_a_first_order_backward_returns_gradients_without_a_graph() -> None:
    graphed = make_graphed_callables(_sin, (torch.randn(3, requires_grad=True),))
    x = torch.randn(3, requires_grad=True)
    (gx,) = torch.autograd.grad(graphed(x).sum(), x)
    assert gx.grad_fn is None and not gx.requires_grad


class _Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.randn(4), requires_grad=False)
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        return self.lin(x * extra["a"][0] + extra["b"]) * self.scale + self.shift


def _pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return (x * y).sin(), {"z": x.cos()}


def test_probe_replays_nothing_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Held up in review: the structure probe (a dry run of upstream's
    # backward) replays no graph, creates no .grad and leaves every static
    # buffer as capture left it -- for a mixed tuple of a module (frozen
    # parameter, buffer, pytree arguments) and a function.
    import gradsafe.cuda_graphs._graphed as graphed_module
    from gradsafe.testing import EmulatedCUDAGraph

    module = _Frozen()
    sample = (
        (
            torch.randn(2, 4, requires_grad=True),
            {"a": (torch.randn(2, 4),), "b": torch.randn(2, 4, requires_grad=True)},
        ),
        (torch.randn(3, requires_grad=True), torch.randn(3)),
    )
    replays: list[object] = []
    real_replay = EmulatedCUDAGraph.replay
    real_find = graphed_module.find_graphed_site
    changed: list[str] = []

    def static_buffers(returned: Any) -> list[torch.Tensor]:
        from gradsafe.cuda_graphs._structure import _find_cell

        backward = inspect.unwrap(_find_cell(returned).cell_contents.backward)
        found = []
        for cell in backward.__closure__ or ():
            value = cell.cell_contents
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    found.append(t)
        return found

    def watched_find(returned: Any, num_inputs: int) -> Any:
        buffers = static_buffers(returned)
        before = [t.clone() for t in buffers]
        versions = [t._version for t in buffers]
        site = real_find(returned, num_inputs)
        if not buffers:
            changed.append("no static buffers found to watch")
        for t, old, version in zip(buffers, before, versions):
            if not torch.equal(t, old) or t._version != version:
                changed.append(f"static buffer {tuple(t.shape)} changed")
        return site

    def counted_replay(self: EmulatedCUDAGraph) -> None:
        replays.append(self)
        real_replay(self)

    monkeypatch.setattr(graphed_module, "find_graphed_site", watched_find)
    before = [(p.grad, p.requires_grad) for p in module.parameters()]
    with monkeypatch.context() as m:
        m.setattr(EmulatedCUDAGraph, "replay", counted_replay)
        make_graphed_callables((module, _pair), sample, allow_unused_input=True)
        assert replays == [], "the probe replayed a graph"
    assert changed == []
    assert [(p.grad, p.requires_grad) for p in module.parameters()] == before
    assert all(t.grad is None for t in (sample[0][0], sample[0][1]["b"], sample[1][0]))
