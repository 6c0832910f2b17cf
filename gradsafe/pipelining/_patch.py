"""The ``pipelining`` patch: every slot it replaces, listed in one place.

``torch.distributed.pipelining.stage`` imports the three functions by name, so
they are replaced both where torch defines them and where the stage looks
them up. ``_IR`` also imports ``stage_backward`` but only compares it by
identity in traced graphs, so it is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge

from gradsafe.patching import AttrTarget, Patch, Skip, Target
from gradsafe.pipelining import _backward

_MODULES = ("torch.distributed.pipelining._backward", "torch.distributed.pipelining.stage")


def _missing_autograd_feature() -> str | None:
    """The autograd feature gradsafe's W needs and the installed torch lacks, if any."""
    x = torch.ones(2, requires_grad=True)
    w = torch.ones(2, requires_grad=True)
    node = (x * w).grad_fn
    assert node is not None
    if not hasattr(node, "_input_metadata"):
        return "autograd nodes have no _input_metadata"
    try:
        node(torch.ones(2))  # type: ignore[operator]  # W calls built-in nodes directly
    except TypeError as exc:
        return f"built-in autograd nodes cannot be called directly ({exc})"
    try:
        torch.autograd.backward([GradientEdge(node, 0)], [torch.ones(2)], inputs=[w])
    except (TypeError, RuntimeError) as exc:
        return f"torch.autograd.backward does not take GradientEdge roots with inputs= ({exc})"
    return None


def _plan() -> Sequence[Target] | Skip:
    missing = _missing_autograd_feature()
    if missing is not None:
        return Skip(missing)
    return [
        AttrTarget(_MODULES[0], "stage_backward_input", _backward.stage_backward_input),
        AttrTarget(_MODULES[0], "stage_backward_weight", _backward.stage_backward_weight),
        AttrTarget(_MODULES[0], "stage_backward", _backward.stage_backward),
        AttrTarget(_MODULES[1], "stage_backward_input", _backward.stage_backward_input),
        AttrTarget(_MODULES[1], "stage_backward_weight", _backward.stage_backward_weight),
        AttrTarget(_MODULES[1], "stage_backward", _backward.stage_backward),
    ]


PATCH = Patch(
    name="pipelining",
    summary="split backward (B/W) for zero-bubble schedules that equals a fused backward, "
    "with weight grads through AccumulateGrad",
    plan=_plan,
)
