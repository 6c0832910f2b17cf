"""``K``: the weight side B computes, and the checkpoint group B and W share.

A stage's graph has an input side (nodes a stage input's gradient flows
through) and a weight side (nodes only parameters' gradients flow through).
B (``stage_backward_input``) runs the input side; W
(``stage_backward_weight``) runs the weight side, calling again each input-side
intermediate that has weight edges, on the gradient that arrived at it in B.

Some intermediates W cannot call again: a custom Function's node computes all
its gradients in one call, and a checkpointed or offloaded node may unpack its
saved tensors only once per checkpoint group. B runs those whole, and then the
weight side below their weight edges must run in B too, once, with its
complete gradient. That part is ``K``: every weight-side node (accumulators
included) below the weight edges of the intermediates B runs whole, closed
so that nothing outside it sends into it. B's engine runs each node of ``K``
once and captures (does not accumulate) the gradients reaching ``K``'s
accumulators; W adds those kept gradients (:class:`~gradsafe.pipelining._weight_pass.Kept`)
to the leaves' totals and runs no node of ``K`` again.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.graph import Node

from gradsafe.pipelining._graph import Intermediate, StageGraph
from gradsafe.pipelining._handoff import SplitBackwardError
from gradsafe.pipelining._policy import CheckpointedWeights
from gradsafe.pipelining._torch import (
    checkpoint_holders,
    crashes_weight_only,
    current_exec_group,
    exec_group,
    has_hooked_saved,
    has_other_post_hooks,
    recompute_alike_unsupported,
    recomputes_alike,
    runs_whole,
    unpack_twice_unsupported,
)

__all__ = ["entered", "group_for", "weight_parts_in_b"]


def weight_parts_in_b(
    graph: StageGraph, policy: CheckpointedWeights
) -> tuple[set[Intermediate], set[Node], bool, list[Any]]:
    """The intermediates B runs whole, ``K`` (the weight side B computes with them), whether
    the stage has checkpointed (or offloaded) built-in nodes, and the checkpoint holders
    whose saved tensors unpack once in B and once more in W.

    A custom Function's node computes all its gradients in one call (B runs
    it, so W must not again). A built-in intermediate whose saved tensors
    come back through saved-tensor hooks may unpack them once per checkpoint
    group: with :attr:`CheckpointedWeights.IN_W` (the default), one whose
    hooks are all non-reentrant ``torch.utils.checkpoint``'s is called in W
    like any other, its holders told to unpack twice (B's recomputation
    feeds both); otherwise (other hooks, :attr:`CheckpointedWeights.IN_B`)
    B runs it whole; with :attr:`CheckpointedWeights.RECOMPUTE_IN_W`, one
    whose regions recompute alike (no ``context_fn``, RNG state preserved)
    is called in W in a group of W's own, so its region recomputes there,
    and B runs the others whole. ``K`` is every weight-side node (accumulators included)
    below the weight edges of what B runs whole, closed so that nothing
    outside it sends into it: an intermediate with a weight edge into ``K``
    joins them (and what lies below its weight edges joins ``K``), and so
    does a weight-only node with a child in ``K``. B's engine then runs each
    node of ``K`` once, with its complete gradient, and W runs none of them;
    nothing W runs reaches ``K``.
    """
    # A custom Function's own saved tensors never matter here: B runs it whole
    # and nothing unpacks them again.
    in_b = {item for item in graph.intermediates if runs_whole(item.node)}
    checkpointed = {
        item for item in graph.intermediates if item not in in_b and has_hooked_saved(item.node)
    }
    holders = {item: _holders_for_w(item.node, policy) for item in checkpointed}
    in_b |= {item for item, held in holders.items() if held is None}
    # A node whose weight-only call crashes this torch computes both parts in B.
    in_b |= {
        item for item in graph.intermediates if item not in in_b and crashes_weight_only(item.node)
    }
    in_k: set[Node] = set()
    # A checkpointed (or offloaded) weight-only node joins K too: its region
    # then recomputes in B's engine call, in the order a fused backward
    # recomputes regions (dropout with preserve_rng_state=False draws the same
    # masks), never in W after all of B's.
    hooked = [n for n in graph.weight_nodes if has_hooked_saved(n)]
    has_checkpoints = bool(checkpointed or hooked)
    if graph.intermediates and (in_b or hooked):
        _close(graph, in_b, in_k, hooked)
    twice = [h for item, held in holders.items() if item not in in_b and held for h in held]
    return in_b, in_k, has_checkpoints, twice


def _holders_for_w(node: Node, policy: CheckpointedWeights) -> tuple[tuple[Any, Any], ...] | None:
    """The checkpoint holders of a checkpointed intermediate W calls again (None: B runs it whole)."""
    if policy is CheckpointedWeights.IN_B or _has_post_hooks(node):
        # A node post hook sees input and weight gradients together only if B
        # computes both (a split W call would be refused for it).
        return None
    if _falls_back(policy):
        return None
    # None for saved tensors other hooks packed (offloading, a user's own):
    # their unpack cannot be told to run twice, nor their region recomputed.
    holders = checkpoint_holders(node)
    if holders is None or policy is CheckpointedWeights.IN_W:
        return holders
    # RECOMPUTE_IN_W: W unpacks in a group of its own, so the region
    # recomputes there; only where that gives B's tensors again.
    return () if recomputes_alike(node) else None


def _falls_back(policy: CheckpointedWeights) -> bool:
    """Whether ``policy`` runs as ``IN_B`` on this torch: its checkpoint behaviour differs here."""
    probe = (
        unpack_twice_unsupported
        if policy is CheckpointedWeights.IN_W
        else recompute_alike_unsupported
    )
    reason = probe()
    if reason is not None:
        _warn_fallback(policy, reason)
    return reason is not None


@functools.cache
def _warn_fallback(policy: CheckpointedWeights, reason: str) -> None:
    # Once per process and policy: every B of every stage takes the same path.
    warnings.warn(
        f"gradsafe: CheckpointedWeights.{policy.name} falls back to IN_B on torch "
        f"{torch.__version__}: {reason}. Gradients stay exact (B computes the weight gradients "
        "of checkpointed ops and W delivers them); memory between B and W holds those weight "
        "gradients instead. `gradsafe doctor` lists the probes; report this with your torch "
        "version.",
        UserWarning,
        stacklevel=2,
    )


def _has_post_hooks(node: Node) -> bool:
    probe = node.register_hook(_no_hook)
    try:
        return has_other_post_hooks(probe)
    finally:
        probe.remove()


def _no_hook(grad_inputs: Any, grad_outputs: Any) -> None:
    return None


def _close(graph: StageGraph, in_b: set[Intermediate], in_k: set[Node], hooked: list[Node]) -> None:
    """Grow ``in_b`` and ``K`` (in place) from ``in_b`` and the ``hooked`` weight-only nodes until
    nothing outside ``K`` sends into it (the closure :func:`weight_parts_in_b` describes)."""
    senders: dict[Node, list[Intermediate]] = {}
    for item in graph.intermediates:
        for e in item.weight_edges:
            senders.setdefault(e.node, []).append(item)
    parents: dict[Node, list[Node]] = {}
    for node in graph.weight_nodes:
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
    items = list(in_b)
    nodes: list[Node] = list(hooked)
    in_k.update(hooked)
    while items or nodes:
        while items:
            for e in items.pop().weight_edges:
                if e.node not in in_k:
                    in_k.add(e.node)
                    nodes.append(e.node)
        while nodes:
            node = nodes.pop()
            for child, _ in node.next_functions:
                if child is not None and child not in in_k:
                    in_k.add(child)
                    nodes.append(child)
            for parent in parents.get(node, ()):
                if parent not in in_k:
                    in_k.add(parent)
                    nodes.append(parent)
            for item in senders.get(node, ()):
                if item not in in_b:
                    in_b.add(item)
                    items.append(item)


def group_for(has_checkpoints: bool) -> Any:
    """A checkpoint group shared by B and W for a stage with checkpointed nodes, else None."""
    if not has_checkpoints:
        return None
    if current_exec_group() is not None:
        raise SplitBackwardError(
            "stage_backward_input ran inside a torch.utils.checkpoint.GraphExecGroup: gradsafe "
            "puts B and W of each microbatch in a group of their own (so a checkpointed region "
            "recomputes once across them), and groups cannot nest. Call B and W outside it."
        )
    group = exec_group()
    if group is None:
        raise SplitBackwardError(
            f"this stage has activation-checkpointed ops and torch {torch.__version__} has no "
            "torch.utils.checkpoint.GraphExecGroup, so W would recompute them a second time "
            "(different dropout with preserve_rng_state=False). Use a torch with it, or "
            "stage_backward (fused). No gradient has changed."
        )
    return group


@contextlib.contextmanager
def entered(group: Any) -> Iterator[None]:
    if group is None:
        yield
    else:
        with group:
            yield
