"""H1's reproductions, written once, and the capability's doctor rows (:data:`CHECKS`), H6's and H7's included.

Each H1 reproduction looks the split functions up in
``torch.distributed.pipelining._backward`` at call time, so the same code
measures torch's split and, under ``gradsafe.patch("pipelining")``, gradsafe's.
H6's and H7's, fixes to torch's schedule classes, are reproduced beside their
fixes: ``schedule/_inference_hazards.py`` and ``schedule/_scaling_hazards.py``.
The doctor's rows, the tests and the benchmarks use them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from gradsafe.checks import Check, Outcome, patched_check
from gradsafe.pipelining._torch import split_backward_module
from gradsafe.pipelining.schedule._inference_hazards import (
    INFERENCE_FIGURE_VARIES,
    inference_leaves_no_trace,
)
from gradsafe.pipelining.schedule._scaling_hazards import shared_weight_scaled_once

__all__ = [
    "CHECKS",
    "ParamOnlyOutput",
    "ReusedAroundOther",
    "ReusedLinear",
    "as_outputs",
    "compare_with_fused",
    "hooks_fire_once_in_w",
    "split_backward",
]


class ReusedLinear(nn.Module):
    """Nested shared weight: one Linear applied ``uses`` times, ``tanh`` between uses."""

    def __init__(self, dim: int = 4, uses: int = 2, bias: bool = False) -> None:
        super().__init__()
        self.uses = uses
        self.lin = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.uses):
            x = torch.tanh(self.lin(x))
        return x


class ParamOnlyOutput(nn.Module):
    """A parameter reaching an output with no input-dependent node (a learned prefix)."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.prefix = nn.Parameter(torch.randn(2, dim))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.lin(x), torch.tanh(self.prefix)]


class ReusedAroundOther(nn.Module):
    """Overlapping parameter groups: one Linear applied at two sites with another Linear between."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.outer = nn.Linear(dim, dim)
        self.inner = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.outer(torch.tanh(self.inner(self.outer(x)))))


def as_outputs(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A stage's return value as the list of outputs the split functions take."""
    return [value] if isinstance(value, torch.Tensor) else list(value)


def split_backward(module: nn.Module, x: torch.Tensor) -> None:
    """Forward ``module`` on ``x``, then B and W with whatever split the installed torch has."""
    backward = split_backward_module()
    outputs = as_outputs(module(x))
    grads = [torch.ones_like(o) for o in outputs]
    _, handoff = backward.stage_backward_input(outputs, grads, [x], module.parameters())
    backward.stage_backward_weight(module.parameters(), handoff)


def compare_with_fused(build: Callable[[], nn.Module]) -> Outcome:
    """``build``'s split gradients against one fused backward, fp64."""
    torch.manual_seed(0)
    module = build().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    outputs = as_outputs(module(x))
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    reference = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    split_backward(module, x.detach().requires_grad_())
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


def hooks_fire_once_in_w() -> Outcome:
    """Parameter hooks that run when a gradient is accumulated fire once per parameter in W.

    Two distinct Linears, so no other hazard is involved. torch's split computes
    weight gradients with ``torch.autograd.grad`` and assigns ``.grad``: a
    parameter's tensor hooks fire, but its post-accumulate-grad hooks and the
    hooks on its ``AccumulateGrad`` node never do.
    """
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    fired: dict[str, int] = {}
    accumulators = []  # kept alive: autograd holds a parameter's AccumulateGrad node weakly

    def count(kind: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            fired[kind] = fired.get(kind, 0) + 1

        return hook

    for param in module.parameters():
        param.register_post_accumulate_grad_hook(count("post-accumulate-grad"))
        accumulator = torch.autograd.graph.get_gradient_edge(param).node
        accumulator.register_hook(count("AccumulateGrad node"))
        accumulators.append(accumulator)
    split_backward(module, torch.randn(3, 4, dtype=torch.float64, requires_grad=True))
    n = len(accumulators)
    wrong = [
        f"{kind} hooks fired {fired.get(kind, 0)}x"
        for kind in ("post-accumulate-grad", "AccumulateGrad node")
        if fired.get(kind, 0) != n
    ]
    if not wrong:
        return Outcome(
            True,
            f"post-accumulate-grad and AccumulateGrad node hooks fired once per parameter ({n}) in W",
        )
    return Outcome(False, ", ".join(wrong) + f" for {n} parameters")


CHECKS: tuple[Check, ...] = tuple(
    patched_check(hazard, "pipelining", "pipelining", repro, note)
    for hazard, repro, note in (
        ("H1 nested shared weight", lambda: compare_with_fused(ReusedLinear), ""),
        ("H1 parameter-only output", lambda: compare_with_fused(ParamOnlyOutput), ""),
        ("H1 overlapping groups", lambda: compare_with_fused(ReusedAroundOther), ""),
        ("H1 hooks in W", hooks_fire_once_in_w, ""),
        ("H6 schedule start-up", inference_leaves_no_trace, INFERENCE_FIGURE_VARIES),
        ("H7 tied stages scaled once", shared_weight_scaled_once, ""),
    )
)
