"""Stage outputs in B: tensors, nested tuples/lists/dicts (as stage_backward takes), GradientEdge roots."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from gradsafe.pipelining import (
    SplitBackwardError,
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)


class Multi(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.tanh(self.a(x))
        return {"main": self.b(h), "aux": (self.c(h), [h * 2, 3, None]), "note": "text"}


def _grads_like(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return torch.randn_like(out)
    if isinstance(out, dict):
        return {k: _grads_like(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_grads_like(v) for v in out)
    return None


def _pairs(out: Any, grad: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [(out, grad)]
    if isinstance(out, dict):
        return [p for k in out for p in _pairs(out[k], grad[k])]
    if isinstance(out, (tuple, list)):
        return [p for o, g in zip(out, grad) for p in _pairs(o, g)]
    return []


def test_nested_dict_tuple_list_outputs_equal_fused() -> None:
    model = Multi().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(1)
    out = model(x)
    grads = _grads_like(out)
    pairs = _pairs(out, grads)
    want = torch.autograd.grad(
        [o for o, _ in pairs], [x, *model.parameters()], [g for _, g in pairs]
    )
    out = model(x)
    dinputs, handoff = stage_backward_input(out, grads, [x], model.parameters())
    stage_backward_weight(model.parameters(), handoff)
    torch.testing.assert_close(dinputs[0], want[0], atol=1e-12, rtol=1e-12)
    for p, w in zip(model.parameters(), want[1:]):
        torch.testing.assert_close(p.grad, w, atol=1e-12, rtol=1e-12)


def test_gradient_edge_roots_equal_fused() -> None:
    model = Multi().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = model(x)
    g1, g2 = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    want = torch.autograd.grad(
        [out["main"], out["aux"][0]], [x, *model.parameters()], [g1, g2], allow_unused=True
    )
    out = model(x)
    edges = [get_gradient_edge(out["main"]), get_gradient_edge(out["aux"][0])]
    dinputs, handoff = stage_backward_input(edges, [g1, g2], [x], model.parameters())
    stage_backward_weight(model.parameters(), handoff)
    torch.testing.assert_close(dinputs[0], want[0], atol=1e-12, rtol=1e-12)
    for p, w in zip(model.parameters(), want[1:]):
        if w is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, w, atol=1e-12, rtol=1e-12)


def test_scalar_gradient_edge_loss_needs_no_gradient() -> None:
    model = Multi().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    loss = model(x)["main"].pow(2).sum()
    want = torch.autograd.grad(loss, [x, model.b.weight], retain_graph=True)
    dinputs, handoff = stage_backward_input(get_gradient_edge(loss), None, [x], model.parameters())
    stage_backward_weight(model.parameters(), handoff)
    torch.testing.assert_close(dinputs[0], want[0])
    torch.testing.assert_close(model.b.weight.grad, want[1])


def test_fused_stage_backward_takes_the_same_structures() -> None:
    model = Multi().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = model(x)
    grads = _grads_like(out)
    pairs = _pairs(out, grads)
    want = torch.autograd.grad([o for o, _ in pairs], [x], [g for _, g in pairs], retain_graph=True)
    (dx,) = stage_backward(out, grads, [x])
    torch.testing.assert_close(dx, want[0])


@pytest.mark.parametrize("bad", [object(), {1, 2}, b"raw".decode])
def test_other_output_types_are_a_clear_error(bad: Any) -> None:
    model = Multi().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = model(x)["main"]
    with pytest.raises(
        SplitBackwardError, match=r"stage output \[1\] is a .*B takes Tensors, GradientEdges"
    ):
        stage_backward_input([out, bad], [torch.ones_like(out), None], [x], model.parameters())
    assert x.grad is None
