"""TransformerEngine's graphed callables: gradsafe's delayed-wgrad mark must not leave a real gradient aliased.

TransformerEngine's ``make_graphed_callables`` (``transformer_engine/pytorch/graph.py``,
from commit a6c70f4dc, "Fix CUDA graph parameter grad lifetime", on main and
release_v2.19; no tag up to v2.18 has it) clones each module parameter's
gradient slot before returning it from the graphed backward, except where the
parameter has ``skip_backward_post_hook`` (``_returned_param_grad_clone_slots``,
read once per callable when its backward graph is captured): TE's own delayed
weights return a placeholder there. gradsafe sets that same attribute
(:func:`~gradsafe.wgrad.markers.mark_delayed_wgrad`, Megatron-core's DDP reads
it), but a weight gradsafe marks may also have an undelayed use inside the
graphed module whose real gradient fills the slot; left a static-buffer view,
it becomes ``.grad`` and the next replay rewrites it (H3).

So the ``cuda_graphs`` patch wraps TE's ``_make_graphed_callables`` (the module
global its public ``make_graphed_callables`` calls, so callers that imported
the public name early go through it too) and, in each returned callable, turns
on the clone for the slots of parameters gradsafe marked
(:func:`~gradsafe.wgrad.markers.marked_by_gradsafe`). TE's other choices stay
TE's: its own delayed weights, user inputs, and ``clone_param_grads_on_return=False``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any, Final

import torch

from gradsafe.patching import REGISTRY, AttrTarget, Target
from gradsafe.wgrad.markers import marked_by_gradsafe

__all__ = ["UnsupportedTransformerEngineError", "plan"]

_TE_GRAPH: Final = "transformer_engine.pytorch.graph"
_ENTRY: Final = "_make_graphed_callables"
_MARKER: Final = "skip_backward_post_hook"
_CLONE_OPTION: Final = "clone_param_grads_on_return"
_SLOTS: Final = "returned_param_grad_clone_slots"


class UnsupportedTransformerEngineError(RuntimeError):
    """The installed TransformerEngine reads the delayed-wgrad mark in a way gradsafe does not recognise."""


def _unsupported(what: str) -> UnsupportedTransformerEngineError:
    return UnsupportedTransformerEngineError(
        f"gradsafe.cuda_graphs cannot check TransformerEngine's make_graphed_callables: {what}. "
        f"Its graph.py reads {_MARKER}, which gradsafe sets on delayed weights, to decide which "
        "parameter gradients to clone; gradsafe recognises TransformerEngine's graph.py from "
        "commit a6c70f4dc (release 2.19). Refusing to return callables that may hand a marked "
        "weight's real gradient to autograd as a CUDA-graph static buffer; report this at "
        "gradsafe's issue tracker, or graph without gradsafe.patch('cuda_graphs') knowingly."
    )


def _reads_marker(module: types.ModuleType) -> bool:
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return True  # cannot tell: treat it as reading the mark, and check every callable
    return _MARKER in source


def plan() -> list[Target]:
    """The TE slot to wrap: none where TE is absent or its graph.py never reads the mark."""
    if (
        "transformer_engine" not in sys.modules
        and importlib.util.find_spec("transformer_engine") is None
    ):
        return []
    try:
        graph = importlib.import_module(_TE_GRAPH)
    except (ImportError, OSError):
        return []  # TE that cannot be imported cannot graph anything either
    if not _reads_marker(graph):
        return []  # TE up to 2.18: every slot is a view, marked or not; gradsafe changes nothing
    if not callable(getattr(graph, _ENTRY, None)):
        raise _unsupported(f"{_TE_GRAPH} has no {_ENTRY}()")
    return [AttrTarget(_TE_GRAPH, _ENTRY, _make_graphed_callables)]


@dataclasses.dataclass(frozen=True)
class _CloneSlots:
    """One graphed callable's ``returned_param_grad_clone_slots`` cell and what its slots hold."""

    cell: types.CellType
    static_grad_inputs: tuple[Any, ...]
    module_params: tuple[Any, ...]

    def clone_gradsafe_marked(self) -> None:
        start = len(self.static_grad_inputs) - len(self.module_params)
        self.cell.cell_contents = tuple(
            bool(clone)
            or (
                i >= start
                and grad is not None
                and marked_by_gradsafe(self.module_params[i - start])
            )
            for i, (clone, grad) in enumerate(zip(self.cell.cell_contents, self.static_grad_inputs))
        )


def _cells(fn: object) -> dict[str, types.CellType]:
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, closure)) if code is not None else {}


def _contents(cells: dict[str, types.CellType], name: str) -> object:
    try:
        return cells[name].cell_contents
    except (KeyError, ValueError):
        return None


def _functionalized(returned: object) -> object:
    """TE's ``functionalized`` behind one returned callable (a module, its forward, or itself)."""
    entry = returned.forward if isinstance(returned, torch.nn.Module) else returned
    if "Graphed" in _cells(entry):
        return entry
    inner = _contents(_cells(entry), "graphed")
    if "Graphed" in _cells(inner):
        return inner
    raise _unsupported(f"no closure over a 'Graphed' autograd.Function behind {returned!r}")


def _clone_slots(returned: object) -> _CloneSlots:
    functionalized = _functionalized(returned)
    outer = _cells(functionalized)
    graphed_cls = _contents(outer, "Graphed")
    module_params = _contents(outer, "module_params")
    backward = getattr(graphed_cls, "backward", None)
    inner = _cells(inspect.unwrap(backward)) if callable(backward) else {}  # once_differentiable
    slots = _contents(inner, _SLOTS)
    grads = _contents(inner, "static_grad_inputs")
    if not (
        isinstance(slots, tuple)
        and isinstance(grads, tuple)
        and isinstance(module_params, tuple)
        and len(slots) == len(grads) >= len(module_params)
    ):
        raise _unsupported(
            f"Graphed.backward does not close over {_SLOTS} and static_grad_inputs of one length, "
            "covering functionalized's module_params"
        )
    return _CloneSlots(inner[_SLOTS], grads, module_params)


def _make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
    """TE's ``_make_graphed_callables``, then the slots of parameters gradsafe marked cloned."""
    original: Callable[..., Any] = REGISTRY.get_original(_TE_GRAPH, _ENTRY)  # type: ignore[assignment]
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    cloning = bound.arguments.get(_CLONE_OPTION, True)
    graphed = original(*args, **kwargs)
    if not cloning:
        return graphed  # TE's opt-out: every parameter slot is a view, marked or not
    returned = graphed if isinstance(graphed, tuple) else (graphed,)
    # Probe every callable before changing any, so a failure leaves none half-made.
    for site in [_clone_slots(c) for c in returned]:
        site.clone_gradsafe_marked()
    return graphed
