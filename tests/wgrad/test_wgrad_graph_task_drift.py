"""``torch._C._current_graph_task_id`` behaving otherwise: ``wgrad_return`` stays exact.

The policy returns one zero dummy per flagged parameter per backward, so that the
parameter's AccumulateGrad (and Megatron's gradient-ready hook on it) runs once in
every backward. It tells backwards apart by torch's graph-task id, probed once per
process (``graph_task_ids_differ``); where the id behaves otherwise, every use gets
a dummy of its own: the hooks run in every backward, the gradient stays zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gradsafe.wgrad import _torch as wgrad_torch
from gradsafe.wgrad import wgrad_return


@pytest.fixture
def reprobe() -> Iterator[None]:
    wgrad_torch.graph_task_ids_differ.cache_clear()
    yield
    wgrad_torch.graph_task_ids_differ.cache_clear()


def test_the_graph_task_probe_passes_outside_and_inside_a_backward(reprobe: None) -> None:
    assert wgrad_torch.graph_task_ids_differ() is None
    inside: list[str | None] = []

    def probe_again(grad: torch.Tensor) -> None:
        wgrad_torch.graph_task_ids_differ.cache_clear()
        inside.append(wgrad_torch.graph_task_ids_differ())

    x = torch.zeros(1, requires_grad=True)
    y = x * 2
    y.register_hook(probe_again)
    y.sum().backward()
    assert inside == [None]


class _Fused(torch.autograd.Function):
    """A kernel that accumulates its weight gradient into ``main_grad`` itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.w = w
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return g, wgrad_return(ctx.w, None, accumulate_into_main_grad=True, delayed=False)


_DRIFTS: dict[str, Callable[[], int] | None] = {
    "one id for every backward": lambda: 7,
    "always -1": lambda: -1,
    "missing": None,
}


@pytest.mark.parametrize("drift", _DRIFTS)
def test_a_drifted_graph_task_id_runs_the_weights_hooks_in_every_backward(
    drift: str, reprobe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    getter = _DRIFTS[drift]
    if getter is None:
        monkeypatch.delattr(torch._C, "_current_graph_task_id")
    else:
        monkeypatch.setattr(torch._C, "_current_graph_task_id", getter)
    assert wgrad_torch.graph_task_ids_differ() is not None
    p = torch.nn.Parameter(torch.zeros(5, 4))
    p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    calls: list[int] = []
    p.register_hook(lambda g: calls.append(1))
    x = torch.randn(3, requires_grad=True)
    for step in range(3):  # a tied weight: two fused uses per backward
        before = len(calls)
        _Fused.apply(_Fused.apply(x, p), p).sum().backward()
        assert len(calls) > before, f"backward {step} ran no hook of the weight"
    assert p.grad is not None and bool((p.grad == 0).all())
