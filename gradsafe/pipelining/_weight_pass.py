"""W: turn what B recorded into weight gradients, delivered through AccumulateGrad.

Two steps, both without touching the input side of the graph:

1. For every intermediate, compute the gradient its backward sends along each
   of its weight-side edges, from exactly the gradient that arrived at it in B.
   Built-in (C++) nodes are called directly, which runs no hooks and never
   flows into other nodes, so nested uses of a weight cannot double count. The
   calls run inside the backward of a tiny helper node whose engine task lists
   exactly the weight-side nodes as wanted: a built-in node asks the running
   task which of its outputs are needed (``task_should_compute_output``), so it
   skips its input-gradient GEMM. Outside such a task it would compute every
   output; the result is the same, only slower. Custom ``autograd.Function``
   nodes are driven through the engine instead, with every other next node
   blocked by a pre-hook that drops the gradient.
2. One ``torch.autograd.backward`` from those edges (plus weight-only stage
   outputs) with ``inputs=`` the parameters: autograd sums each parameter's
   gradient and runs its AccumulateGrad once, with all its hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from gradsafe.pipelining._graph import WeightEdge, is_python_node
from gradsafe.pipelining._handoff import CapturedIntermediate, OutputRoot

__all__ = ["deliver", "weight_edge_grads"]

EdgeKey = tuple[Node, int]


def _add(sums: dict[EdgeKey, torch.Tensor], edge: WeightEdge, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    # The engine reduces broadcast gradients and casts dtypes between nodes
    # (validate_outputs); a direct call does not, so do it here.
    meta = edge.node._input_metadata[edge.input_nr]
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    key = (edge.node, edge.input_nr)
    held = sums.get(key)
    sums[key] = grad if held is None else held + grad


class _TaskScope(torch.autograd.Function):
    """A helper node whose backward runs ``work`` inside an engine task."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, work: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.work = work
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        work, ctx.work = ctx.work, None
        work()
        return None, None


def _direct_calls(captured: Sequence[CapturedIntermediate], sums: dict[EdgeKey, torch.Tensor]) -> None:
    failure: list[BaseException] = []

    def work() -> None:
        try:
            for item in captured:
                outputs = item.intermediate.node(*item.grads)  # type: ignore[operator]
                for edge in item.intermediate.weight_edges:
                    _add(sums, edge, outputs[edge.output_index])
        except BaseException as exc:  # re-raised outside the engine, type intact
            failure.append(exc)

    wanted: dict[EdgeKey, None] = {}
    for item in captured:
        for edge in item.intermediate.weight_edges:
            wanted[(edge.node, edge.input_nr)] = None
    anchor = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        scope = _TaskScope.apply(anchor, work)
    # `inputs=` puts every weight-side node into the task's execution info (and
    # the anchor makes the helper node itself needed); input-side nodes are not
    # in it, so the direct calls skip the outputs that go there.
    torch.autograd.grad(
        scope,
        [anchor, *(GradientEdge(node, nr) for node, nr in wanted)],  # type: ignore[arg-type]
        allow_unused=True,
    )
    if failure:
        raise failure[0]


def _drop_grads(grads: tuple[torch.Tensor | None, ...]) -> tuple[None, ...]:
    return tuple(None for _ in grads)


def _engine_call(item: CapturedIntermediate, sums: dict[EdgeKey, torch.Tensor]) -> None:
    node = item.intermediate.node
    roots = [GradientEdge(node, k) for k, g in enumerate(item.grads) if g is not None]
    root_grads = [g for g in item.grads if g is not None]
    if not roots:
        return
    edges = item.intermediate.weight_edges
    targets = list(dict.fromkeys(e.node for e in edges))
    # One engine call is exact unless one weight-side node feeds another
    # (then the second would also receive the first's gradient): split those.
    chained = len(targets) > 1 and any(
        a is not b and _reaches(a, b) for a in targets for b in targets
    )
    groups = [[t] for t in targets] if chained else [targets]
    children = list(dict.fromkeys([*item.intermediate.other_children, *targets]))
    for group in groups:
        keep = set(group)
        group_edges = [e for e in edges if e.node in keep]
        handles = [c.register_prehook(_drop_grads) for c in children if c not in keep]
        try:
            wanted = list(dict.fromkeys((e.node, e.input_nr) for e in group_edges))
            got = torch.autograd.grad(
                roots,
                [GradientEdge(n, nr) for n, nr in wanted],
                root_grads,
                retain_graph=True,
                allow_unused=True,
            )
        finally:
            for handle in handles:
                handle.remove()
        by_key = dict(zip(wanted, got))
        for key in wanted:
            edge = next(e for e in group_edges if (e.node, e.input_nr) == key)
            _add(sums, edge, by_key[key])


def _reaches(source: Node, target: Node) -> bool:
    seen = {source}
    stack = [source]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is target:
                return True
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


def weight_edge_grads(captured: Sequence[CapturedIntermediate]) -> dict[EdgeKey, torch.Tensor]:
    """The summed gradient entering each weight-side edge target, from all intermediates."""
    sums: dict[EdgeKey, torch.Tensor] = {}
    builtin = [c for c in captured if not is_python_node(c.intermediate.node)]
    if builtin:
        _direct_calls(builtin, sums)
    for item in captured:
        if is_python_node(item.intermediate.node):
            _engine_call(item, sums)
    return sums


def deliver(
    sums: dict[EdgeKey, torch.Tensor],
    output_roots: Sequence[OutputRoot],
    params: Sequence[torch.Tensor],
    retain_graph: bool,
) -> None:
    """One backward through the weight-only side into the parameters' AccumulateGrad."""
    for root in output_roots:
        key = (root.edge.node, root.edge.output_nr)
        held = sums.get(key)
        sums[key] = root.grad if held is None else held + root.grad
    if not sums or not params:
        return
    torch.autograd.backward(
        [GradientEdge(node, nr) for node, nr in sums],
        grad_tensors=list(sums.values()),
        inputs=list(params),
        retain_graph=retain_graph,
    )
