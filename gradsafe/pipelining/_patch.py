"""The ``pipelining`` patch: every slot it replaces, listed in one place (``plan()``).

``torch.distributed.pipelining.stage`` imports the three functions by name, so
they are replaced both where torch defines them and where the stage looks
them up. ``_IR`` also imports ``stage_backward`` but only compares it by
identity in traced graphs, so it is left alone.

Before replacing anything, :func:`plan` checks two things about the installed
torch and turns a mismatch into a skip with the reason: the autograd features
gradsafe's W relies on, and how ``stage.py`` calls the three functions (names
imported, arguments passed), so that a changed call site is reported instead
of silently receiving gradsafe's functions with other arguments.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from gradsafe.patching import AttrTarget, Skip, Target
from gradsafe.pipelining import _backward

__all__ = ["plan"]

_DEFINED_IN = "torch.distributed.pipelining._backward"
_CALLED_FROM = "torch.distributed.pipelining.stage"

_OURS: dict[str, Callable[..., Any]] = {
    "stage_backward_input": _backward.stage_backward_input,
    "stage_backward_weight": _backward.stage_backward_weight,
    "stage_backward": _backward.stage_backward,
}
# The stage must call these (zero-bubble schedules go through them).
_REQUIRED_CALLS = ("stage_backward_input", "stage_backward_weight")


def _missing_autograd_feature() -> str | None:
    """The autograd feature gradsafe's W needs and the installed torch lacks, if any."""
    x = torch.ones(2, device="cpu", requires_grad=True)
    w = torch.ones(2, device="cpu", requires_grad=True)
    node = (x * w).grad_fn
    if node is None:
        return "a product of tensors requiring grad has no grad_fn (grad mode off?)"
    if not hasattr(node, "_input_metadata"):
        return "autograd nodes have no _input_metadata"
    try:
        node(torch.ones(2, device="cpu"))  # type: ignore[operator]  # W calls built-in nodes directly
    except TypeError as exc:
        return f"built-in autograd nodes cannot be called directly ({exc})"
    try:
        torch.autograd.backward([GradientEdge(node, 0)], [torch.ones(2, device="cpu")], inputs=[w])
    except (TypeError, RuntimeError) as exc:
        return f"torch.autograd.backward does not take GradientEdge roots with inputs= ({exc})"
    return None


def _call_site_mismatch(stage: Any, backward: Any) -> str | None:
    """How ``stage.py`` calling the split functions differs from what gradsafe's accept, if it does."""
    for name in _OURS:
        if getattr(stage, name, None) is not getattr(backward, name, None):
            return (
                f"{_CALLED_FROM}.{name} is not {_DEFINED_IN}.{name}: the stage no longer imports "
                "it by name, so replacing it could not take effect where the schedule calls it"
            )
    try:
        tree = ast.parse(inspect.getsource(stage))
    except (OSError, TypeError, SyntaxError) as exc:
        return f"cannot read {_CALLED_FROM}'s source to check how it calls the split functions ({exc})"
    seen: set[str] = set()
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            continue
        name = call.func.id
        if name not in _OURS:
            continue
        seen.add(name)
        where = f"{_CALLED_FROM} line {call.lineno}"
        if any(isinstance(a, ast.Starred) for a in call.args) or any(
            k.arg is None for k in call.keywords
        ):
            return f"{where} calls {name} with *args/**kwargs, which gradsafe cannot check"
        keywords = [k.arg for k in call.keywords if k.arg is not None]
        signature = inspect.signature(_OURS[name])
        try:
            signature.bind(*call.args, **dict.fromkeys(keywords))
        except TypeError as exc:
            return (
                f"{where} calls {name} with {len(call.args)} positional argument(s) and keywords "
                f"{keywords}, which gradsafe's {name}({', '.join(signature.parameters)}) does not "
                f"accept ({exc})"
            )
    missing = [name for name in _REQUIRED_CALLS if name not in seen]
    if missing:
        return f"{_CALLED_FROM} no longer calls {', '.join(missing)}, so the split backward moved"
    return None


def plan() -> Sequence[Target] | Skip:
    import torch.distributed.pipelining._backward as backward
    import torch.distributed.pipelining.stage as stage

    mismatch = _missing_autograd_feature() or _call_site_mismatch(stage, backward)
    if mismatch is not None:
        return Skip(mismatch)
    return [
        AttrTarget(module, name, replacement)
        for module in (_DEFINED_IN, _CALLED_FROM)
        for name, replacement in _OURS.items()
    ]
