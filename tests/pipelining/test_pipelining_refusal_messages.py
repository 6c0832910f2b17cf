"""Refusals a schedule user meets, each naming its cause and what to do, before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import SplitBackwardError, stage_backward_input

pytestmark = pytest.mark.usefixtures("fp64")


def test_parameter_used_only_by_the_loss_fn_names_the_loss_and_the_fix() -> None:
    """A last stage's B starts from ``loss_fn(output, target)``; a parameter of the loss
    (a learned temperature) is none of ``submod.parameters()``, and the schedule user cannot
    pass it: the message names the loss function and how to restructure."""
    torch.manual_seed(0)
    submod = nn.Linear(4, 4)
    temperature = nn.Parameter(torch.tensor(2.0))
    x = torch.randn(3, 4, requires_grad=True)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out / temperature, target)

    loss = loss_fn(submod(x), torch.tensor([0, 1, 2]))
    with pytest.raises(SplitBackwardError, match="loss_fn") as info:
        stage_backward_input(loss, None, [x], submod.parameters())
    message = str(info.value)
    assert "last stage's module" in message and "detached" in message
    assert "pass every parameter" not in message.lower()
    assert x.grad is None and temperature.grad is None and submod.weight.grad is None


@pytest.mark.parametrize("side", ["input side", "weight side"])
def test_reentrant_checkpoint_anywhere_in_the_stage_is_refused_naming_use_reentrant_false(
    side: str,
) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    if side == "input side":
        out = checkpoint(lambda a: torch.tanh(lin(a)), x, use_reentrant=True)
    else:
        w = checkpoint(lambda a: torch.sin(a) * 2, lin.weight, use_reentrant=True)
        out = torch.tanh(x @ w)
    with pytest.raises(SplitBackwardError, match="use_reentrant=False") as info:
        stage_backward_input([out], [torch.ones(3, 4)], [x], lin.parameters())
    assert "No gradient has changed" in str(info.value)
    assert x.grad is None and all(p.grad is None for p in lin.parameters())


def test_reentrant_checkpoint_in_the_previous_stage_is_not_this_stages_concern() -> None:
    """A stage input produced by a reentrant region upstream: B captures there and never runs it."""
    torch.manual_seed(0)
    upstream, lin = nn.Linear(4, 4), nn.Linear(4, 4)
    x = checkpoint(
        lambda a: torch.tanh(upstream(a)), torch.randn(3, 4, requires_grad=True), use_reentrant=True
    )
    g = torch.randn(3, 4)
    want = torch.autograd.grad(torch.tanh(lin(x)), [x], g, retain_graph=True)[0]
    (dx,), _ = stage_backward_input([torch.tanh(lin(x))], [g], [x], lin.parameters())
    torch.testing.assert_close(dx, want, rtol=0, atol=1e-12)
