"""W: each leaf's gradient computed from what B recorded, and delivered as soon as it is final.

The weight side W runs is: *intermediates* (input-side nodes, called directly
on the gradient that arrived at them in B), the weight-only nodes below them,
and the leaves' gradient accumulators. It falls into *components*: weight-only
nodes and accumulators joined by weight-only edges (a Linear's ``w.t()`` node
and ``w``'s accumulator; a tied weight's transforms and its accumulator),
merged where one mode-``"all"`` ``register_multi_grad_hook`` spans several
leaves (it sees all their gradients at once; a fused backward holds them
all too, in its buffer, until the last arrives). A mode-``"any"`` one does
not merge them: it fires in the first delivery to reach one of its leaves
and is silent in W's later ones (:func:`fired_once_across`). A
component's gradients are final once every intermediate sending into it has
been called.

Each intermediate is called directly (no engine: its hooks already ran in B,
nothing flows into other nodes and no saved tensor is freed), inside the
backward of a tiny helper node whose engine task lists exactly the weight-side
nodes as wanted: a built-in node asks the running task which of its outputs
are needed (``task_should_compute_output``), so an intermediate skips its
input-gradient GEMM. What the calls send is summed per edge the way the
engine's input buffers sum (:func:`add_grad`).

:class:`Delivery` hands each component, the moment it is complete, to
one engine backward from its edges: every weight-only node runs once with its
summed gradient and every accumulator once with its complete gradient, so
hooks on weight-only nodes and tensors, tensor hooks on the leaves,
post-accumulate-grad hooks and accumulator node hooks fire as in a fused
backward, and AccumulateGrad applies its own layout rules (adopting a
gradient as ``.grad`` or adding it in place). The gradients are freed as soon
as they are accumulated: W holds one intermediate's outputs and the partial
sums of components still waiting, never the stage's whole set of weight
gradients. :func:`leaf_grads` computes the same totals without delivering
them (for callers that copy gradients into buffers of their own).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from gradsafe.pipelining._graph import WeightEdge
from gradsafe.pipelining._torch import (
    ACCUMULATOR_READS,
    MultiGradHook,
    apply_function,
    call_node,
    deferred_callbacks,
    delivering,
    fired_once_across,
    grad_target,
    multi_grad_hooks,
    queue_callback,
    run_backward,
    silenced_tensor_hooks,
)

__all__ = [
    "EdgeKey",
    "GradSums",
    "IntermediateFailed",
    "Delivery",
    "Kept",
    "MemoryOf",
    "OutputRoot",
    "Progress",
    "Recorded",
    "WeightEdge",
    "add_grad",
    "leaf_grads",
]

EdgeKey = tuple[Node, int]


class Recorded(NamedTuple):
    """An intermediate W calls again: the gradients that arrived at it in B, and its weight-side edges.

    ``versions``: the gradients' version counters as they arrived (-1 for
    None); one modified in place since (by a later hook, or by a caller
    reusing the buffer) is refused before W runs.
    """

    node: Node
    grads: tuple[torch.Tensor | None, ...]
    weight_edges: tuple[WeightEdge, ...]
    versions: tuple[int, ...]


class Kept(NamedTuple):
    """A leaf's gradient B already computed (on the weight side ``K`` it ran whole).

    W adds it to the leaf's total at the accumulator ``node``'s input
    ``input_nr`` and never runs the nodes it came from again. ``aliased``: it
    shares memory with an input gradient B returned or with what arrived at an
    intermediate W calls (a custom Function's backward may return one tensor
    for an input and a parameter), so W hands hooks a copy, as for an
    intermediate's pass-through (:func:`add_grad`).
    """

    grad: torch.Tensor
    node: Node
    input_nr: int
    aliased: bool = False


class OutputRoot(NamedTuple):
    """A weight-only stage output W starts from: its node, output number, and output gradient.

    ``aliased``: the gradient shares memory with an input gradient B returned
    or with what arrived at an intermediate W calls (the same tensor given for
    an input-side output), so W hands hooks a copy.
    """

    node: Node
    output_nr: int
    grad: torch.Tensor
    aliased: bool = False


class IntermediateFailed(Exception):
    """torch raised while W called an intermediate directly (its saved tensors were freed, say)."""

    def __init__(self, node: Node, cause: BaseException) -> None:
        super().__init__(node.name())
        self.node_name = node.name()
        self.cause = cause


@dataclasses.dataclass
class Progress:
    """How far a :class:`Delivery` got; read it after an exception."""

    #: Leaves W delivers into.
    total: int = 0
    #: Leaves whose engine backward completed: they hold this microbatch's gradient.
    delivered: int = 0
    #: Leaves in the engine backward that was running: each may or may not hold it.
    under_way: int = 0


def _is_sparse(t: torch.Tensor) -> bool:
    return t.is_sparse or t.layout is torch.sparse_csr


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


def sum_grads(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` out of place, in the order the engine's input buffer adds them.

    ATen adds a sparse gradient to a dense one but not the reverse, so a
    sparse ``a`` goes second (sparse + sparse stays sparse), as in the engine.
    """
    return b + a if _is_sparse(a) else a + b


