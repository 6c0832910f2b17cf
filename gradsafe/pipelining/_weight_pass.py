"""W in two phases: compute every leaf's gradient, then deliver them all at once.

1. :func:`leaf_grads` turns what B recorded into each weight-side leaf's total
   gradient. Each intermediate is called directly on the gradient that arrived
   at it in B (no engine: its hooks already ran in B, nothing flows into other
   nodes and no saved tensor is freed). The calls happen inside the backward
   of a tiny helper node whose engine task lists exactly the weight-side nodes
   as wanted: a built-in node asks the running task which of its outputs are
   needed (``task_should_compute_output``), so an intermediate skips its
   input-gradient GEMM. What they send into the weight-only side then goes
   through one engine ``autograd.grad`` down to the leaves' accumulators
   (captured there, not accumulated; the leaves' own tensor hooks silenced):
   weight-only nodes run once each with their summed gradient, so hooks on
   them and on tensors computed from parameters alone (``(w * 2).register_hook``,
   module backward hooks of a stage whose inputs need no grad) run once, as in
   a fused backward. Anything that fails here fails before any parameter's
   gradient changes.
2. :func:`deliver` runs one engine backward through a helper node whose next
   edges are the leaves' gradient accumulators: each accumulator runs once,
   with the complete gradient (or none, as in a fused backward), so tensor
   hooks, post-accumulate-grad hooks and AccumulateGrad node hooks fire
   exactly as in a fused backward. Only user hooks can fail here.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, Node

from gradsafe.pipelining._torch import (
    call_node,
    deferred_callbacks,
    grad_target,
    queue_callback,
    silenced_tensor_hooks,
)

__all__ = [
    "EdgeKey",
    "GradSums",
    "Kept",
    "OutputRoot",
    "Recorded",
    "WeightEdge",
    "add_grad",
    "deliver",
    "leaf_grads",
]

EdgeKey = tuple[Node, int]


class WeightEdge(NamedTuple):
    """An intermediate's edge into the weight side: its output ``output_index`` feeds ``node``'s input ``input_nr``."""

    output_index: int
    node: Node
    input_nr: int


class Recorded(NamedTuple):
    """An intermediate W calls again: the gradients that arrived at it in B, and its weight-side edges."""

    node: Node
    grads: tuple[torch.Tensor | None, ...]
    weight_edges: tuple[WeightEdge, ...]


class Kept(NamedTuple):
    """A leaf's gradient B already computed (on the weight side ``K`` it ran whole).

    W adds it to the leaf's total at the accumulator ``node``'s input
    ``input_nr`` and never runs the nodes it came from again.
    """

    grad: torch.Tensor
    node: Node
    input_nr: int


class OutputRoot(NamedTuple):
    """A weight-only stage output W starts from: its node, output number, and output gradient."""

    node: Node
    output_nr: int
    grad: torch.Tensor


class GradSums(dict[EdgeKey, torch.Tensor]):
    """Gradients summed per edge, filled by :func:`add_grad`.

    A sum this object allocated is added into in place from then on, as the
    engine's input buffers do: one allocation per edge, not one per gradient.
    A tensor a node returned is never modified (it may be the node's input
    or a tensor it saved), so the second gradient at an edge is added out of
    place. Ownership is held weakly: a sum popped and handed to a node is
    freed when the node is done with it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.owned: dict[EdgeKey, weakref.ref[torch.Tensor]] = {}
        # The engine reduces broadcast gradients and casts dtypes between
        # nodes (validate_outputs); a direct call does not, so add_grad does,
        # against each edge's input metadata (read once per edge; dtype None:
        # a leaf whose grad_dtype is None, whose gradient the engine keeps as is).
        self.meta: dict[EdgeKey, tuple[torch.Size, torch.dtype | None]] = {}


def add_grad(
    sums: GradSums, node: Node, input_nr: int, grad: torch.Tensor | None, *, aliased: bool = False
) -> None:
    """Add ``grad`` to the sum at ``(node, input_nr)``.

    ``aliased``: ``grad`` may share memory with a gradient handed out elsewhere
    (B returned it as an input gradient): kept only as a copy, since W's pass
    hands what it holds to hooks, which may modify it in place.
    """
    if grad is None:
        return
    given = grad
    key = (node, input_nr)
    meta = sums.meta.get(key)
    if meta is None:
        meta = sums.meta[key] = grad_target(node, input_nr)
    shape, dtype = meta
    if grad.shape != shape:
        grad = grad.sum_to_size(shape)
    if dtype is not None and grad.dtype != dtype:
        grad = grad.to(dtype)
    held = sums.get(key)
    if held is None:
        sums[key] = grad.clone() if aliased and grad is given else grad
        return
    owned = sums.owned.get(key)
    if owned is not None and owned() is held:
        held.add_(grad)
        return
    total = held + grad
    sums[key] = total
    sums.owned[key] = weakref.ref(total)


def _shares_memory(grad: torch.Tensor | None, others: Sequence[torch.Tensor]) -> bool:
    if grad is None or not others:
        return False
    if any(grad is other for other in others):
        return True
    pointer = _storage_pointer(grad)
    return pointer is not None and any(_storage_pointer(other) == pointer for other in others)


