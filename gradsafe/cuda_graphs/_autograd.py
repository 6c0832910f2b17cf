"""What a graphed backward reads from autograd while it runs: which nodes run, and which gradients are kept.

The rule both graphed backwards (``make_graphed_callables`` and the split
stages) copy by is written once here: :func:`accumulate_grad_keeps`. The base
class of modes that watch the ops a backward dispatches (``TorchDispatchMode``,
from a private torch module) is taken from here too, and a tensor's autograd
version (:func:`version_of`), which tells an in-place change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsafe.wgrad.markers import hook_keeps_no_gradient

__all__ = [
    "LeafFate",
    "TorchDispatchMode",
    "accumulate_grad_keeps",
    "function_class_of",
    "has_tensor_hooks",
    "is_accumulate_grad",
    "is_accumulating_backward",
    "leaf_fate",
    "not_differentiable",
    "version_of",
    "will_execute",
]


_ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def function_class_of(node: object) -> type | None:
    """The ``autograd.Function`` subclass whose backward ``node`` runs, if it is one."""
    return getattr(type(node), "_forward_cls", None)


def has_tensor_hooks(t: torch.Tensor) -> bool:
    """Whether ``t`` has hooks from ``Tensor.register_hook`` that receive, and may keep, its gradient.

    Hooks gradsafe declared as keeping nothing (the wgrad flag watcher) do not count.
    """
    hooks = getattr(t, "_backward_hooks", None) or {}
    return any(not hook_keeps_no_gradient(h) for h in hooks.values())


def is_accumulate_grad(node: object) -> bool:
    """Whether ``node`` is the gradient accumulator of a leaf tensor."""
    return isinstance(node, _ACCUMULATE_GRAD)


def will_execute(node: object) -> bool:
    """Whether the running backward will run ``node`` (called from inside a backward)."""
    return bool(torch._C._will_engine_execute_node(node))  # type: ignore[arg-type]


LeafFate = Literal["accumulated", "captured", "discarded"]


def leaf_fate(accumulator: object) -> LeafFate:
    """What the running backward does with the gradient flowing into a leaf's accumulator.

    ``accumulated``: AccumulateGrad runs (``.backward()``, or ``backward(inputs=)``
    naming the leaf). ``captured``: ``torch.autograd.grad`` returns it to the
    caller. ``discarded``: neither (the leaf is not among the requested inputs).
    The engine refuses to answer for a leaf that autograd.grad captures; that
    refusal is how a capture is recognised.
    """
    try:
        return "accumulated" if will_execute(accumulator) else "discarded"
    except RuntimeError:
        return "captured"


def is_accumulating_backward(nodes: Iterable[object]) -> bool:
    """Whether the running backward is ``Tensor.backward``/``torch.autograd.backward``.

    True only with evidence: some leaf accumulator among ``nodes`` will run.
    ``torch.autograd.grad`` never runs an accumulator (it captures or skips
    leaves), and it is the one entry point that hands a non-leaf's incoming
    gradient back to the caller as is; ``backward(inputs=[h])`` copies into
    ``h.grad``. False means "may be autograd.grad, or no leaf to tell by".
    """
    return any(is_accumulate_grad(n) and leaf_fate(n) == "accumulated" for n in nodes)


def accumulate_grad_keeps(leaf: torch.Tensor) -> bool:
    """Whether the gradient handed to ``leaf``'s AccumulateGrad may outlive the call.

    AccumulateGrad keeps the incoming tensor itself as ``.grad`` when ``.grad``
    is None, and a tensor hook on the leaf receives it (and may keep it);
    otherwise it adds it into ``.grad`` in place and lets it go.
    """
    return leaf.grad is None or has_tensor_hooks(leaf)


def version_of(t: torch.Tensor) -> int:
    """``t``'s autograd version counter (shared by its views), which every in-place change bumps."""
    return t._version


def not_differentiable(grads: tuple[object, ...], message: str) -> tuple[object, ...]:
    """``grads`` with every tensor that has no graph routed through a node that raises ``message`` if differentiated.

    For a backward computed outside autograd under ``create_graph=True``:
    ``once_differentiable`` adds such a node only where the incoming gradients
    require grad; where they do not (a root of ones), its results would be
    constants and a gradient penalty through them silently zero.
    (``torch._C._functions.DelayedError`` is the node ``once_differentiable`` uses.)
    """
    plain = {
        i: g for i, g in enumerate(grads) if isinstance(g, torch.Tensor) and not g.requires_grad
    }
    if not plain:
        return grads
    error = torch._C._functions.DelayedError(message.encode(), len(plain))  # type: ignore[attr-defined]
    wrapped = error(*(g.detach().requires_grad_() for g in plain.values()))
    out = list(grads)
    for i, g in zip(plain, wrapped if isinstance(wrapped, (tuple, list)) else (wrapped,)):
        out[i] = g
    return tuple(out)
