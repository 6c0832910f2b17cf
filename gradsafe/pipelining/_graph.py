"""Classify one stage's autograd graph into an input side and a weight-only side.

A node is *input-side* when a stage input's gradient edge is reachable from it,
and *weight-only* when only parameters (no stage input) are reachable from it.
An *intermediate* is an input-side node with at least one next edge into the
weight-only side: B must record the gradient arriving there, and W later turns
it into the gradient that node sends along each of those edges.

The walk is one iterative post-order DFS over the nodes reachable from the
stage outputs (linear in nodes + edges, no recursion limit, no per-parameter
re-traversal). It stops at stage inputs: what lies behind a non-leaf input
belongs to the previous stage.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Collection, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["Intermediate", "StageGraph", "WeightEdge", "analyze", "is_python_node"]

_REACHES_INPUT = 1
_REACHES_PARAM = 2


def is_python_node(node: Node) -> bool:
    """Whether ``node`` is a custom ``autograd.Function``'s node.

    Its Python object does not own the C++ node, and calling it directly skips
    what the engine does around ``backward`` (materializing grads, checking
    counts), so W drives it through the engine instead.
    """
    from torch._C import _FunctionBase

    return isinstance(node, _FunctionBase)


@dataclasses.dataclass(frozen=True)
class WeightEdge:
    """Next edge ``output_index`` of an intermediate, into the weight-only side."""

    output_index: int
    node: Node
    input_nr: int


@dataclasses.dataclass(frozen=True)
class Intermediate:
    """An input-side node with next edges into the weight-only side."""

    node: Node
    weight_edges: tuple[WeightEdge, ...]
    # Every other valid next node: the ones W must keep gradient away from.
    other_children: tuple[Node, ...]


@dataclasses.dataclass(frozen=True)
class StageGraph:
    """The result of :func:`analyze`."""

    intermediates: tuple[Intermediate, ...]
    # Positions (in the ``outputs`` given to analyze) of outputs whose gradient
    # edge is weight-only: their gradient goes to W unchanged, B never sees it.
    weight_only_outputs: tuple[int, ...]
    # Positions of outputs from which some stage input is reachable (B's roots).
    input_side_outputs: tuple[int, ...]
    # Parameters whose AccumulateGrad node is reachable from the outputs, by node.
    reached_params: dict[Node, torch.Tensor]
    num_nodes: int


def analyze(
    outputs: Sequence[GradientEdge],
    input_nodes: Collection[Node],
    params: Collection[torch.Tensor],
) -> StageGraph:
    """Classify the graph behind ``outputs``; see the module docstring."""
    # The walk allocates a few tuples per node but no garbage cycles; pausing
    # the cyclic collector stops it from re-traversing the (graph-sized) heap
    # mid-walk, which made the walk's time erratic and superlinear.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _analyze(outputs, set(input_nodes), {id(p): p for p in params})
    finally:
        if collecting:
            gc.enable()


def _analyze(
    outputs: Sequence[GradientEdge], inputs: set[Node], params: dict[int, torch.Tensor]
) -> StageGraph:
    flags: dict[Node, int] = {}
    reached: dict[Node, torch.Tensor] = {}
    children: dict[Node, tuple[tuple[Node | None, int], ...]] = {}

    for edge in outputs:
        if edge.node in flags:
            continue
        stack = [edge.node]
        while stack:
            node = stack[-1]
            if node in flags:
                stack.pop()
                continue
            kids = children.get(node)
            if kids is None:
                if node in inputs:
                    # A stage input is a boundary: never walk into the previous stage.
                    flags[node] = _REACHES_INPUT
                    children[node] = ()
                    stack.pop()
                    continue
                kids = children[node] = tuple(node.next_functions)
                if not kids:
                    # A parameter is found by its AccumulateGrad node's variable, so
                    # parameters outside the graph never get an accumulator made.
                    param = params.get(id(getattr(node, "variable", None)))
                    if param is not None:
                        reached[node] = param
                pending = [k for k, _ in kids if k is not None and k not in flags]
                if pending:
                    stack.extend(pending)
                    continue
            state = _REACHES_PARAM if node in reached else 0
            for kid, _ in kids:
                if kid is not None:
                    state |= flags[kid]
            flags[node] = state
            stack.pop()

    intermediates = []
    for node, kids in children.items():
        if not flags[node] & _REACHES_INPUT:
            continue
        weight_edges = []
        others = []
        for index, (kid, input_nr) in enumerate(kids):
            if kid is None:
                continue
            if flags[kid] == _REACHES_PARAM:
                weight_edges.append(WeightEdge(index, kid, input_nr))
            else:
                others.append(kid)
        if weight_edges:
            intermediates.append(Intermediate(node, tuple(weight_edges), tuple(others)))

    weight_only = tuple(i for i, e in enumerate(outputs) if flags[e.node] == _REACHES_PARAM)
    input_side = tuple(i for i, e in enumerate(outputs) if flags[e.node] & _REACHES_INPUT)
    return StageGraph(
        intermediates=tuple(intermediates),
        weight_only_outputs=weight_only,
        input_side_outputs=input_side,
        reached_params=reached,
        num_nodes=len(flags),
    )
