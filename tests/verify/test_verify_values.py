"""``verify`` sees a wrong gradient where ``.grad`` cannot show it: in a complex gradient's imaginary
part, and in parameters a hook steps during the backward (leaving no ``.grad``); buffers a
recomputation updates are not a difference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.verify import _api, verify
from gradsafe.verify._run import Split

_GRADSAFE_SPLIT = _api._gradsafe_split


def _after_w(change: Callable[[list[nn.Parameter]], None]) -> Callable[[], Split]:
    """gradsafe's split whose W then applies ``change`` to the stage's parameters."""

    def make() -> Split:
        real = _GRADSAFE_SPLIT()

        def weight(weights: Any, handoff: Any) -> Any:
            params = list(weights)
            result = real.backward_weight(params, handoff)
            change(params)
            return result

        return Split(real.backward_input, weight, real.backward)

    return make


def _batches(count: int = 4) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(3, 4, generator=generator),) for _ in range(count)]


class _ComplexWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x).to(self.w.dtype) @ self.w).abs()


def _shift_imaginary_part(params: list[nn.Parameter]) -> None:
    for p in params:
        if p.is_complex() and p.grad is not None:
            p.grad = p.grad + 1j * torch.ones_like(p.grad.real)


def test_a_wrong_imaginary_part_of_a_complex_gradient_makes_the_report_not_ok(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    module = _ComplexWeight()
    assert verify(module, _batches()).ok  # the real split: exact, imaginary part included
    monkeypatch.setattr(_api, "_gradsafe_split", _after_w(_shift_imaginary_part))
    report = verify(module, _batches())
    assert not report.ok, str(report)
    assert all(r.verdict == "WRONG" and "w" in r.params for r in report.gradsafe.values())


class _Stepped(nn.Module):
    """A stage whose parameters take an SGD step in backward, as optimizer-in-backward does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        for p in self.lin.parameters():
            p.register_post_accumulate_grad_hook(_sgd_step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _sgd_step(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.add_(p.grad, alpha=-0.1)
    p.grad = None


def _nudge(params: list[nn.Parameter]) -> None:
    with torch.no_grad():
        for p in params:
            p.add_(1e-3)


def test_a_wrong_step_by_a_hook_that_consumes_the_gradient_makes_the_report_not_ok(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    module = _Stepped()
    report = verify(module, _batches(), orders=("w-after-b",))
    assert report.ok, str(report)  # the real split steps exactly as fused
    rows = {r.name: r for r in report.grads}
    assert rows["lin.weight"].fused_max is None  # the hook left no .grad to compare
    monkeypatch.setattr(_api, "_gradsafe_split", _after_w(_nudge))
    report = verify(module, _batches(), orders=("w-after-b",))
    assert not report.ok, str(report)
    assert {"value of lin.weight after the run", "value of lin.bias after the run"} <= set(
        report.gradsafe["w-after-b"].params
    )
    assert "value of lin.weight after the run" in str(report)


class _CheckpointedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: torch.tanh(self.norm(self.lin(t))), x, use_reentrant=False)


def test_running_statistics_a_first_stage_recomputes_in_ws_slot_are_not_a_difference() -> None:
    # The first of several stages runs its backward (and so its recomputation, which
    # updates BatchNorm's running statistics) in W's slot, as any split schedule
    # does: buffers are not compared, parameters are, and none moved.
    torch.manual_seed(0)
    report = verify([_CheckpointedNorm(), _CheckpointedNorm()], _batches(5))
    assert report.ok, str(report)
    assert not [r.name for r in report.grads if r.name.startswith("value of")]


def test_a_split_that_moves_a_parameter_fused_leaves_alone_makes_the_report_not_ok(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    monkeypatch.setattr(_api, "_gradsafe_split", _after_w(_nudge))
    report = verify(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), _batches(1))
    assert not report.ok, str(report)
    assert report.gradsafe["w-after-b"].params == (
        "value of 0.weight after the run",
        "value of 0.bias after the run",
    )
