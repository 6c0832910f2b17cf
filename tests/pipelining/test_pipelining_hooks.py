"""Parameter hooks fire in W exactly as in a fused backward: once, complete, never in B."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradsafe.pipelining import stage_backward_input, stage_backward_weight


class Sandwich(nn.Module):
    """A Linear reused around another Linear, plus a tied head: overlapping uses."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4, bias=False)
        self.ln = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.outer(torch.tanh(self.inner(self.outer(x))))
        return self.ln(h) @ self.inner.weight.t() + self.outer.bias


def _reference(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    out = model(x)
    grads = torch.autograd.grad(out, list(model.parameters()), g)
    return {n: gr for (n, _), gr in zip(model.named_parameters(), grads)}


def _split(model: nn.Module, x: torch.Tensor, g: torch.Tensor, phase: list[str]) -> None:
    phase[0] = "B"
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    phase[0] = "W"
    stage_backward_weight(model.parameters(), handoff)
    phase[0] = "after"


def test_tensor_post_accumulate_and_node_hooks_fire_once_in_w_with_complete_grads() -> None:
    torch.manual_seed(0)
    model = Sandwich().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    want = _reference(model, x, g)
    phase = ["setup"]
    events: list[tuple[str, str, str]] = []
    seen_tensor: dict[str, torch.Tensor] = {}
    grad_accs = []
    for name, p in model.named_parameters():

        def tensor_hook(grad: torch.Tensor, name: str = name) -> None:
            events.append(("tensor", name, phase[0]))
            seen_tensor[name] = grad.clone()

        def post_acc(p: torch.Tensor, name: str = name) -> None:
            events.append(("post_accumulate", name, phase[0]))
            torch.testing.assert_close(p.grad, want[name], atol=1e-9, rtol=1e-9)

        def node_hook(grad_inputs: Any, grad_outputs: Any, name: str = name, p: Any = p) -> None:
            events.append(("node", name, phase[0]))
            torch.testing.assert_close(p.grad, want[name], atol=1e-9, rtol=1e-9)

        p.register_hook(tensor_hook)
        p.register_post_accumulate_grad_hook(post_acc)
        grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]  # Megatron style
        grad_acc.register_hook(node_hook)
        grad_accs.append(grad_acc)  # the node lives only while referenced, as in Megatron

    _split(model, x, g, phase)
    names = [n for n, _ in model.named_parameters()]
    for kind in ("tensor", "post_accumulate", "node"):
        fired = sorted(n for k, n, _ in events if k == kind)
        assert fired == sorted(names), f"{kind} hooks: {fired}"
    assert {ph for _, _, ph in events} == {"W"}, "a parameter hook fired outside W"
    for name in names:
        torch.testing.assert_close(seen_tensor[name], want[name], atol=1e-9, rtol=1e-9)


def test_megatron_style_main_grad_over_microbatches_with_tied_weight() -> None:
    """Node post-hook on AccumulateGrad moves .grad into main_grad and clears it (Megatron DDP)."""
    torch.manual_seed(0)
    model = Sandwich().double()
    params = list(model.named_parameters())
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    gs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
    want = {n: torch.zeros_like(p) for n, p in params}
    for x, g in zip(xs, gs):
        for n, gr in _reference(model, x, g).items():
            want[n] += gr

    calls = {n: 0 for n, _ in params}
    handles, grad_accs = [], []
    for name, p in params:
        p.main_grad = torch.zeros_like(p)  # type: ignore[attr-defined]

        def ready(grad_inputs: Any, grad_outputs: Any, name: str = name, p: Any = p) -> None:
            assert p.grad is not None, "AccumulateGrad hook fired without a gradient"
            p.main_grad.add_(p.grad)
            p.grad = None
            calls[name] += 1

        grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
        handles.append(grad_acc.register_hook(ready))
        grad_accs.append(grad_acc)

    # Interleave like a zero-bubble schedule: B0 B1 W0 B2 W1 W2.
    handoffs = {}
    order = [("B", 0), ("B", 1), ("W", 0), ("B", 2), ("W", 1), ("W", 2)]
    for kind, i in order:
        if kind == "B":
            before = dict(calls)
            _, handoffs[i] = stage_backward_input([model(xs[i])], [gs[i]], [xs[i]], model.parameters())
            assert calls == before, "a hook fired during B"
        else:
            stage_backward_weight(model.parameters(), handoffs.pop(i))
    assert all(c == 3 for c in calls.values()), calls
    for name, p in params:
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, want[name], atol=1e-9, rtol=1e-9)  # type: ignore[attr-defined]
    for handle in handles:
        handle.remove()
