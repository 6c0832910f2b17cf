"""Collecting a stage's outputs and their gradients: the roots B (and the fused backward) start from.

The outputs may be tensors, ``GradientEdge`` objects, or tuples/lists/dicts of them
(as torch's ``stage_backward`` accepts); their gradients come nested the same
way, or as None for a loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from gradsafe.pipelining._handoff import (
    GradientEdgeRootError,
    GradientTypeError,
    SplitBackwardError,
    detached_by_split,
)
from gradsafe.pipelining._torch import input_meta

__all__ = ["Root", "collect_roots", "tensor_list"]


# Values that carry no gradient wherever they appear in a stage's outputs.
_INERT = (type(None), bool, int, float, complex, str, bytes)


class Root(
    NamedTuple
):  # immutable, and made faster than a frozen dataclass (once per output per B)
    """One stage output B starts from: its gradient edge, output gradient, and tensor (if any)."""

    edge: GradientEdge
    grad: torch.Tensor
    tensor: torch.Tensor | None


def collect_roots(output: Any, grad: Any) -> list[Root]:
    """Every tensor / GradientEdge in ``output`` with its gradient in ``grad`` (None: a loss).

    Roots whose missing gradient cannot be implied are refused together, once
    every root is seen: as a :class:`GradientEdgeRootError` (an
    ``AssertionError``, as torch's B raises for a ``GradientEdge`` root without
    output gradients) if any root without a gradient is a ``GradientEdge``,
    whatever its position among the outputs.
    """
    collector = _Collector(implied=grad is None)
    collector.visit(output, grad, "")
    implied = collector.implied_roots
    refused = [i for i in implied if i.refused]
    if refused:
        paths = ", ".join(i.path for i in refused)
        message = (
            f"stage output(s) {paths} require grad but their output gradient is None, and a "
            "gradient can only be implied for a single-element output (a loss). Pass their "
            "gradients, or zero tensors where they get none."
        )
        if any(i.edge for i in implied):
            # torch's words first (2.15's B; its own tests match them).
            raise GradientEdgeRootError(
                "A GradientEdge root requires output gradients from the next stage: " + message
            )
        raise SplitBackwardError(message)
    return collector.roots


class _Implied(NamedTuple):
    """A root whose output gradient is None: implied (ones), or refused (more than one element)."""

    path: str
    edge: bool
    refused: bool


class _Collector:
    """One :func:`collect_roots` call: the roots paired so far, and those whose gradient is None.

    :meth:`visit` holds the pairing rule, one method per kind of output.
    """

    __slots__ = ("implied", "implied_roots", "roots")

    def __init__(self, *, implied: bool) -> None:
        #: A loss (output_grads=None): a None gradient for a tuple/list/dict is implied too.
        self.implied = implied
        self.roots: list[Root] = []
        self.implied_roots: list[_Implied] = []

    def visit(self, output: Any, grad: Any, path: str) -> None:
        """Pair every tensor / GradientEdge in ``output`` with its gradient in ``grad`` (same nesting).

        A None gradient for a tuple/list/dict means no gradient flows there (as in
        torch's ``stage_backward``), unless ``implied`` (a loss: output_grads=None).
        """
        if isinstance(output, torch.Tensor):
            self._tensor(output, grad, path)
        elif isinstance(output, GradientEdge):
            self._edge(output, grad, path)
        elif isinstance(output, (tuple, list, dict)) and grad is None and not self.implied:
            return
        elif isinstance(output, (tuple, list)):
            self._sequence(output, grad, path)
        elif isinstance(output, dict):
            self._dict(output, grad, path)
        elif not isinstance(output, _INERT):
            raise SplitBackwardError(
                f"stage output {path} is a {type(output).__name__}: B takes Tensors, GradientEdges, "
                "and tuples/lists/dicts of them (None and Python scalars are ignored)."
            )

    def _tensor(self, output: torch.Tensor, grad: Any, path: str) -> None:
        if grad is not None and not isinstance(grad, torch.Tensor):
            raise GradientTypeError(
                f"the output gradient for stage output {path} is a {type(grad).__name__}; "
                "expected a Tensor or None."
            )
        if not output.requires_grad:
            if detached_by_split(output):
                raise SplitBackwardError(
                    f"stage output {path} was detached by an earlier split backward: B already "
                    "ran for this microbatch. Redo the forward for another backward."
                )
            return  # an output without a graph carries no gradient
        if grad is None:
            grad = self._implied_grad(output.shape, path, output.dtype, output.device, False)
            if grad is None:
                return
        elif grad.shape != output.shape:
            raise SplitBackwardError(
                f"stage output {path} has shape {tuple(output.shape)} but its output gradient "
                f"has shape {tuple(grad.shape)}."
            )
        self.roots.append(Root(get_gradient_edge(output), grad, output))

    def _edge(self, output: GradientEdge, grad: Any, path: str) -> None:
        if grad is not None and not isinstance(grad, torch.Tensor):
            raise GradientTypeError(
                f"the output gradient for GradientEdge {path} is a {type(grad).__name__}; "
                "expected a Tensor or None."
            )
        shape, dtype, device = input_meta(output.node, output.output_nr)
        if grad is None:
            grad = self._implied_grad(shape, path, dtype, device, True)
            if grad is None:
                return
        elif grad.shape != shape:
            raise SplitBackwardError(
                f"GradientEdge {path} expects a gradient of shape {tuple(shape)}, got "
                f"{tuple(grad.shape)}."
            )
        self.roots.append(Root(output, grad, None))

    def _sequence(self, output: tuple[Any, ...] | list[Any], grad: Any, path: str) -> None:
        if grad is not None and (not isinstance(grad, (tuple, list)) or len(grad) != len(output)):
            raise SplitBackwardError(
                f"stage output {path} is a {type(output).__name__} of {len(output)} but its output "
                f"gradient is {_shape_of(grad)}: pass one gradient (or None) per output, nested "
                "the same way, or output_grads=None for a loss."
            )
        for index, item in enumerate(output):
            self.visit(item, None if grad is None else grad[index], f"{path}[{index}]")

    def _dict(self, output: dict[Any, Any], grad: Any, path: str) -> None:
        if grad is not None and (not isinstance(grad, dict) or set(grad) != set(output)):
            raise SplitBackwardError(
                f"stage output {path} is a dict with keys {sorted(map(str, output))} but its output "
                f"gradient is {_shape_of(grad)}: pass a dict with the same keys."
            )
        for key, item in output.items():
            self.visit(item, None if grad is None else grad[key], f"{path}[{key!r}]")

    def _implied_grad(
        self, shape: torch.Size, path: str, dtype: torch.dtype, device: torch.device, edge: bool
    ) -> torch.Tensor | None:
        """Ones for a single-element root (a loss), else None; either way noted in ``implied_roots``."""
        refused = math.prod(shape) != 1
        self.implied_roots.append(_Implied(path, edge, refused))
        return None if refused else torch.ones(shape, dtype=dtype, device=device)


def _shape_of(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def tensor_list(values: Iterable[Any], what: str) -> list[torch.Tensor]:
    items = list(values)
    for index, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise SplitBackwardError(
                f"{what}[{index}] is a {type(item).__name__}; expected the stage's parameters "
                "(tensors), e.g. submod.parameters()."
            )
    return items
