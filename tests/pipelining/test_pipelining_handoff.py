"""The B->W hand-off: misuse errors, release of everything held, work done per pass, patch install."""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradsafe
from gradsafe.pipelining import (
    HandoffState,
    SplitBackwardError,
    WeightGradHandoff,
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def _b(model: nn.Module) -> WeightGradHandoff:
    x = torch.randn(3, 4, requires_grad=True)
    _, handoff = stage_backward_input([model(x)], [torch.ones(3, 4)], [x], model.parameters())
    return handoff


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b)
    )


def test_w_without_b() -> None:
    model = _model()
    with pytest.raises(SplitBackwardError, match="Run B first"):
        stage_backward_weight(model.parameters(), None)  # type: ignore[arg-type]
    assert all(p.grad is None for p in model.parameters())


def test_w_twice_raises_and_changes_nothing() -> None:
    model = _model()
    handoff = _b(model)
    stage_backward_weight(model.parameters(), handoff)
    assert handoff.state is HandoffState.CONSUMED
    before = _grads(model)
    with pytest.raises(SplitBackwardError, match="called twice"):
        stage_backward_weight(model.parameters(), handoff)
    assert _same(before, _grads(model))


def test_handoff_from_another_stage() -> None:
    model, other = _model(), _model()
    handoff = _b(model)
    with pytest.raises(SplitBackwardError, match=r"lack 4 of the 4 parameters .*shape \(4, 4\)"):
        stage_backward_weight(other.parameters(), handoff)
    assert all(p.grad is None for p in [*model.parameters(), *other.parameters()])
    assert handoff.state is HandoffState.FAILED  # every exception: never reusable
    with pytest.raises(SplitBackwardError, match="already failed"):
        stage_backward_weight(model.parameters(), handoff)
    assert all(p.grad is None for p in model.parameters())


def test_torch_param_groups_are_refused() -> None:
    from torch.distributed.pipelining import _backward as upstream

    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    _, groups = upstream.stage_backward_input(
        [model(x)], [torch.ones(3, 4)], [x], model.parameters()
    )
    with pytest.raises(SplitBackwardError, match="torch's own param_groups"):
        stage_backward_weight(model.parameters(), groups)  # type: ignore[arg-type]
    assert all(p.grad is None for p in model.parameters())


def test_retain_graph_must_be_bool() -> None:
    model = _model()
    handoff = _b(model)
    with pytest.raises(SplitBackwardError, match="retain_graph must be a bool"):
        stage_backward_weight(model.parameters(), handoff, handoff)  # type: ignore[arg-type]
    assert handoff.state is HandoffState.FAILED
    assert all(p.grad is None for p in model.parameters())


def test_graph_freed_between_b_and_w() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    # The first Linear's output: a backward from it runs only nodes W calls (one through
    # the tanh would stop there: B freed the tanh's saved output, which W never needs).
    hidden = model[0](x)
    out = model[2](model[1](hidden))
    _, handoff = stage_backward_input([out], [torch.ones(3, 4)], [x], model.parameters())
    hidden.sum().backward()  # frees the saved tensors W needs (no retain_graph)
    before = _grads(model)
    with pytest.raises(
        SplitBackwardError, match="before changing any parameter.s gradient: the saved tensors"
    ):
        stage_backward_weight(model.parameters(), handoff)
    assert _same(before, _grads(model))
    assert handoff.state is HandoffState.FAILED
    with pytest.raises(SplitBackwardError, match="already failed"):
        stage_backward_weight(model.parameters(), handoff)


def test_unmatched_output_grads() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(
        SplitBackwardError, match="list of 2 but its output gradient is a list of 1"
    ):
        stage_backward_input([model(x), model(x)], [torch.ones(3, 4)], [x], model.parameters())
    with pytest.raises(SplitBackwardError, match="output gradient is None"):
        stage_backward_input([model(x)], [None], [x], model.parameters())


def test_everything_held_for_w_is_released_when_w_finishes() -> None:
    gc.disable()  # freed by reference counting, not by the cycle collector
    try:
        model = nn.Sequential(
            nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)
        )
        x = torch.randn(3, 4, requires_grad=True)
        hidden = model[1](model[0](x))
        probe = weakref.ref(hidden)
        out = model[4](model[3](model[2](hidden)))
        grad = torch.ones(3, 4)
        grad_probe = weakref.ref(grad)
        _, handoff = stage_backward_input([out], [grad], [x], model.parameters())
        del hidden, grad, out  # as the schedule does: only the hand-off keeps the graph
        assert probe() is not None, "B should keep what W needs"
        stage_backward_weight(model.parameters(), handoff)
        assert probe() is None, "an activation outlived W"
        assert grad_probe() is None, "an output gradient outlived W"
        assert "consumed" in repr(handoff)
    finally:
        gc.enable()


