"""Drop-in ``stage_backward_input`` / ``stage_backward_weight`` / ``stage_backward``.

Call-compatible with how ``torch.distributed.pipelining.stage`` calls torch's
own functions (positional arguments, ``(dinputs, param_groups)`` from B, the
``param_groups`` value stored by the schedule and passed back to W), but the
value handed from B to W is a :class:`WeightGradHandoff`.

B runs in four steps, one function each: refuse what it cannot make exact
(:mod:`~gradsafe.pipelining._refusals`, before anything runs), find ``K``, the
weight side it computes itself (:mod:`~gradsafe.pipelining._weight_side`),
run the engine for the input gradients (:func:`_run_b`), then release the
outputs (:func:`_detach_outputs`) and hand the rest to W.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypedDict

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from gradsafe._shared.gc_pause import collector_paused
from gradsafe.pipelining._graph import Intermediate, StageGraph, analyze
from gradsafe.pipelining._handoff import (
    ReadInRecompute,
    SplitBackwardError,
    WeightGradHandoff,
    detach_output,
    kernels_defer_to_w,
)
from gradsafe.pipelining._policy import CheckpointedWeights, current_policy
from gradsafe.pipelining._refusals import (
    expect_handoff,
    leaf_owners,
    refuse_engine_error,
    refuse_fsdp_reduction_in_b,
    refuse_inputs,
    refuse_other_post_hooks,
    refuse_post_hooks_added_in_b,
    refuse_weight_side,
    require_features,
    require_input_list,
)
from gradsafe.pipelining._roots import Root, collect_roots, tensor_list
from gradsafe.pipelining._torch import (
    captured_grads,
    exec_group,
    has_hooked_saved,
    is_python_node,
    is_view,
    leaf_variable,
    release_saved,
    silenced_tensor_hooks,
    unpack_twice,
    version,
)
from gradsafe.pipelining._weight_pass import Kept, MemoryOf, OutputRoot, Recorded
from gradsafe.pipelining._weight_side import entered, group_for, weight_parts_in_b

__all__ = ["stage_backward", "stage_backward_input", "stage_backward_weight"]


_B_DONE = object()  # key in Node.metadata: B already ran from this node


class _WRecords(TypedDict):
    """The hand-off's records of what W starts from (keyword arguments of :class:`WeightGradHandoff`)."""

    recorded: list[Recorded]
    kept: list[Kept]
    output_roots: list[OutputRoot]


_Arrived = tuple[tuple[torch.Tensor | None, ...], tuple[int, ...]]


def _record(store: dict[Node, _Arrived], node: Node, grad_inputs: Any, grad_outputs: Any) -> None:
    # A post hook: what arrived, after every pre-hook and tensor hook changed
    # it, and its versions now (W refuses a gradient modified in place since).
    store[node] = (
        tuple(grad_outputs),
        tuple(-1 if g is None else version(g) for g in grad_outputs),
    )


