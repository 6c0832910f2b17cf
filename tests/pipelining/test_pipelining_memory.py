"""Memory conditions: gradsafe's B and W never hold more live storage than torch's split.

Counted with :class:`gradsafe.testing.LiveStorage` (bytes of storages created from
the forward on and still alive, read after every operator), never timed. One last
stage (Linear + tanh layers, MSE loss), driven as torch's stage drives it: B per
microbatch (the output detached after B), W per microbatch, in a zero-bubble order
(every B, then every W) and a 1F1B-like one (B and W per microbatch). Compared at
every point: the peak during each B and W, and what is alive after it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import _backward as torch_split

from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import LiveStorage

# gradsafe's helper nodes allocate a few scalars (anchors): bytes, not gradients.
_SLACK = 4096

# (layers, dim, microbatch): weights dominate the first, activations the second.
_STAGES = {"weight-dominated": (4, 256, 4), "activation-dominated": (4, 32, 512)}


def _points(
    impl: str, stage: str, microbatches: int, grads_held: bool, order: str
) -> dict[str, int]:
    layers, dim, batch = _STAGES[stage]
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())))
    params = list(model.parameters())
    xs = [torch.randn(batch, dim, requires_grad=True) for _ in range(microbatches)]
    ys = [torch.randn(batch, dim) for _ in range(microbatches)]
    if grads_held:  # an earlier step's (or microbatch's) gradients
        for p in params:
            p.grad = torch.randn_like(p)
    b, w = (
        (stage_backward_input, stage_backward_weight)
        if impl == "gradsafe"
        else (torch_split.stage_backward_input, torch_split.stage_backward_weight)
    )
    existing = [*params, *xs, *ys, *(p.grad for p in params if p.grad is not None)]
    if order == "every B, then every W":
        steps = [("B", i) for i in range(microbatches)] + [("W", i) for i in range(microbatches)]
    else:
        steps = [(kind, i) for i in range(microbatches) for kind in "BW"]
    points: dict[str, int] = {}
    with LiveStorage(existing) as live:
        losses, outs = [], []
        for x, y in zip(xs, ys):
            out = model(x)
            losses.append((out - y).pow(2).mean())
            outs.append(out)
        live.mark()
        handoffs: list[object] = [None] * microbatches
        for kind, i in steps:
            if kind == "B":
                _, handoffs[i] = b([losses[i]], None, [xs[i]], params)
                outs[i].detach_()  # torch's stage does, on the last stage, after B
            else:
                w(params, handoffs[i])
                handoffs[i] = None  # the schedule drops its backward_state entry
            points[f"peak during {kind}{i}"] = live.peak_since_mark
            points[f"after {kind}{i}"] = live.mark()
    return points


@pytest.mark.parametrize("order", ["every B, then every W", "B and W per microbatch"])
@pytest.mark.parametrize("grads_held", [False, True], ids=["grad None", "grad held"])
@pytest.mark.parametrize("microbatches", [1, 2, 8])
@pytest.mark.parametrize("stage", sorted(_STAGES))
def test_split_holds_no_more_than_torchs_split_at_any_point(
    stage: str, microbatches: int, grads_held: bool, order: str
) -> None:
    torch_points = _points("torch", stage, microbatches, grads_held, order)
    ours = _points("gradsafe", stage, microbatches, grads_held, order)
    over = {
        name: (ours[name], theirs)
        for name, theirs in torch_points.items()
        if ours[name] > theirs + _SLACK
    }
    assert not over, f"bytes (gradsafe, torch's split) where gradsafe holds more: {over}"


def test_w_with_gradients_held_adds_one_layer_at_a_time() -> None:
    """W's transient on a weight-dominated stage with ``.grad`` held is one layer's gradient
    (plus what that layer's call produces), not the stage's whole set of weight gradients."""
    layers, dim, _ = _STAGES["weight-dominated"]
    points = _points("gradsafe", "weight-dominated", 1, True, "B and W per microbatch")
    one_layer = (dim * dim + dim) * 4
    transient = points["peak during W0"] - points["after B0"]
    assert transient <= 2 * one_layer + _SLACK, (transient, one_layer)