def _storage_pointer(tensor: torch.Tensor) -> int | None:
    if tensor.layout is not torch.strided or tensor.numel() == 0:
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # subclasses without one storage
        return None


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


def leaf_grads(
    recorded: list[Recorded],
    kept: Sequence[Kept],
    output_roots: Sequence[OutputRoot],
    weight_nodes: Sequence[Node],
    leaves: Sequence[Node],
    leaf_tensors: Sequence[torch.Tensor],
    callbacks: list[Callable[[], None]] | None = None,
) -> list[torch.Tensor | None]:
    """Each leaf's total gradient (None where none arrives), in ``leaves`` order.

    ``callbacks``: if given, end-of-backward callbacks that hooks queue in
    the weight-only pass are appended there, for :func:`deliver` to queue in
    its pass, instead of running when the weight-only pass ends.

    No parameter gradient changes. Hooks on weight-only nodes and tensors run
    (once); hooks on the leaves do not (:func:`deliver` runs them). Consumes
    ``recorded``: each intermediate is dropped once called, so the activations
    it saved are freed while W goes on.
    """
    # Over 60 lines on purpose: its two engine passes (the recorded calls,
    # then what they left for the weight-only nodes) fill one GradSums, in order.
    sums = GradSums()
    failure: list[BaseException] = []
    recorded.reverse()

    def work() -> None:
        try:
            while recorded:
                node, grads, edges = recorded.pop()
                outputs = call_node(node, grads)
                # A node may pass on what arrived at it (AddBackward, views):
                # that gradient also went to the input side in B, and may be
                # the input gradient B returned.
                arrived = [g for g in grads if g is not None]
                for output_index, target, target_nr in edges:
                    out = outputs[output_index]
                    add_grad(sums, target, target_nr, out, aliased=_shares_memory(out, arrived))
                del node, grads, edges, outputs
        except BaseException as exc:  # re-raised outside the engine, type intact
            failure.append(exc)

    for node, nr, grad in output_roots:
        add_grad(sums, node, nr, grad)
    for grad, target, target_nr in kept:
        add_grad(sums, target, target_nr, grad)
    if recorded:
        anchor = torch.zeros((), requires_grad=True)
        with torch.enable_grad():
            scope = _TaskScope.apply(anchor, work)
        # `inputs=` puts every weight-side node into the task's execution info
        # (the anchor makes the helper node itself needed); input-side nodes
        # are not in it, so the direct calls skip the outputs that go there.
        wanted = [GradientEdge(n, 0) for n in (*weight_nodes, *leaves)]
        torch.autograd.grad(scope, [anchor, *wanted], allow_unused=True)  # type: ignore[arg-type]
        if failure:
            raise failure[0]
    totals = [sums.pop((leaf, 0), None) for leaf in leaves]
    if sums:
        roots = list(sums.items())
        sums.clear()
        deferring = (
            contextlib.nullcontext(None)
            if callbacks is None
            else deferred_callbacks(set(weight_nodes))
        )
        with silenced_tensor_hooks(leaf_tensors), deferring as held:
            # retain_graph: a weight-only part may be shared with a later
            # backward (e.g. a weight transform computed once per step).
            arrived = torch.autograd.grad(
                [GradientEdge(node, nr) for (node, nr), _ in roots],  # type: ignore[arg-type]
                [GradientEdge(leaf, 0) for leaf in leaves],  # type: ignore[arg-type]
                [grad for _, grad in roots],
                retain_graph=True,
                allow_unused=True,
            )
        del roots
        if held:
            callbacks.extend(held)  # type: ignore[union-attr]
        totals = [b if a is None else a if b is None else a + b for a, b in zip(totals, arrived)]
    return totals


class _Deliver(torch.autograd.Function):
    """A helper node whose next edges are the leaves' accumulators; its backward hands them their grads."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        anchor: torch.Tensor,
        grads: list[torch.Tensor | None],
        callbacks: Sequence[Callable[[], None]],
        *leaves: torch.Tensor,
    ) -> torch.Tensor:
        ctx.grads = grads
        ctx.callbacks = callbacks
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        callbacks, ctx.callbacks = ctx.callbacks, ()
        # Queued now, they run when this pass ends: after every accumulator,
        # as in a fused backward.
        for callback in callbacks:
            queue_callback(callback)
        out = (None, None, None, *grads)
        # Drop the caller's references too: AccumulateGrad then adopts each
        # gradient as `.grad` instead of copying it (no transient second copy).
        grads.clear()
        return out


def deliver(
    leaves: Sequence[torch.Tensor],
    grads: list[torch.Tensor | None],
    callbacks: Sequence[Callable[[], None]] = (),
) -> None:
    """One engine backward that runs each leaf's AccumulateGrad once, with its hooks.

    ``grads`` is emptied: the accumulators take ownership of its tensors.
    ``callbacks`` (held from the weight-only pass) run when this pass ends.
    """
    if not leaves and not callbacks:
        return
    anchor = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        root = _Deliver.apply(anchor, grads, callbacks, *leaves)
    torch.autograd.backward([root], inputs=None)
