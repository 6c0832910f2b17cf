"""Doctor rows for ``pipelining``: tiny fp64 graphs run through the installed B/W split.

Each repro looks the functions up in ``torch.distributed.pipelining._backward``
at call time, so the same code measures torch's split and, under
``gradsafe.patch("pipelining")``, gradsafe's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradsafe.doctor import Check, Outcome, patched_check

__all__ = ["CHECKS"]


def _split(
    module: nn.Module, x: torch.Tensor, forward: Callable[[torch.Tensor], Sequence[torch.Tensor]]
) -> None:
    backward = importlib.import_module("torch.distributed.pipelining._backward")
    outputs = list(forward(x))
    grads = [torch.ones_like(o) for o in outputs]
    _, handoff = backward.stage_backward_input(outputs, grads, [x], module.parameters())
    backward.stage_backward_weight(module.parameters(), handoff)


def _compare(
    build: Callable[[], nn.Module], forward: Callable[[Any, torch.Tensor], Sequence[torch.Tensor]]
) -> Outcome:
    torch.manual_seed(0)
    module = build().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    outputs = forward(module, x)
    torch.autograd.backward(list(outputs), [torch.ones_like(o) for o in outputs])
    reference = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    _split(module, x, lambda t: forward(module, t))
    worst = 0.0
    for name, param in module.named_parameters():
        if name not in reference:
            continue
        if param.grad is None:
            return Outcome(False, f"{name}.grad dropped")
        worst = max(worst, (param.grad - reference[name]).abs().max().item())
    if worst > 1e-9:
        return Outcome(False, f"max |grad error| {worst:.2g}")
    return Outcome(True, "grads equal a fused backward")


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))


class _Prefix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.prefix = nn.Parameter(torch.randn(2, 4))


class _Sandwich(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)


def _nested() -> Outcome:
    return _compare(_Nested, lambda m, x: [x @ m.w @ m.w])


def _param_only() -> Outcome:
    return _compare(_Prefix, lambda m, x: [m.lin(x), torch.tanh(m.prefix)])


def _overlapping() -> Outcome:
    return _compare(_Sandwich, lambda m, x: [m.outer(torch.tanh(m.inner(m.outer(x))))])


def _hooks() -> Outcome:
    torch.manual_seed(0)
    module = _Sandwich().double()
    fired: list[str] = []
    for name, param in module.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    _split(module, x, lambda t: [module.inner(module.outer(t))])
    expected = sorted(n for n, _ in module.named_parameters())
    if sorted(fired) == expected:
        return Outcome(True, "post-accumulate hooks fired once per parameter in W")
    return Outcome(False, f"post-accumulate hooks fired {len(fired)}x for {len(expected)} parameters")


CHECKS: tuple[Check, ...] = tuple(
    patched_check(hazard, "pipelining", "pipelining", repro)
    for hazard, repro in (
        ("H1 nested shared weight", _nested),
        ("H1 parameter-only output", _param_only),
        ("H1 overlapping groups", _overlapping),
        ("H1 hooks in W", _hooks),
    )
)
