"""``verify`` leaves the caller's model as it was, also where hooks and the loss close over it."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from gradsafe.verify import verify

_CALLER: list[nn.Module] = []  # a module-level global a hook reads: no copy can remap it


def _batches(count: int = 3) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(3, 4, generator=generator),) for _ in range(count)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def _state(model: nn.Module) -> dict[str, torch.Tensor | None]:
    named = dict(model.named_parameters())
    return {
        **{n: p.detach().clone() for n, p in named.items()},
        **{f"{n}.grad": None if p.grad is None else p.grad.clone() for n, p in named.items()},
    }


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a[k], b[k]) for k in a)
    )


def test_a_tensor_hook_adding_into_the_parameters_grad_leaves_the_callers_grad_alone() -> None:
    model = _model()
    weight = model[0].weight

    def add_into_grad(g: torch.Tensor) -> None:
        with torch.no_grad():
            weight.grad = g.clone() if weight.grad is None else weight.grad + g

    weight.register_hook(add_into_grad)
    before = _state(model)
    report = verify(model, _batches(), orders=("w-after-b",))
    assert report.ok, str(report)
    assert weight.grad is None
    assert _same(before, _state(model))


def test_a_hook_capturing_its_parameter_as_a_default_argument_is_isolated_like_a_closure() -> None:
    model = _model()
    for p in model.parameters():
        # ``p=p`` binds each loop's parameter, the usual way to write this hook in a loop.
        p.register_hook(lambda g, p=p: g + 0.01 * p.detach())
    before = _state(model)
    report = verify(model, _batches(), orders=("w-after-b",))
    assert report.ok, str(report)
    assert _same(before, _state(model))


def test_an_optimizer_step_in_backward_moves_the_copies_not_the_callers_parameters() -> None:
    model = _model()
    optimizers = {p: torch.optim.SGD([p], lr=0.5) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    before = _state(model)
    report = verify(model, _batches(), orders=("w-after-b",))
    assert report.ok, str(report)
    assert _same(before, _state(model))


def test_a_loss_with_a_learned_temperature_is_verified_and_its_grad_left_alone() -> None:
    model = _model()
    temperature = nn.Parameter(torch.tensor(2.0))

    def loss(out: torch.Tensor, k: int) -> torch.Tensor:
        return (out / temperature).pow(2).sum()

    report = verify(model, _batches(), loss)
    assert report.ok, str(report)
    assert temperature.grad is None
    rows = {row.name: row for row in report.grads}
    held = next(name for name in rows if "temperature" in name)
    assert rows[held].fused_max is not None and rows[held].fused_max > 0


def test_a_hook_reaching_the_callers_parameter_through_a_global_is_refused() -> None:
    model = _model()
    _CALLER[:] = [model]

    def through_global(g: torch.Tensor) -> None:
        with torch.no_grad():
            _CALLER[0][0].weight.grad = g.clone()

    model[0].weight.register_hook(through_global)
    try:
        with pytest.raises(
            ValueError,
            match=r"cannot isolate a hook: .*through_global global _CALLER.* reaches your",
        ):
            verify(model, _batches(), orders=("w-after-b",))
    finally:
        _CALLER.clear()
    assert model[0].weight.grad is None


def test_pythons_random_state_is_left_as_it_was() -> None:
    model = _model()
    random.seed(7)
    state = random.getstate()

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            random.random()
            return self.inner(x)

    verify(Noisy(), _batches(1), orders=("w-after-b",))
    assert random.getstate() == state


class _GatedByAttribute(nn.Module):
    """Keeps a function closing over its own gate as an attribute (a deep copy shares the function)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = nn.Parameter(torch.full((4,), 0.5))
        gate = self.gate
        self.apply_gate = lambda h: h * torch.sigmoid(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_gate(torch.tanh(self.lin(x)))


def test_a_function_kept_as_a_module_attribute_uses_the_copys_parameter() -> None:
    torch.manual_seed(0)
    module = _GatedByAttribute()
    report = verify(module, _batches(), orders=("w-after-b",))
    assert report.ok, str(report)
    assert module.gate.grad is None and module.lin.weight.grad is None
    assert next(r for r in report.grads if r.name == "gate").fused_max is not None
