"""What gradsafe assumes about how the installed torch builds graphed callables, probed here only.

``torch.cuda.make_graphed_callables`` builds, per callable, a closure
``functionalized`` over an ``autograd.Function`` subclass named ``Graphed``
whose ``backward`` replays the backward graph and returns ``.detach()`` views
of the static gradient buffers. For an ``nn.Module`` the module's ``forward``
is replaced by a closure over ``functionalized`` (which falls back to the eager
forward when the training flag changed). gradsafe swaps the ``Graphed`` cell of
``functionalized`` for a subclass whose ``backward`` hands out owned tensors;
nothing else of upstream's callable changes.

How torch flattens a callable's arguments and outputs (``torch.utils._pytree``)
and which module hooks it refuses are read here too, for the split stages, and
a pipeline schedule's action from its string form (the schedules' ``_Action``),
for :meth:`~gradsafe.cuda_graphs.CaptureOrder.from_actions`.

If the installed torch builds its callables differently, :func:`find_graphed_site`
raises :class:`UnsupportedTorchError` naming the torch version, so gradsafe never
returns callables it could not make safe. What gradsafe reads from autograd
while a backward runs is in :mod:`~gradsafe.cuda_graphs._autograd`.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

import torch
from torch.utils._pytree import (
    arg_tree_leaves,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

from gradsafe._torch_support import SUPPORTED_TORCH

__all__ = [
    "GraphedSite",
    "UnsupportedTorchError",
    "arg_tree_leaves",
    "find_graphed_site",
    "graphed_inputs",
    "has_module_hooks",
    "schedule_action",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

_CLASS_NAME = "Graphed"


class UnsupportedTorchError(RuntimeError):
    """The installed torch's make_graphed_callables has a shape gradsafe does not recognise."""


def _unsupported(what: str) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"gradsafe.cuda_graphs cannot make torch {torch.__version__}'s make_graphed_callables "
        f"safe: {what}. gradsafe recognises the structures of torch {SUPPORTED_TORCH}. Refusing to return "
        "callables whose backward may hand CUDA-graph static buffers to autograd; pin a supported "
        "torch, report this at gradsafe's issue tracker, or pass ownership='never' to accept "
        "upstream's aliasing knowingly."
    )


@dataclasses.dataclass(frozen=True)
class GraphedSite:
    """Where one graphed callable keeps its autograd Function: the closure cell of ``functionalized``.

    ``leading`` counts the non-tensor arguments ``Graphed.forward`` takes before
    the tensors (torch 2.15 passes its ``(fwd_graph, bwd_graph)`` tuple first);
    its backward returns a None for each of them before the tensors' gradients.
    ``static_inputs`` are the tensors the captured graphs read as inputs (the
    sample arguments, then the module's parameters): the forward copies an
    argument into its buffer unless it is that very tensor, so a parameter, or
    a sample tensor passed again, is read in place by the backward graph.
    """

    cell: types.CellType
    graphed_cls: type[torch.autograd.Function]
    leading: int
    static_inputs: tuple[torch.Tensor, ...]

    def install(self, replacement: type[torch.autograd.Function]) -> None:
        self.cell.cell_contents = replacement


def _graphed_cell(fn: object) -> types.CellType | None:
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or closure is None or _CLASS_NAME not in code.co_freevars:
        return None
    return closure[code.co_freevars.index(_CLASS_NAME)]


def _find_cell(returned: object) -> types.CellType:
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
                return candidate
    if cell is None:
        raise _unsupported(f"no closure over a {_CLASS_NAME!r} autograd.Function in {entry!r}")
    return cell


def _leading_arguments(graphed_cls: type[torch.autograd.Function]) -> int:
    """How many positional arguments ``forward`` takes between ``ctx`` and ``*inputs``."""
    params = list(inspect.signature(graphed_cls.forward).parameters.values())
    kinds = [p.kind for p in params]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if (
        len(params) < 2
        or kinds[-1] is not inspect.Parameter.VAR_POSITIONAL
        or any(k not in positional for k in kinds[:-1])
    ):
        raise _unsupported(
            f"{_CLASS_NAME}.forward has signature {inspect.signature(graphed_cls.forward)}, "
            "expected (ctx, [leading non-tensor arguments,] *inputs)"
        )
    return len(params) - 2


class _NoReplay:
    """Stands in for the backward CUDA graph during the dry run: replaying does nothing."""

    def replay(self) -> None:
        pass


