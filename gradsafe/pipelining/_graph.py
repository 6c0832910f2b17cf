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
from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, Node

from gradsafe._shared.gc_pause import collector_paused
from gradsafe.pipelining._torch import leaf_variable

__all__ = ["Intermediate", "StageGraph", "WeightEdge", "analyze"]

_REACHES_INPUT = 1
_REACHES_PARAM = 2

# The walk makes one Intermediate per intermediate: not frozen (a frozen
# dataclass's __init__ costs ~4x, which dominated the walk on graphs of many
# small custom nodes), compared by identity (each is made once). Its
# WeightEdges go to W as they are.


class WeightEdge(NamedTuple):
    """Next edge ``output_index`` of an intermediate: its output feeds ``node``'s input ``input_nr``,
    on the weight-only side."""

    output_index: int
    node: Node
    input_nr: int


@dataclasses.dataclass(eq=False, slots=True)
class Intermediate:
    """An input-side node with next edges into the weight-only side."""

    node: Node
    weight_edges: tuple[WeightEdge, ...]


@dataclasses.dataclass(frozen=True)
class StageGraph:
    """The result of :func:`analyze`."""

    intermediates: tuple[Intermediate, ...]
    # Weight-only nodes other than gradient accumulators, parents before children.
    weight_nodes: tuple[Node, ...]
    # Every gradient accumulator on the weight-only side, with the leaf it writes to.
    leaves: dict[Node, torch.Tensor]
    # Positions (in the ``outputs`` given to analyze) of outputs whose gradient
    # edge is weight-only: their gradient goes to W unchanged, B never sees it.
    weight_only_outputs: tuple[int, ...]
    # Positions of outputs from which some stage input is reachable (B's roots).
    input_side_outputs: tuple[int, ...]
    # Positions of outputs whose node another node in the graph consumes (an
    # output also used inside the stage): a node W runs may have saved it.
    consumed_outputs: tuple[int, ...]
    # Nodes from which a stage input is reachable (B runs them), the inputs' own nodes excluded.
    input_side: tuple[Node, ...]
    # Every node visited, stage inputs' own nodes included.
    nodes: tuple[Node, ...]
    num_nodes: int


def analyze(outputs: Sequence[GradientEdge], input_nodes: Collection[Node]) -> StageGraph:
    """Classify the graph behind ``outputs``; see the module docstring."""
    with collector_paused():
        return _analyze(outputs, set(input_nodes))


def _analyze(outputs: Sequence[GradientEdge], inputs: set[Node]) -> StageGraph:
    walked = _walk(outputs, inputs)
    flags, children = walked.flags, walked.children
    walked.intermediates.reverse()
    walked.weight_nodes.reverse()
    consumed: set[Node] = set()
    if len(outputs) > 1:  # with one output, a node consuming it would make a cycle
        consumed = {kid for kids in children.values() for kid, _ in kids if kid is not None}
    return StageGraph(
        intermediates=tuple(walked.intermediates),
        weight_nodes=tuple(walked.weight_nodes),
        leaves=walked.leaves,
        weight_only_outputs=tuple(
            i for i, e in enumerate(outputs) if flags[e.node] == _REACHES_PARAM
        ),
        input_side_outputs=tuple(
            i for i, e in enumerate(outputs) if flags[e.node] & _REACHES_INPUT
        ),
        consumed_outputs=tuple(i for i, e in enumerate(outputs) if e.node in consumed),
        input_side=tuple(walked.input_side),
        nodes=tuple(flags),
        num_nodes=len(flags),
    )


class _Walked(NamedTuple):
    """What :func:`_walk` leaves: per node its flags and next edges, and what it classified."""

    flags: dict[Node, int]
    children: dict[Node, tuple[tuple[Node | None, int], ...]]
    leaves: dict[Node, torch.Tensor]
    # Both filled as nodes finish (children first).
    intermediates: list[Intermediate]
    weight_nodes: list[Node]
    input_side: list[Node]


def _walk(outputs: Sequence[GradientEdge], inputs: set[Node]) -> _Walked:
    """One iterative post-order walk that classifies each node as it finishes.

    One function, not one per step: the walk's state would be passed between
    functions on every node of every B.
    """
    flags: dict[Node, int] = {}  # set when a node is finished: children first
    leaves: dict[Node, torch.Tensor] = {}
    children: dict[Node, tuple[tuple[Node | None, int], ...]] = {}
    intermediates: list[Intermediate] = []
    weight_nodes: list[Node] = []
    input_side: list[Node] = []

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
                    stack.pop()
                    continue
                kids = children[node] = node.next_functions
                pushed = False
                for kid, _ in kids:
                    if kid is not None and kid not in flags:
                        stack.append(kid)
                        pushed = True
                if pushed:
                    continue
                if not kids:
                    variable = leaf_variable(node)
                    if variable is not None:
                        leaves[node] = variable
                        flags[node] = _REACHES_PARAM
                        stack.pop()
                        continue
            state = 0
            for kid, _ in kids:
                if kid is not None:
                    state |= flags[kid]
            flags[node] = state
            stack.pop()
            if state == _REACHES_PARAM:
                weight_nodes.append(node)
                continue
            if state & _REACHES_INPUT:
                input_side.append(node)
            if state == _REACHES_INPUT | _REACHES_PARAM:
                weight_edges = []
                index = 0
                for kid, input_nr in kids:  # a loop, not a comprehension: no call per node
                    if kid is not None and flags[kid] == _REACHES_PARAM:
                        weight_edges.append(WeightEdge(index, kid, input_nr))
                    index += 1
                if weight_edges:
                    intermediates.append(Intermediate(node, tuple(weight_edges)))

    return _Walked(flags, children, leaves, intermediates, weight_nodes, input_side)