def add_grad(
    sums: GradSums, node: Node, input_nr: int, grad: torch.Tensor | None, *, aliased: bool = False
) -> bool:
    """Add ``grad`` to the sum at edge ``(node, input_nr)``; whether the edge had none before.

    ``aliased``: ``grad`` may share memory with a gradient handed out elsewhere
    (B returned it as an input gradient): kept only as a copy, since W's pass
    hands what it holds to hooks, which may modify it in place.
    """
    if grad is None:
        return False
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
        return True
    owned = sums.owned.get(key)
    if owned is not None and owned() is held and not _is_sparse(held):
        # Dense += dense or dense += sparse, into a buffer only this object holds.
        held.add_(grad)
        return False
    total = sum_grads(held, grad)
    sums[key] = total
    sums.owned[key] = weakref.ref(total)
    return False


class MemoryOf:
    """The memory of a set of tensors, to test many others against at once (:meth:`shared_by`).

    Built once over a set (B's returned and recorded gradients; what arrived
    at a node W calls), then asked once per gradient tested: linear in both,
    where testing each gradient against each tensor would be their product (a
    checkpointed stage keeps hundreds).
    """

    __slots__ = ("_ids", "_pointers")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._ids = {id(t) for t in tensors}
        self._pointers = {p for p in map(_storage_pointer, tensors) if p is not None}

    def shared_by(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is one of the tensors or shares a storage with one."""
        if id(grad) in self._ids:
            return True
        return bool(self._pointers) and _storage_pointer(grad) in self._pointers


def _storage_pointer(tensor: torch.Tensor) -> int | None:
    if tensor.layout is not torch.strided or tensor.numel() == 0:
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # subclasses without one storage
        return None


class _Anchor:
    """What W's helper nodes hang from: a leaf no gradient reaches, the one their roots get,
    and the node that hosts W's direct calls.

    One per process (:data:`_ANCHOR`), shared by every W on every thread: no
    pass accumulates into the leaf (the host pass captures at it, the
    delivery helper sends it None) and nothing writes to ``one``, so
    concurrent passes cannot meet there; making these per W cost more than
    the rest of W's setup. On the CPU, so that the helper nodes, and the
    direct calls they host, run on the thread calling W.
    """

    __slots__ = ("_host", "_host_edge", "_work", "leaf", "one")

    def __init__(self) -> None:
        self.leaf = torch.zeros((), dtype=torch.float32, device="cpu", requires_grad=True)
        self.one = torch.ones((), dtype=torch.float32, device="cpu")
        # The host: a built-in view node with one next edge (the leaf's
        # accumulator), whose one pre-hook runs, inside the engine task, the
        # work the calling thread put on its stack (a nested W on the same
        # thread pushes its own).
        with torch.enable_grad():
            self._host = self.leaf.view_as(self.leaf)
        node = self._host.grad_fn
        if node is None:
            raise RuntimeError("autograd recorded no node for a view made with grad enabled")
        self._host_edge = GradientEdge(*node.next_functions[0])  # type: ignore[arg-type]
        self._work = threading.local()
        node.register_prehook(self._run_work)

    def _run_work(self, grad_outputs: object) -> None:
        self._work.stack[-1]()

    def host(self, work: Callable[[], None], wanted: Sequence[GradientEdge]) -> None:
        """One engine pass that runs ``work`` inside its task, where ``wanted`` are the needed nodes."""
        stack = getattr(self._work, "stack", None)
        if stack is None:
            stack = self._work.stack = []
        stack.append(work)
        try:
            # The leaf's accumulator, the host's one next edge, makes the host needed.
            run_backward([self._host], [self.one], [self._host_edge, *wanted])
        finally:
            stack.pop()


with torch.inference_mode(False):  # an import under inference_mode must not make inference tensors
    _ANCHOR = _Anchor()


def _call_intermediates(
    recorded: list[Recorded],
    add: Callable[[Node, int, torch.Tensor | None, bool], object],
    weight_nodes: Sequence[Node],
    leaves: Sequence[Node],
    after_call: Callable[[int], None] | None,
) -> None:
    """Call every recorded intermediate once, in B's order, passing what it sends to ``add``.

    Consumes ``recorded``: each intermediate is dropped once called, so the
    activations it saved are freed while W goes on. ``after_call(i)`` runs
    after the i-th call, still inside the engine task. An exception from a
    call is raised as :class:`IntermediateFailed`; one from ``after_call`` as is.
    """
    failure: list[BaseException] = []
    recorded.reverse()

    def work() -> None:
        index = 0
        try:
            while recorded:
                node, grads, edges, _ = recorded.pop()
                try:
                    outputs = call_node(node, grads)
                except Exception as exc:
                    raise IntermediateFailed(node, exc) from exc
                # A node may pass on what arrived at it (AddBackward, views):
                # that gradient also went to the input side in B, and may be
                # the input gradient B returned.
                arrived = MemoryOf([g for g in grads if g is not None])
                for output_index, target, target_nr in edges:
                    out = outputs[output_index]
                    add(target, target_nr, out, out is not None and arrived.shared_by(out))
                    del out
                # Nothing of this call outlives it: its gradients are freed once delivered.
                del node, grads, edges, outputs, arrived
                if after_call is not None:
                    after_call(index)
                index += 1
        except BaseException as exc:  # re-raised outside the engine, type intact
            failure.append(exc)

    # The host node runs `work` from a pre-hook, inside the engine task (a
    # built-in node and a hook cost less per W than a custom Function).
    # `inputs=` puts every weight-side node into the task's execution info;
    # input-side nodes are not in it, so the direct calls skip the outputs
    # that go there.
    _ANCHOR.host(work, [GradientEdge(n, 0) for n in (*weight_nodes, *leaves)])
    if failure:
        raise failure[0]


def leaf_grads(
    recorded: list[Recorded],
    kept: Sequence[Kept],
    output_roots: Sequence[OutputRoot],
    weight_nodes: Sequence[Node],
    leaves: Sequence[Node],
    leaf_tensors: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """Each leaf's total gradient (None where none arrives), in ``leaves`` order, delivered nowhere.

    No parameter gradient changes. Hooks on weight-only nodes and tensors run
    (once); hooks on the leaves do not. Holds every leaf's gradient at once
    (they are the result).
    """
    sums = GradSums()
    for node, nr, grad, aliased in output_roots:
        add_grad(sums, node, nr, grad, aliased=aliased)
    for grad, target, target_nr, aliased in kept:
        add_grad(sums, target, target_nr, grad, aliased=aliased)
    if recorded:
        _call_intermediates(
            recorded,
            lambda n, nr, g, aliased: add_grad(sums, n, nr, g, aliased=aliased),
            weight_nodes,
            leaves,
            None,
        )
    totals = [sums.pop((leaf, 0), None) for leaf in leaves]
    if sums:
        roots = list(sums.items())
        sums.clear()
        with silenced_tensor_hooks(leaf_tensors):
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
        totals = [
            b if a is None else a if b is None else sum_grads(a, b) for a, b in zip(totals, arrived)
        ]
    return totals


class _Deliver(torch.autograd.Function):
    """A helper node whose next edges are leaves' accumulators; its backward hands them their grads."""

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


def _components(
    weight_nodes: Sequence[Node], leaves: Sequence[Node], leaf_tensors: Sequence[torch.Tensor]
) -> dict[Node, Node]:
    """Each weight-side node's component, named by one of its nodes (union-find)."""
    parent: dict[Node, Node] = {}

    def find(node: Node) -> Node:
        root = parent.setdefault(node, node)
        while root is not parent[root]:
            root = parent[root]
        while node is not root:
            parent[node], node = root, parent[node]
        return root

    def union(a: Node, b: Node) -> None:
        ra, rb = find(a), find(b)
        if ra is not rb:
            parent[ra] = rb

    for node in leaves:
        parent[node] = node
    for node in weight_nodes:
        parent.setdefault(node, node)
        for child, _ in node.next_functions:
            if child is not None:
                union(node, child)
    # A mode-"all" multi-grad hook over several leaves fires once per engine
    # backward, with the gradients that backward gave them: deliver them
    # together, as a fused backward does.
    by_key: dict[int, Node] = {}
    for node, tensor in zip(leaves, leaf_tensors):
        for hook in multi_grad_hooks(tensor):
            if hook.mode == "all":
                other = by_key.setdefault(hook.key, node)
                if other is not node:
                    union(other, node)
    # Most nodes point at their root already: find() only for the others.
    return {node: up if parent[up] is up else find(node) for node, up in tuple(parent.items())}


def _spread_any_hooks(
    component: dict[Node, Node], leaves: Sequence[Node], leaf_tensors: Sequence[torch.Tensor]
) -> list[MultiGradHook]:
    """The mode-"any" multi-grad hooks over leaves of more than one component."""
    seen: dict[int, tuple[MultiGradHook, Node]] = {}
    spread: dict[int, MultiGradHook] = {}
    for node, tensor in zip(leaves, leaf_tensors):
        for hook in multi_grad_hooks(tensor):
            if hook.mode == "any":
                first = seen.setdefault(hook.key, (hook, component[node]))[1]
                if first is not component[node]:
                    spread[hook.key] = hook
    return list(spread.values())


def _add_kept(kept: list[Kept], add: Callable[[Node, int, torch.Tensor, bool], None]) -> None:
    """Add each kept gradient to its sum, then empty ``kept``: the sums hold them alone, so
    AccumulateGrad adopts one as ``.grad`` instead of copying it (a function: no loop
    variable outlives it)."""
    for grad, target, target_nr, aliased in kept:
        add(target, target_nr, grad, aliased)
    kept.clear()


class Delivery:
    """One W's delivery pass: every leaf's gradient computed and accumulated, each component
    as soon as it is complete (:meth:`run`).

    The steps are its methods, in the order a W runs them: :meth:`add` sums
    what arrives per edge, :meth:`after_call` counts down a component's
    senders, :meth:`deliver_or_defer` delivers a complete component now or
    at the end, :meth:`deliver` runs one engine backward for some. The state
    they share (sums, pending counts, the deferred list) is this pass's alone.
    """

    __slots__ = (
        "anchor",
        "component",
        "deferred",
        "edges_of",
        "kept",
        "leaf_of",
        "leaf_tensors",
        "leaves",
        "marker",
        "marker_node",
        "members",
        "output_roots",
        "pending",
        "progress",
        "recorded",
        "sends",
        "spread",
        "sums",
        "weight_nodes",
    )

    def __init__(
        self,
        recorded: list[Recorded],
        kept: list[Kept],
        output_roots: Sequence[OutputRoot],
        weight_nodes: Sequence[Node],
        leaves: Sequence[Node],
        leaf_tensors: Sequence[torch.Tensor],
        *,
        progress: Progress,
    ) -> None:
        self.recorded, self.kept, self.output_roots = recorded, kept, output_roots
        self.weight_nodes, self.leaves, self.leaf_tensors = weight_nodes, leaves, leaf_tensors
        self.progress = progress
        progress.total = len(leaves)
        component = self.component = _components(weight_nodes, leaves, leaf_tensors)
        self.leaf_of = dict(zip(leaves, leaf_tensors))
        members: dict[Node, list[Node]] = {}
        for node in leaves:
            members.setdefault(component[node], []).append(node)
        self.members = members
        # Per intermediate, the components it sends into; per component, how many
        # intermediates have yet to send.
        sends = [{component[target] for _, target, _ in rec.weight_edges} for rec in recorded]
        pending: dict[Node, int] = {}
        for targets in sends:
            for c in targets:
                pending[c] = pending.get(c, 0) + 1
        self.sends, self.pending = sends, pending
        self.sums = GradSums()
        self.edges_of: dict[Node, list[EdgeKey]] = {}
        self.deferred: list[Node] = []
        self.anchor = _ANCHOR
        # A mode-"any" multi-grad hook over several components fires in the first
        # delivery only: every delivery is rooted at this pass's marker too.
        self.spread = _spread_any_hooks(component, leaves, leaf_tensors)
        self.marker = torch.zeros((), requires_grad=True) if self.spread else None
        self.marker_node = None if self.marker is None else get_gradient_edge(self.marker).node

    def run(self) -> None:
        """Deliver every leaf's gradient, consuming ``kept`` (emptied once its gradients are summed).

        Whatever stops it propagates (a direct call's error as
        :class:`IntermediateFailed`; a hook's exception or torch's error from a
        weight-only node or accumulator as is); ``progress`` then says how many
        leaves already hold their gradient.
        """
        marker_node, add = self.marker_node, self.add
        # End-of-backward callbacks that hooks queue run, in a fused backward,
        # after every accumulator: W holds them through each component's pass and
        # queues them in one last pass.
        with (
            deferred_callbacks({*self.weight_nodes, *self.leaves}) as held,
            fired_once_across(self.spread, marker_node)
            if marker_node is not None
            else nullcontext(),
        ):
            for node, nr, grad, aliased in self.output_roots:
                add(node, nr, grad, aliased)
            _add_kept(self.kept, add)
            # What needs no intermediate goes first: kept gradients are freed early.
            first = [c for c in self.members if c not in self.pending]
            if first:
                self.deliver_or_defer(first)
            if self.recorded:
                _call_intermediates(
                    self.recorded, add, self.weight_nodes, self.leaves, self.after_call
                )
            if self.deferred:
                self.deliver(self.deferred)
        if held:
            with torch.enable_grad():
                root = apply_function(_Deliver, self.anchor.leaf, [], held)
            run_backward([root], [self.anchor.one])

    def add(self, node: Node, nr: int, grad: torch.Tensor | None, aliased: bool = False) -> None:
        """Sum ``grad`` into what edge ``(node, nr)`` has received (:func:`add_grad`)."""
        if add_grad(self.sums, node, nr, grad, aliased=aliased):
            self.edges_of.setdefault(self.component[node], []).append((node, nr))

    def after_call(self, index: int) -> None:
        """The ``index``-th intermediate was called: deliver the components it completed."""
        ready = []
        sends, pending = self.sends, self.pending
        for c in sends[index]:
            left = pending[c] - 1
            pending[c] = left
            if left == 0:
                ready.append(c)
        sends[index] = set()
        if ready:
            self.deliver_or_defer(ready)

    def deliver_or_defer(self, ready: Sequence[Node]) -> None:
        """Deliver the ``ready`` components now, or hold them for the last delivery."""
        # A gradient delivered to a `.grad` that is None becomes that `.grad`:
        # holding it until the end costs no memory, and one engine backward
        # for all such components costs less than one each. One added into a
        # `.grad` already held is a second buffer: delivered at once. So is
        # every component under a spread mode-"any" hook: it fires on the
        # first gradient, as in a fused backward.
        if self.marker_node is not None:
            self.deliver(ready)
            return
        members, leaf_of = self.members, self.leaf_of
        for c in ready:  # loops, not any() over a generator: once per intermediate
            for leaf in members[c]:
                if leaf_of[leaf].grad is not None:
                    self.deliver(ready)
                    return
        self.deferred.extend(ready)

    def deliver(self, ready: Sequence[Node]) -> None:
        """One engine backward that runs the ``ready`` components' nodes and accumulators."""
        roots, grads, to_leaves, leaves_now = self._gather(ready)
        progress, leaf_of = self.progress, self.leaf_of
        progress.under_way = len(leaves_now)
        self._root_leaves(roots, grads, to_leaves, leaves_now)
        del to_leaves
        if self.marker_node is not None:
            roots.append(GradientEdge(self.marker_node, 0))
            grads.append(torch.zeros(()))  # the marker's, accumulated and never read
        # The graph is retained: a weight-only part may be shared with a later
        # backward (e.g. a weight transform computed once per step). While the
        # engine runs these leaves' hooks, no B swaps them out: see `delivering`.
        with delivering([leaf_of[n] for n in leaves_now]):
            run_backward(roots, grads)
        progress.delivered += progress.under_way
        progress.under_way = 0

    def _gather(
        self, ready: Sequence[Node]
    ) -> tuple[
        list[torch.Tensor | GradientEdge], list[torch.Tensor], list[torch.Tensor | None], list[Node]
    ]:
        """The ``ready`` components' summed gradients, taken out of :attr:`sums`: the roots into
        their weight-only nodes with theirs, and each leaf's (None where nothing arrived)."""
        roots: list[torch.Tensor | GradientEdge] = []
        grads: list[torch.Tensor] = []
        to_leaves: list[torch.Tensor | None] = []
        leaves_now: list[Node] = []
        sums, edges_of, leaf_of = self.sums, self.edges_of, self.leaf_of
        for c in ready:
            for key in edges_of.pop(c, ()):
                if key[0] not in leaf_of:
                    roots.append(GradientEdge(*key))
                    grads.append(sums.pop(key))
            for leaf in self.members[c]:
                to_leaves.append(sums.pop((leaf, 0), None))
                leaves_now.append(leaf)
        return roots, grads, to_leaves, leaves_now

    def _root_leaves(
        self,
        roots: list[torch.Tensor | GradientEdge],
        grads: list[torch.Tensor],
        to_leaves: list[torch.Tensor | None],
        leaves_now: list[Node],
    ) -> None:
        """Add the leaves' gradients to ``roots``: straight, or through a helper node."""
        leaf_of = self.leaf_of
        # Every leaf gets its accumulator run, with None if nothing arrived: a
        # fused backward runs it too, and its hooks fire.
        reached = {child for edge in roots for child, _ in edge.node.next_functions}  # type: ignore[union-attr]
        if all(
            leaf_of[leaf].grad is not None if grad is not None else leaf in reached
            for leaf, grad in zip(leaves_now, to_leaves)
        ):
            # Each accumulator adds into the `.grad` it holds: straight from the engine's root.
            for leaf, grad in zip(leaves_now, to_leaves):
                if grad is not None:
                    roots.append(GradientEdge(leaf, 0))
                    grads.append(grad)
        else:
            # Through a helper node: the engine's root keeps its gradients
            # referenced, which would keep AccumulateGrad from adopting one as
            # `.grad` (a copy, and a second gradient's worth of memory).
            anchor = self.anchor
            with torch.enable_grad(), ACCUMULATOR_READS:
                roots.append(
                    apply_function(
                        _Deliver, anchor.leaf, to_leaves, (), *(leaf_of[n] for n in leaves_now)
                    )
                )
            grads.append(anchor.one)