def stage_backward_input(
    stage_outputs_or_loss: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    weights: Iterable[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradHandoff]:
    """B: gradients of the stage inputs only, and a hand-off for :func:`stage_backward_weight`.

    Args:
        stage_outputs_or_loss: the stage's outputs (or its loss): a tensor, a
            ``GradientEdge``, or tuples/lists/dicts of them, nested as
            ``stage_backward`` accepts. Outputs that do not require grad, None
            and Python scalars are ignored; anything else is an error.
        output_grads: gradients nested like the outputs (None entries only for
            single-element outputs), or None for a loss (ones are used).
        input_values: the stage inputs; those that are tensors requiring grad get gradients.
        weights: the stage's parameters (e.g. ``submod.parameters()``). Every
            leaf the stage's graph accumulates into must be one of them (or,
            for FSDP2, its sharded/unsharded counterpart).

    Returns:
        ``(dinputs, handoff)``: ``dinputs[i]`` is the gradient of ``input_values[i]``
        (None for non-tensors, inputs not requiring grad, or unused ones; it is also
        accumulated into a leaf input's ``.grad``, as torch does), and the opaque,
        single-use hand-off W needs. No parameter hook runs here, and weight
        gradients are computed only where W cannot compute them: for
        offloaded ops and custom Functions that depend on a stage input (and
        checkpointed ops, as :func:`~gradsafe.pipelining.checkpointed_weights`
        chooses), with the weight side they reach (kept for W, which
        delivers them); a custom Function that records its weight part in
        :func:`gradsafe.wgrad.split_wgrad_store` leaves that part to W. Like torch's B, the outputs are detached in place,
        except those another node of the stage consumes (a node W calls may
        have saved one): W detaches those.

    Raises:
        SplitBackwardError: malformed outputs or gradients, B already run from
            these outputs, a parameter passed as a stage input, a non-leaf input
            modified in place with a parameter, a leaf in the graph that is
            none of ``weights``, a post hook on a node that depends on both a
            stage input and a parameter (also one registered while B runs:
            refused right after its engine call), a ``register_multi_grad_hook``
            on a stage input or parameter spanning anything else, a reentrant
            checkpoint, saved-tensor hooks that pack a node's own output as
            itself, or a compiled block already compiled donating buffers.
            No gradient has changed then.

    Example::

        >>> import torch
        >>> from gradsafe.pipelining import stage_backward_input, stage_backward_weight
        >>> stage = torch.nn.Linear(3, 2)
        >>> x = torch.ones(4, 3, requires_grad=True)
        >>> y = stage(x)
        >>> (dx,), handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
        >>> torch.equal(dx, torch.ones(4, 2) @ stage.weight.detach()), stage.weight.grad is None
        (True, True)
        >>> grads = stage_backward_weight(stage.parameters(), handoff)  # W, later in the schedule
        >>> torch.equal(stage.weight.grad, torch.ones(2, 4) @ x.detach())
        True
    """
    with collector_paused():
        if not torch.is_inference_mode_enabled():
            return _stage_backward_input(stage_outputs_or_loss, output_grads, input_values, weights)
        # B builds autograd nodes of its own (views of outputs, its record hooks);
        # under torch.inference_mode() those would be inference tensors without a
        # graph. A fused backward works there, so B does too.
        with torch.inference_mode(False):
            return _stage_backward_input(stage_outputs_or_loss, output_grads, input_values, weights)


def _stage_backward_input(
    stage_outputs_or_loss: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    weights: Iterable[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradHandoff]:
    require_features()
    require_input_list(input_values)
    weight_list = tensor_list(weights, "weights")
    roots = collect_roots(stage_outputs_or_loss, output_grads)
    _refuse_a_second_b(roots)
    inputs = [
        (i, t)
        for i, t in enumerate(input_values)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    input_nodes = {get_gradient_edge(t).node for _, t in inputs}
    refuse_inputs(inputs, input_nodes, weight_list)
    graph = analyze([r.edge for r in roots], input_nodes)
    owners = leaf_owners(
        graph.leaves.values(), {id(w) for w in weight_list}, loss=output_grads is None
    )
    refuse_weight_side(graph, input_nodes)
    refuse_fsdp_reduction_in_b(graph.leaves.values())
    policy = current_policy()
    in_b, in_k, has_checkpoints, twice = weight_parts_in_b(graph, policy)
    k_leaves = [n for n in graph.leaves if n in in_k]
    k_outputs = {i for i in graph.weight_only_outputs if roots[i].edge.node in in_k}
    group = group_for(has_checkpoints)

    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    # Custom Functions B runs may leave their weight part to W (gradsafe.wgrad.split).
    with kernels_defer_to_w(graph) as kernels, unpack_twice(twice, group) as recomputed:
        captured, at_leaves = _run_b(
            graph, roots, inputs, dinputs, in_b, k_leaves, k_outputs, group
        )
    _mark_b_done(graph, roots)
    _accumulate_leaf_inputs(inputs, dinputs)
    _release_input_only(graph, in_b)
    w_nodes = [n for n in graph.weight_nodes if n not in in_k]
    keep, later = _detach_outputs(roots, graph, w_nodes, input_values)
    handoff = WeightGradHandoff(
        **_records_for_w(graph, roots, captured, in_b, k_leaves, at_leaves, k_outputs, dinputs),
        weight_nodes=w_nodes,
        leaf_nodes=list(graph.leaves),
        leaves=list(graph.leaves.values()),
        owners=owners,
        outputs=later,
        keep_alive=keep,
        num_nodes=graph.num_nodes,
        group=_w_group(group, policy),
        kernels=kernels,
        recomputed=recomputed,
        read_in_recompute=_read_in_recompute(policy, graph, in_b, weight_list, owners),
    )
    return tuple(dinputs), handoff


def _refuse_a_second_b(roots: Sequence[Root]) -> None:
    if any(_B_DONE in root.edge.node.metadata for root in roots):  # type: ignore[operator]
        raise SplitBackwardError(
            "stage_backward_input already ran from these stage outputs: B runs once per "
            "microbatch (a second B would add the input gradients twice). Redo the forward for "
            "another backward."
        )


def _mark_b_done(graph: StageGraph, roots: Sequence[Root]) -> None:
    """Mark the outputs B backpropagated through to the inputs, so a second B is refused."""
    for i in graph.input_side_outputs:
        if leaf_variable(roots[i].edge.node) is None:
            roots[i].edge.node.metadata[_B_DONE] = True  # type: ignore[index]


def _release_input_only(graph: StageGraph, in_b: set[Intermediate]) -> None:
    """Free what only the input gradients needed, as a fused backward frees it (torch's
    split holds it until W): the saved tensors of the input-side nodes W does not call."""
    called = {item.node for item in graph.intermediates if item not in in_b}
    release_saved([node for node in graph.input_side if node not in called])


def _accumulate_leaf_inputs(
    inputs: Sequence[tuple[int, torch.Tensor]], dinputs: Sequence[torch.Tensor | None]
) -> None:
    """Like a fused backward (and torch's B), leaf inputs also get ``.grad``."""
    for i, tensor in inputs:
        dinput = dinputs[i]
        # Out of place: the previous `.grad` may be a gradient already handed on.
        if dinput is not None and tensor.is_leaf:
            tensor.grad = dinput if tensor.grad is None else tensor.grad + dinput


def _read_in_recompute(
    policy: CheckpointedWeights,
    graph: StageGraph,
    in_b: set[Intermediate],
    weights: Sequence[torch.Tensor],
    owners: Sequence[tuple[torch.Tensor, ...]],
) -> ReadInRecompute | None:
    """The parameters' versions after B, where W will recompute a checkpointed region (else None)."""
    if policy is not CheckpointedWeights.RECOMPUTE_IN_W:
        return None
    if not any(item not in in_b and has_hooked_saved(item.node) for item in graph.intermediates):
        return None
    return ReadInRecompute([*weights, *(t for group in owners for t in group)])


def _w_group(group: Any, policy: CheckpointedWeights) -> Any:
    """The checkpoint group W runs in: B's, or (``RECOMPUTE_IN_W``) one of its own, where
    the checkpointed intermediates W calls recompute their regions once more."""
    if group is None or policy is not CheckpointedWeights.RECOMPUTE_IN_W:
        return group
    return exec_group()


def _records_for_w(
    graph: StageGraph,
    roots: Sequence[Root],
    captured: dict[Node, _Arrived],
    in_b: set[Intermediate],
    k_leaves: Sequence[Node],
    at_leaves: Sequence[torch.Tensor | None],
    k_outputs: set[int],
    dinputs: Sequence[torch.Tensor | None],
) -> _WRecords:
    """What W starts from: the intermediates it calls again, ``K``'s kept leaf gradients, the weight-only outputs."""
    recorded = []
    for item in graph.intermediates:
        grads, versions = captured.get(item.node, ((), ()))
        if item not in in_b and _any_grad(grads):
            recorded.append(Recorded(item.node, grads, item.weight_edges, versions))
    kept = [(node, grad) for node, grad in zip(k_leaves, at_leaves) if grad is not None]
    outputs = [i for i in graph.weight_only_outputs if i not in k_outputs]
    # A gradient W starts from that is also an input gradient B returned, or
    # what arrived at an intermediate W calls (a custom Function's backward may
    # return one tensor for an input and a parameter), reaches W's hooks only
    # as a copy: one that modifies its argument in place must change neither
    # what B returned nor what W's later calls read. Gathered only for a stage
    # with such gradients.
    held: list[torch.Tensor] = []
    if kept or outputs:
        held = [d for d in dinputs if d is not None]
        for rec in recorded:
            held += [g for g in rec.grads if g is not None]
    memory = MemoryOf(held)
    return _WRecords(
        recorded=recorded,
        kept=[Kept(grad, node, 0, memory.shared_by(grad)) for node, grad in kept],
        output_roots=[
            OutputRoot(
                roots[i].edge.node,
                roots[i].edge.output_nr,
                roots[i].grad,
                memory.shared_by(roots[i].grad),
            )
            for i in outputs
        ],
    )


def _any_grad(grads: Sequence[torch.Tensor | None]) -> bool:
    # A loop, not any() over a generator: once per intermediate of every B.
    for grad in grads:
        if grad is not None:
            return True
    return False


def _run_b(
    graph: StageGraph,
    roots: Sequence[Root],
    inputs: Sequence[tuple[int, torch.Tensor]],
    dinputs: list[torch.Tensor | None],
    in_b: set[Intermediate],
    k_leaves: Sequence[Node],
    k_outputs: set[int],
    group: Any,
) -> tuple[dict[Node, _Arrived], Sequence[torch.Tensor | None]]:
    """B's one engine call: fills ``dinputs``; returns what arrived at each intermediate W
    calls again, and the gradients captured at ``K``'s leaves (in ``k_leaves`` order)."""
    captured: dict[Node, _Arrived] = {}
    at_leaves: Sequence[torch.Tensor | None] = ()
    handles: list[Any] = []
    try:
        # A built-in intermediate outside `in_b` is called again in W for its
        # weight part, on what arrived at it in B: record that. Those in
        # `in_b`, and the weight side below them (`in_k`), run once, in B.
        for item in graph.intermediates:
            if item in in_b:
                continue
            handle = item.node.register_hook(functools.partial(_record, captured, item.node))
            handles.append(handle)
            refuse_other_post_hooks(handle, item.node)
        # A weight-only output whose node is in `in_k` is one of B's roots, so
        # that node gets its whole gradient in B. The accumulators in `in_k`
        # are captured, not run: their gradients go to W's delivery, and their
        # tensor hooks (which the engine runs at a capture) run there, once.
        b_roots = [roots[i] for i in (*graph.input_side_outputs, *sorted(k_outputs))]
        if b_roots and inputs:
            # The common stage (no checkpoints, no K) enters no context: B's fixed cost.
            with (
                _NO_CONTEXT
                if group is None and not k_leaves
                else _b_context(group, [graph.leaves[n] for n in k_leaves])
            ):
                # The graph is retained: W still needs the intermediates' saved tensors.
                grads = captured_grads(
                    [r.edge if r.tensor is None else r.tensor for r in b_roots],
                    [t for _, t in inputs] + [GradientEdge(n, 0) for n in k_leaves],
                    [r.grad for r in b_roots],
                )
            refuse_post_hooks_added_in_b(handles)
            for (i, _), grad in zip(inputs, grads):
                dinputs[i] = grad
            at_leaves = grads[len(inputs) :]
    except RuntimeError as exc:
        refuse_engine_error(exc)
        raise
    finally:
        for handle in handles:
            handle.remove()
    return captured, at_leaves


_NO_CONTEXT = contextlib.nullcontext()  # reusable: enters and exits as often as needed


@contextlib.contextmanager
def _b_context(group: Any, k_leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """B's engine call runs in the stage's checkpoint group, with ``K``'s leaves' tensor hooks silenced."""
    with entered(group), silenced_tensor_hooks(k_leaves):
        yield


def _detach_outputs(
    roots: Sequence[Root], graph: StageGraph, w_nodes: Sequence[Node], input_values: Sequence[Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Detach the stage outputs B can; returns (views keeping W's custom nodes alive, outputs W detaches)."""
    tensors = [r.tensor for r in roots if r.tensor is not None]
    keep: list[torch.Tensor] = []
    if any(map(is_python_node, w_nodes)):
        # A custom Function's node is kept alive only by its C++ parents, and
        # the outputs may be detached before W: a view of each output is a C++
        # node that owns the graph until W ends.
        with torch.enable_grad():
            keep = [t.view_as(t) for t in tensors]
    # Like torch's B, detach the outputs now, so nothing above what W needs
    # stays alive (e.g. the loss the schedule keeps). Not those another node
    # consumes (W may unpack one a node saved) nor stage inputs passed
    # through: W detaches those when done.
    input_ids = {id(t) for t in input_values}
    later: list[torch.Tensor] = []
    consumed = {id(roots[i].tensor) for i in graph.consumed_outputs}
    for t in dict.fromkeys(tensors):
        if t.grad_fn is None or id(t) in input_ids or is_view(t):
            continue  # leaves and inputs are the caller's; views cannot be detached in place
        if id(t) in consumed:
            later.append(t)
        else:
            detach_output(t)
    return keep, later


def stage_backward_weight(
    weights: Iterable[torch.Tensor],
    param_groups: WeightGradHandoff,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """W: accumulate every parameter's gradient for the microbatch that B handed off.

    Together with :func:`stage_backward_input`, parameters and inputs end up with
    the gradients one fused backward would give. Gradients reach parameters
    through autograd's AccumulateGrad, once per parameter, so tensor hooks,
    post-accumulate-grad hooks and AccumulateGrad node hooks fire exactly as in a
    fused backward. The hand-off is consumed and everything it held released.

    Args:
        weights: the parameters given to B (more are fine; missing ones are an
            error), or their FSDP2 sharded/unsharded counterparts.
        param_groups: the hand-off B returned (named as in torch's signature).
        retain_graph: leave attached the stage outputs B could not detach
            (those another node consumes). By default W detaches them, so
            nothing keeps the microbatch's graph alive. W itself never frees
            saved tensors: a weight-only part shared with a later backward
            stays usable either way.

    Returns:
        The parameters' ``.grad`` after accumulation, in ``weights`` order.

    Raises:
        SplitBackwardError: no hand-off, one from torch's own B, one already
            used or failed, one made for other parameters, a non-bool
            ``retain_graph``, or saved tensors W needs freed by another
            backward: refused before anything runs, no gradient changed.
            W then delivers each parameter's gradient as soon as it is final
            (memory: one layer's gradients at a time, as torch's own W). If
            something fails after that (a hook's exception, which propagates
            with its type; torch's error from a weight-side node), the
            parameters whose gradients were delivered keep them (their hooks
            ran), those of the engine backward under way may or may not, the
            rest are unchanged; the exception's note (or message) gives the
            counts, and the hand-off is ``FAILED``.

    Example::

        >>> import torch
        >>> from gradsafe.pipelining import stage_backward_input, stage_backward_weight
        >>> stage = torch.nn.Linear(3, 2)
        >>> y = stage(torch.ones(4, 3))
        >>> _, handoff = stage_backward_input(y, torch.ones_like(y), [], stage.parameters())
        >>> hook = stage.bias.register_hook(lambda g: print("bias hook", g))
        >>> weight_grad, bias_grad = stage_backward_weight(stage.parameters(), handoff)
        bias hook tensor([4., 4.])
        >>> print(handoff.state)
        HandoffState.CONSUMED
    """
    weight_list = tensor_list(weights, "weights")
    expect_handoff(param_groups).run(weight_list, retain_graph)
    return tuple(w.grad for w in weight_list)


def stage_backward(
    stage_output: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    outputs_with_grads_idxs: list[int] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """A fused backward for one stage: parameters accumulate, input gradients are returned.

    Same contract as torch's ``stage_backward``: nested tuples/lists/dicts of
    outputs (tensors or ``GradientEdge``) are matched with their gradients,
    None and Python scalars ignored, other types refused; each
    tensor input's gradient is returned and its ``.grad`` cleared.
    ``outputs_with_grads_idxs`` (deprecated upstream) selects outputs by index.

    Example::

        >>> import torch
        >>> from gradsafe.pipelining import stage_backward
        >>> stage = torch.nn.Linear(3, 2)
        >>> x = torch.ones(4, 3, requires_grad=True)
        >>> y = stage(x)
        >>> (dx,) = stage_backward(y, torch.ones_like(y), [x])
        >>> torch.equal(dx, torch.ones(4, 2) @ stage.weight.detach()), x.grad is None
        (True, True)
        >>> torch.equal(stage.weight.grad, torch.ones(2, 4) @ x.detach())
        True
    """
    if outputs_with_grads_idxs is not None:
        stage_output = [stage_output[i] for i in outputs_with_grads_idxs]
        output_grads = [output_grads[i] for i in outputs_with_grads_idxs]
    roots = collect_roots(stage_output, output_grads)
    torch.autograd.backward(
        [r.edge if r.tensor is None else r.tensor for r in roots],  # type: ignore[arg-type]
        grad_tensors=[r.grad for r in roots],
    )
    grads: list[torch.Tensor | None] = []
    for value in input_values:
        if isinstance(value, torch.Tensor):
            grads.append(value.grad)
            value.grad = None  # the gradient is sent on; do not keep it alive here
        else:
            grads.append(None)
    return tuple(grads)