class _GemmCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.counts["gemm"] += 1
        return func(*args, **(kwargs or {}))


def _gemms(model: nn.Module, forward: Any) -> tuple[int, int]:
    x = torch.randn(8, 16, requires_grad=True)
    out = forward(x)
    with _GemmCounter() as b_mode:
        _, handoff = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
    with _GemmCounter() as w_mode:
        stage_backward_weight(model.parameters(), handoff)
    return b_mode.counts["gemm"], w_mode.counts["gemm"]


@pytest.mark.parametrize("layers", [1, 4])
def test_b_computes_no_weight_gemm_and_w_no_input_gemm(layers: int) -> None:
    shared = nn.Linear(16, 16, bias=False)
    distinct = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(layers)))
    raw = nn.Parameter(torch.randn(16, 16))
    holder = nn.Module()
    holder.w = raw

    def shared_fwd(x: torch.Tensor) -> torch.Tensor:
        for _ in range(layers):
            x = torch.tanh(shared(x))
        return x

    def nested_fwd(x: torch.Tensor) -> torch.Tensor:
        for _ in range(layers):
            x = torch.tanh(x @ raw)
        return x

    # Fused: one input GEMM and one weight GEMM per use. Split: half each.
    assert _gemms(distinct, distinct) == (layers, layers)
    assert _gemms(shared, shared_fwd) == (layers, layers)
    assert _gemms(holder, nested_fwd) == (layers, layers)


def test_patch_installs_into_backward_and_stage_modules() -> None:
    from torch.distributed.pipelining import _backward as torch_backward
    from torch.distributed.pipelining import stage as torch_stage

    names = ("stage_backward_input", "stage_backward_weight", "stage_backward")
    originals = {
        (m.__name__, n): getattr(m, n) for m in (torch_backward, torch_stage) for n in names
    }
    ours = {
        "stage_backward_input": stage_backward_input,
        "stage_backward_weight": stage_backward_weight,
        "stage_backward": stage_backward,
    }
    with gradsafe.patch("pipelining") as handle:
        assert handle.names == ("pipelining",)
        for module in (torch_backward, torch_stage):
            for name in names:
                assert getattr(module, name) is ours[name]
        assert gradsafe.status()["pipelining"].active
        assert (
            gradsafe.get_original(torch_stage.__name__, "stage_backward_input")
            is originals[(torch_stage.__name__, "stage_backward_input")]
        )
    for (module_name, name), original in originals.items():
        module = torch_backward if module_name == torch_backward.__name__ else torch_stage
        assert getattr(module, name) is original


def test_fused_stage_backward_matches_autograd() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    g = torch.randn(3, 4)
    want = torch.autograd.grad(model(x), [x, *model.parameters()], g)
    (dx,) = stage_backward({"a": [out, 3]}, {"a": [g, None]}, [x])
    torch.testing.assert_close(dx, want[0])
    assert x.grad is None
    for p, w in zip(model.parameters(), want[1:]):
        torch.testing.assert_close(p.grad, w)


def _outcome(run: Any) -> Any:
    try:
        return run()
    except RuntimeError as exc:  # torch's split crashes on some of them
        return exc


def test_hazard_reproductions_right_with_gradsafe_wrong_without() -> None:
    from gradsafe.pipelining._hazards import CHECKS

    rows = {check.hazard: check for check in CHECKS}
    assert set(rows) == {
        "H1 nested shared weight",
        "H1 parameter-only output",
        "H1 overlapping groups",
        "H1 hooks in W",
        "H6 schedule start-up",
        "H7 tied stages scaled once",
    }
    for name, check in rows.items():
        assert check.gradsafe().correct is True, name
    # Every installed torch we support gets these wrong on its own (or crashes).
    for name in (
        "H1 parameter-only output",
        "H1 overlapping groups",
        "H1 hooks in W",
        "H6 schedule start-up",
        "H7 tied stages scaled once",
    ):
        outcome = _outcome(rows[name].upstream)
        assert isinstance(outcome, RuntimeError) or outcome.correct is False, name


@pytest.mark.parametrize(
    "context",
    [torch.no_grad, torch.inference_mode, lambda: torch.device("meta")],
    ids=["no_grad", "inference_mode", "meta device"],
)
def test_feature_probe_works_in_any_context(context: Any) -> None:
    from gradsafe.pipelining._torch import missing_feature

    with context():
        assert missing_feature() is None
