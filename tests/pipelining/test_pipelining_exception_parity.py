"""gradsafe's split raises what torch's raises where both refuse the same call.

Where torch raises a ``RuntimeError`` (it wraps most failures of its split in
one), gradsafe's ``SplitBackwardError`` is one. Where torch raises an
``AssertionError`` (2.15: a ``GradientEdge`` root without output gradients) or
a ``TypeError`` (2.11: an output gradient of another type), gradsafe's error
is also one, so ``except`` clauses written for torch's exception catch
gradsafe's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.pipelining import _backward as torch_split

from gradsafe.pipelining import (
    GradientEdgeRootError,
    SplitBackwardError,
    stage_backward,
    stage_backward_input,
)


def _edge_without_grads() -> tuple[Any, ...]:
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    return [get_gradient_edge(lin(x))], None, [x], lin.parameters()


def _output_then_edge_without_grads() -> tuple[Any, ...]:
    # torch checks the edge whatever comes before it; a non-scalar output first
    # once made gradsafe refuse that output instead, as a plain SplitBackwardError.
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    y = lin(x)
    return [y * 2, get_gradient_edge(y)], None, [x], lin.parameters()


def _grad_of_wrong_type() -> tuple[Any, ...]:
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    return [lin(x)], ["not a tensor"], [x], lin.parameters()


def _torch_raises(fn: Callable[..., Any], args: tuple[Any, ...]) -> type[BaseException] | None:
    try:
        fn(*args)
    except Exception as exc:  # what torch raises is what is measured
        return type(exc)
    return None


def test_a_gradient_edge_root_without_output_gradients_is_an_assertion_error_too() -> None:
    with pytest.raises(GradientEdgeRootError) as raised:
        stage_backward_input(*_edge_without_grads())
    assert isinstance(raised.value, AssertionError) and isinstance(raised.value, SplitBackwardError)
    assert isinstance(raised.value, RuntimeError)
    # torch 2.15's wording, which its test_stage_backward_input_edge_requires_output_grads matches.
    assert "A GradientEdge root requires output gradients" in str(raised.value)


def test_a_gradient_edge_root_without_gradients_is_an_assertion_error_after_another_output() -> (
    None
):
    with pytest.raises(GradientEdgeRootError) as raised:
        stage_backward_input(*_output_then_edge_without_grads())
    assert isinstance(raised.value, AssertionError)
    assert "[0], [1]" in str(raised.value)  # both roots without a gradient are named
    assert "requires output gradients" in str(raised.value)


@pytest.mark.parametrize(
    "case, split",
    [
        (_edge_without_grads, "stage_backward_input"),
        (_output_then_edge_without_grads, "stage_backward_input"),
        (_grad_of_wrong_type, "stage_backward_input"),
        (_grad_of_wrong_type, "stage_backward"),
    ],
)
def test_gradsafe_error_is_caught_where_torch_error_would_be(
    case: Callable[[], tuple[Any, ...]], split: str
) -> None:
    args = case()
    if split == "stage_backward":
        args = args[:3]
    expected = _torch_raises(getattr(torch_split, split), args)
    if expected is None or not issubclass(expected, (RuntimeError, AssertionError, TypeError)):
        pytest.skip(f"torch's {split} raises {expected} here (not a refusal of the call)")
    ours = stage_backward_input if split == "stage_backward_input" else stage_backward
    with pytest.raises(expected):
        ours(*case()[: len(args)])
