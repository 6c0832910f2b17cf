"""The shortcuts B and W take for their fixed cost are taken only where they change nothing."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.pipelining._weight_pass import _ANCHOR


def test_b_leaves_a_complex_output_with_a_real_gradient_to_autograd_grads_check() -> None:
    # B's direct engine call would skip autograd.grad's complexness check.
    w = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    x = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    y = x * w
    with pytest.raises(RuntimeError) as torch_error:
        torch.autograd.grad(y, x, torch.ones(3), retain_graph=True)
    with pytest.raises(RuntimeError) as error:
        stage_backward_input([y], [torch.ones(3)], [x], [w])
    assert str(error.value) == str(torch_error.value)
    assert "For complex Tensors" in str(error.value)
    assert x.grad is None and w.grad is None


class _Counting(torch.Tensor):
    """A tensor subclass whose __torch_function__ sees every call, autograd.grad included."""

    grad_calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.autograd.grad:
            cls.grad_calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_b_honours_a_torch_function_override_of_autograd_grad() -> None:
    torch.manual_seed(0)
    stage = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    y = stage(x).as_subclass(_Counting)  # the stage output (B's root) overrides
    assert y.grad_fn is not None
    _Counting.grad_calls = 0
    (dx,), handoff = stage_backward_input([y], [torch.ones(5, 3)], [x], list(stage.parameters()))
    assert _Counting.grad_calls == 1  # B's engine call went through the override
    stage_backward_weight(list(stage.parameters()), handoff)
    expected = torch.ones(5, 3) @ stage.weight.detach()
    assert torch.equal(dx, expected)
    assert torch.equal(stage.bias.grad, torch.full((3,), 5.0))


def _stage_grads(seed: int, split: bool) -> list[torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)  # threads share the global generator
    stage = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    with torch.no_grad():
        for p in stage.parameters():
            p.copy_(torch.randn(p.shape, generator=rng))
    grads: list[torch.Tensor] = []
    for step in range(3):  # .grad None, then held
        x = torch.randn(4, 8, generator=rng).requires_grad_()
        y = stage(x)
        g = torch.full_like(y, 1.0 + step)
        if split:
            (dx,), handoff = stage_backward_input([y], [g], [x], stage.parameters())
            stage_backward_weight(stage.parameters(), handoff)
        else:
            torch.autograd.backward([y], [g])
            dx = x.grad
        grads.append(dx)
    return grads + [p.grad for p in stage.parameters()]


def test_w_on_several_threads_at_once_shares_the_anchor_exactly() -> None:
    # Every W hangs its helper nodes from one process-wide anchor.
    expected = {seed: _stage_grads(seed, split=False) for seed in range(4)}
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def run(seed: int) -> None:
        try:
            start.wait(timeout=60)
            for _ in range(20):
                results[seed] = _stage_grads(seed, split=True)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for seed, grads in expected.items():
        for got, want in zip(results[seed], grads):
            assert torch.equal(got, want)
    assert _ANCHOR.leaf.grad is None and torch.equal(_ANCHOR.one, torch.ones(()))


def test_w_with_another_default_dtype_and_device_keeps_the_anchor_as_made(fp64: None) -> None:
    stage = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    y = stage(x)
    _, handoff = stage_backward_input([y], [torch.ones_like(y)], [x], stage.parameters())
    stage_backward_weight(stage.parameters(), handoff)
    assert stage.weight.grad.dtype == torch.float64
    assert torch.equal(stage.weight.grad, torch.ones(2, 4, dtype=torch.float64) @ x.detach())
    assert _ANCHOR.leaf.dtype == torch.float32 and _ANCHOR.leaf.device.type == "cpu"
    assert _ANCHOR.leaf.grad is None


class _WithSetupContext(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        _WithSetupContext.calls += 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def test_apply_function_leaves_a_function_with_setup_context_to_its_apply() -> None:
    # Function.apply binds default arguments for those: the C apply alone would not.
    from gradsafe.pipelining._torch import apply_function

    x = torch.ones(2, requires_grad=True)
    _WithSetupContext.calls = 0
    y = apply_function(_WithSetupContext, x)
    assert _WithSetupContext.calls == 1 and type(y.grad_fn).__name__ == "_WithSetupContextBackward"


def test_apply_function_leaves_functorch_transforms_to_function_apply() -> None:
    from gradsafe.pipelining._torch import apply_function

    # Inside a transform the C apply would skip functorch's custom_function_call.
    out = torch.func.grad(lambda t: apply_function(_WithSetupContext, t).sum())(torch.ones(2))
    assert torch.equal(out, torch.ones(2))
