"""H1's variants found by their structure in one stage's graph (the doctor reproduces each one).

Upstream's split groups parameters by the input-side nodes that use them
(their *sites*); the variants that break it are a parameter used at several
sites, one after another (nested shared weight) or with another parameter's
site between two of its own (overlapping groups), and a parameter reaching a
stage output without any input-dependent node (parameter-only output).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch.autograd.graph import GradientEdge, Node

from gradsafe.pipelining.inspection import analyze

__all__ = ["HOOKS_IN_W", "NESTED", "OVERLAPPING", "PARALLEL", "PARAM_ONLY", "find"]

NESTED = "H1 nested shared weight"
OVERLAPPING = "H1 overlapping groups"
PARALLEL = "H1 shared weight (parallel uses)"
PARAM_ONLY = "H1 parameter-only output"
HOOKS_IN_W = "H1 hooks in W"


def find(
    outputs: Sequence[GradientEdge], input_nodes: Sequence[Node], names: Mapping[int, str]
) -> dict[str, set[str]]:
    """Hazard name -> names of the parameters it concerns. ``names``: id(parameter) -> name."""
    graph = analyze(outputs, input_nodes)
    leaf_name = {node: names.get(id(t), "?") for node, t in graph.leaves.items()}
    reach: dict[Node, frozenset[str]] = {}
    for node in reversed(graph.weight_nodes):  # children first
        reach[node] = frozenset().union(
            *(_reached(kid, leaf_name, reach) for kid, _ in node.next_functions)
        )
    found: dict[str, set[str]] = {}
    for i in graph.weight_only_outputs:
        params = _reached(outputs[i].node, leaf_name, reach)
        if params:
            found.setdefault(PARAM_ONLY, set()).update(params)

    sites = [item.node for item in graph.intermediates]
    group = {
        item.node: frozenset().union(
            *(_reached(e.node, leaf_name, reach) for e in item.weight_edges)
        )
        for item in graph.intermediates
    }
    below = _intermediates_below(outputs, set(input_nodes), {n: i for i, n in enumerate(sites)})
    index = {n: i for i, n in enumerate(sites)}
    for param in sorted({p for g in group.values() for p in g}):
        own = [n for n in sites if param in group[n]]
        if len(own) < 2:
            continue
        chained = [(a, b) for a in own for b in own if below[a] >> index[b] & 1]
        if not chained:
            found.setdefault(PARALLEL, set()).add(param)
            continue
        between = any(
            below[a] >> index[q] & 1 and below[q] >> index[b] & 1
            for a, b in chained
            for q in sites
            if param not in group[q]
        )
        found.setdefault(OVERLAPPING if between else NESTED, set()).add(param)
    return found


def _reached(
    node: Node | None, leaf_name: Mapping[Node, str], reach: Mapping[Node, frozenset[str]]
) -> frozenset[str]:
    if node is None:
        return frozenset()
    if node in leaf_name:
        return frozenset((leaf_name[node],))
    return reach.get(node, frozenset())


def _intermediates_below(
    outputs: Sequence[GradientEdge], inputs: set[Node], index: Mapping[Node, int]
) -> dict[Node, int]:
    """For every node: a bitset of the intermediates (by ``index``) reachable below it."""
    below: dict[Node, int] = {}
    for edge in outputs:
        stack = [(edge.node, False)]
        while stack:
            node, done = stack.pop()
            if node in below:
                continue
            kids = (
                [k for k, _ in node.next_functions if k is not None] if node not in inputs else []
            )
            if done:
                bits = 0
                for kid in kids:
                    bits |= below[kid] | (1 << index[kid] if kid in index else 0)
                below[node] = bits
                continue
            stack.append((node, True))
            stack.extend((kid, False) for kid in kids if kid not in below)
    return below
