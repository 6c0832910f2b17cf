"""Shared checker: gradsafe's B then W against one fused backward, in fp64."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from gradsafe.pipelining import stage_backward_input, stage_backward_weight

Make = Callable[[], tuple[nn.Module, list[Any], Callable[..., Sequence[Any]]]]


@pytest.fixture
def fp64():  # type: ignore[no-untyped-def]
    """float64 as the default dtype for the test (exact comparisons with a fused backward)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _tensors_with_grad(values: Sequence[Any]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


def check_split(
    make: Make,
    *,
    loss: bool = False,
    seed: int = 0,
    atol: float = 1e-9,
    split: tuple[Callable[..., Any], Callable[..., Any]] = (
        stage_backward_input,
        stage_backward_weight,
    ),
) -> Any:
    """Run ``make``'s forward twice: fused reference, then B and W; assert equal grads.

    ``split`` is the (B, W) pair checked: gradsafe's by default
    (tools/zoo_upstream.py passes torch's own). Returns the hand-off (consumed)
    for further assertions.
    """
    backward_input, backward_weight = split
    torch.manual_seed(seed)
    module, inputs, forward = make()
    params = [p for p in module.parameters() if p.requires_grad]
    grad_inputs = _tensors_with_grad(inputs)

    outputs = list(forward(*inputs))
    if loss:
        output_grads = None
    else:
        output_grads = [
            torch.randn_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
            for o in outputs
        ]
    pairs = [
        (o, torch.ones_like(o) if output_grads is None else output_grads[i])
        for i, o in enumerate(outputs)
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    reference = torch.autograd.grad(
        [o for o, _ in pairs], grad_inputs + params, [g for _, g in pairs], allow_unused=True
    )
    ref_inputs, ref_params = reference[: len(grad_inputs)], reference[len(grad_inputs) :]

    for p in module.parameters():
        p.grad = None
    outputs = list(forward(*inputs))
    dinputs, handoff = backward_input(outputs, output_grads, inputs, module.parameters())
    assert all(p.grad is None for p in module.parameters()), "B touched a parameter's .grad"
    backward_weight(module.parameters(), handoff)

    got_inputs = [
        d for d, v in zip(dinputs, inputs) if isinstance(v, torch.Tensor) and v.requires_grad
    ]
    for i, (want, got) in enumerate(zip(ref_inputs, got_inputs)):
        _assert_close(f"input {i}", want, got, atol)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    for name, want, p in zip(names, ref_params, params):
        _assert_close(name, want, p.grad, atol)
    return handoff


def _assert_close(
    what: str, want: torch.Tensor | None, got: torch.Tensor | None, atol: float
) -> None:
    if want is None or not want.abs().max() > 0:
        assert got is None or not got.abs().max() > atol, f"{what}: expected no gradient, got {got}"
        return
    assert got is not None, f"{what}: gradient dropped"
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-9, msg=f"{what} differs")


@pytest.fixture
def split_checker() -> Callable[..., Any]:
    return check_split


@pytest.fixture(autouse=True)
def _fp64() -> Any:
    """Every pipelining test runs in float64 (exact comparisons), restored after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