def _static_inputs(
    graphed_cls: type[torch.autograd.Function], num_inputs: int
) -> tuple[torch.Tensor, ...]:
    """The ``static_input_surface`` ``Graphed.forward`` copies arguments into (one tensor per input)."""
    forward = inspect.unwrap(graphed_cls.forward)
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    surface = cells.get("static_input_surface")
    value = None if surface is None else surface.cell_contents
    if (
        not isinstance(value, (tuple, list))
        or len(value) != num_inputs
        or not all(isinstance(t, torch.Tensor) for t in value)
    ):
        raise _unsupported(
            f"{_CLASS_NAME}.forward does not close over a static_input_surface of {num_inputs} tensors"
        )
    return tuple(value)


def _dry_backward(graphed_cls: type[torch.autograd.Function]) -> object:
    """Run upstream's graphed backward without replaying its graph, and return what it returns.

    The backward copies incoming gradients into its static gradient buffers,
    replays the backward graph and returns views of its static input-gradient
    buffers. Handing it those very buffers (nothing to copy) and a graph that
    does not replay makes the call free of side effects, so the shape of its
    return can be checked before any training step.
    """
    backward = inspect.unwrap(graphed_cls.backward)
    code, closure = backward.__code__, backward.__closure__ or ()
    cells = dict(zip(code.co_freevars, closure))
    if "static_grad_outputs" not in cells:
        raise _unsupported(f"{_CLASS_NAME}.backward does not close over static_grad_outputs")
    grads = cells["static_grad_outputs"].cell_contents
    if "bwd_graph" in cells:  # torch <= 2.14 closes over the graph; 2.15 reads ctx.bwd_graph
        cells = {**cells, "bwd_graph": types.CellType(_NoReplay())}
    dry = types.FunctionType(
        code,
        backward.__globals__,
        backward.__name__,
        backward.__defaults__,
        tuple(cells[name] for name in code.co_freevars),
    )
    ctx = types.SimpleNamespace(bwd_graph=_NoReplay())
    try:
        with torch.no_grad():
            return dry(ctx, *grads)
    except Exception as exc:
        raise _unsupported(
            f"a dry run of {_CLASS_NAME}.backward failed ({type(exc).__name__}: {exc})"
        ) from exc


def graphed_inputs(callable_: object, sample_args: tuple[object, ...]) -> int:
    """How many tensors upstream's graphed Function takes: flattened sample args, then module parameters."""
    params = len(tuple(callable_.parameters())) if isinstance(callable_, torch.nn.Module) else 0
    return len(arg_tree_leaves(*sample_args)) + params


def has_module_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has its own forward, forward-pre or backward hooks (the ones torch's graphing refuses)."""
    return bool(module._backward_hooks or module._forward_hooks or module._forward_pre_hooks)


def find_graphed_site(returned: object, num_inputs: int) -> GraphedSite:
    """Locate and check the ``Graphed`` Function behind one callable returned by upstream.

    ``num_inputs`` is how many tensors the callable feeds its Function: the
    flattened sample arguments plus, for a module, its parameters. The check
    runs upstream's backward dry (see :func:`_dry_backward`) and requires one
    None per leading non-tensor argument followed by one gradient slot per
    input, so a changed structure fails here, when the callables are made,
    never in a training step's backward.

    Raises:
        UnsupportedTorchError: the callable is not shaped as gradsafe expects.
    """
    cell = _find_cell(returned)
    graphed_cls = cell.cell_contents
    if not (
        isinstance(graphed_cls, type)
        and issubclass(graphed_cls, torch.autograd.Function)
        and "backward" in vars(graphed_cls)
        and "forward" in vars(graphed_cls)
    ):
        raise _unsupported(f"{_CLASS_NAME!r} is {graphed_cls!r}, not an autograd.Function subclass")
    leading = _leading_arguments(graphed_cls)
    returned_grads = _dry_backward(graphed_cls)
    if not isinstance(returned_grads, tuple) or len(returned_grads) != leading + num_inputs:
        got = (
            len(returned_grads)
            if isinstance(returned_grads, tuple)
            else type(returned_grads).__name__
        )
        raise _unsupported(
            f"{_CLASS_NAME}.backward returns {got} gradient slots, expected {leading} for its "
            f"leading non-tensor argument(s) plus {num_inputs} for its tensor inputs"
        )
    if any(g is not None for g in returned_grads[:leading]):
        raise _unsupported(
            f"{_CLASS_NAME}.backward returns gradients for its {leading} leading non-tensor "
            "argument(s) instead of None"
        )
    if any(g is not None and not isinstance(g, torch.Tensor) for g in returned_grads[leading:]):
        raise _unsupported(f"{_CLASS_NAME}.backward returns a non-tensor gradient for an input")
    return GraphedSite(cell, graphed_cls, leading, _static_inputs(graphed_cls, num_inputs))


def schedule_action(text: str) -> Any:
    """torch's pipeline-schedule action for its string form (e.g. ``"0F1"``), None for an empty one."""
    from torch.distributed.pipelining.schedules import _Action

    return _Action.from_str(text)
