"""Everything gradsafe assumes about the installed torch's CUDA-graph and autograd internals, probed here only.

``torch.cuda.make_graphed_callables`` builds, per callable, a closure
``functionalized`` over an ``autograd.Function`` subclass named ``Graphed``
whose ``backward`` replays the backward graph and returns ``.detach()`` views
of the static gradient buffers. For an ``nn.Module`` the module's ``forward``
is replaced by a closure over ``functionalized`` (which falls back to the eager
forward when the training flag changed). gradsafe swaps the ``Graphed`` cell of
``functionalized`` for a subclass whose ``backward`` hands out owned tensors;
nothing else of upstream's callable changes.

If the installed torch builds its callables differently, :func:`find_graphed_site`
raises :class:`UnsupportedTorchError` naming the torch version, so gradsafe never
returns callables it could not make safe.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable
from typing import Literal

import torch

__all__ = [
    "GraphedSite",
    "LeafFate",
    "UnsupportedTorchError",
    "find_graphed_site",
    "function_class_of",
    "has_tensor_hooks",
    "is_accumulate_grad",
    "is_accumulating_backward",
    "leaf_fate",
    "will_execute",
]

_CLASS_NAME = "Graphed"


class UnsupportedTorchError(RuntimeError):
    """The installed torch's make_graphed_callables has a shape gradsafe does not recognise."""


def _unsupported(what: str) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"gradsafe.cuda_graphs cannot make torch {torch.__version__}'s make_graphed_callables "
        f"safe: {what}. gradsafe recognises the structure of torch 2.10-2.14. Refusing to return "
        "callables whose backward may hand CUDA-graph static buffers to autograd; pin a supported "
        "torch, report this at gradsafe's issue tracker, or pass ownership='never' to accept "
        "upstream's aliasing knowingly."
    )


@dataclasses.dataclass(frozen=True)
class GraphedSite:
    """Where one graphed callable keeps its autograd Function: the closure cell of ``functionalized``."""

    cell: types.CellType
    graphed_cls: type[torch.autograd.Function]

    def install(self, replacement: type[torch.autograd.Function]) -> None:
        self.cell.cell_contents = replacement


def _graphed_cell(fn: object) -> types.CellType | None:
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or closure is None or _CLASS_NAME not in code.co_freevars:
        return None
    return closure[code.co_freevars.index(_CLASS_NAME)]


def find_graphed_site(returned: object) -> GraphedSite:
    """Locate the ``Graphed`` Function behind one callable returned by upstream.

    Raises:
        UnsupportedTorchError: the callable is not shaped as gradsafe expects.
    """
    entry = returned.forward if isinstance(returned, torch.nn.Module) else returned
    cell = _graphed_cell(entry)
    if cell is None and isinstance(returned, torch.nn.Module):
        # The module's forward is a closure over ``functionalized``.
        for inner in getattr(entry, "__closure__", None) or ():
            try:
                candidate = _graphed_cell(inner.cell_contents)
            except ValueError:  # an empty cell
                continue
            if candidate is not None:
                cell = candidate
                break
    if cell is None:
        raise _unsupported(f"no closure over a {_CLASS_NAME!r} autograd.Function in {entry!r}")
    graphed_cls = cell.cell_contents
    if not (
        isinstance(graphed_cls, type)
        and issubclass(graphed_cls, torch.autograd.Function)
        and "backward" in vars(graphed_cls)
        and "forward" in vars(graphed_cls)
    ):
        raise _unsupported(f"{_CLASS_NAME!r} is {graphed_cls!r}, not an autograd.Function subclass")
    return GraphedSite(cell, graphed_cls)


_ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def function_class_of(node: object) -> type | None:
    """The ``autograd.Function`` subclass whose backward ``node`` runs, if it is one."""
    return getattr(type(node), "_forward_cls", None)


def has_tensor_hooks(t: torch.Tensor) -> bool:
    """Whether ``t`` has hooks from ``Tensor.register_hook`` (which receive, and may keep, its gradient)."""
    return bool(getattr(t, "_backward_hooks", None))


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
