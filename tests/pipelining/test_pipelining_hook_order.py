"""The order hooks fire in across a split backward, as docs/pipelining.md ("Hook order") states it.

Counts and gradients are a fused backward's; the order is not wholly: hooks B
runs all fire before any W runs, and W delivers a parameter whose ``.grad`` is
held as soon as its gradient is complete (a chain of layers: the fused order)
but every parameter whose ``.grad`` is None together in its last engine pass,
after all held ones, in that pass's order. Each parameter's own hooks keep the
fused order among themselves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsafe.pipelining import stage_backward_input, stage_backward_weight

_W = "|W|"  # where W starts, in a split's events


def _events(split: bool, held_layers: str) -> list[str]:
    """The hook events of one backward of a 3-Linear chain; layers in ``held_layers`` hold ``.grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    events: list[str] = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: events.append(f"tensor {name}"))
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"post {name}"))
        if name.split(".")[0] in held_layers:
            p.grad = torch.zeros_like(p)
    model[2].register_full_backward_hook(lambda *args: events.append("module 2"))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    if not split:
        model(x).backward(g)
        return events
    _, handoff = stage_backward_input([model(x)], [g], [x], model.parameters())
    events.append(_W)
    stage_backward_weight(model.parameters(), handoff)
    return events


def _parameter_events(events: list[str], layers: str = "024") -> list[str]:
    return [e for e in events if e.split()[0] in ("tensor", "post") and e.split()[1][0] in layers]


@pytest.mark.parametrize("held", ["", "2", "04", "024"])
def test_every_hook_fires_once_and_hooks_b_runs_fire_before_any_w_runs(held: str) -> None:
    fused, split = _events(False, held), _events(True, held)
    assert sorted(e for e in split if e != _W) == sorted(fused)
    assert split.index("module 2") < split.index(_W)  # fused: between layer 2's and layer 0's
    assert fused.index("module 2") > fused.index("post 2.weight")


@pytest.mark.parametrize("held", ["", "2", "04", "024"])
def test_each_parameters_own_hooks_keep_the_fused_order(held: str) -> None:
    fused, split = _events(False, held), _events(True, held)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"):
        own = [f"tensor {name}", f"post {name}"]
        assert [e for e in fused if e in own] == own
        assert [e for e in split if e in own] == own


def test_with_every_grad_held_parameter_hooks_fire_in_the_fused_order() -> None:
    assert _parameter_events(_events(True, "024")) == _parameter_events(_events(False, "024"))


@pytest.mark.parametrize("held", ["", "2", "04"])
def test_parameters_whose_grad_is_none_fire_after_every_held_one(held: str) -> None:
    fused = _parameter_events(_events(False, held))
    split = _parameter_events(_events(True, held))
    none = "".join(layer for layer in "024" if layer not in held)
    held_part, none_part = split[: len(split) - 4 * len(none)], split[len(split) - 4 * len(none) :]
    assert held_part == _parameter_events(fused, held)  # as soon as complete: the fused order
    assert sorted(none_part) == sorted(_parameter_events(fused, none))  # W's last pass, its order
