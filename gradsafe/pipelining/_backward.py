"""Drop-in ``stage_backward_input`` / ``stage_backward_weight`` / ``stage_backward``.

Call-compatible with how ``torch.distributed.pipelining.stage`` calls torch's
own functions (positional arguments, ``(dinputs, param_groups)`` from B, the
``param_groups`` value stored by the schedule and passed back to W), but the
value handed from B to W is a :class:`WeightGradHandoff`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from gradsafe.pipelining._graph import Intermediate, StageGraph, WeightEdge, analyze
from gradsafe.pipelining._handoff import (
    SplitBackwardError,
    WeightGradHandoff,
    describe,
    detach_output,
    detached_by_split,
)
from gradsafe.pipelining._torch import (
    current_exec_group,
    exec_group,
    has_hooked_saved,
    silenced_tensor_hooks,
    fsdp_counterparts,
    input_meta,
    is_python_node,
    is_view,
    leaf_variable,
    missing_feature,
)
from gradsafe.pipelining._weight_pass import GradSums, Kept, Recorded, add_grad

__all__ = ["stage_backward", "stage_backward_input", "stage_backward_weight"]


_B_DONE = object()  # key in Node.metadata: B already ran from this node

# Values that carry no gradient wherever they appear in a stage's outputs.
_INERT = (type(None), bool, int, float, complex, str, bytes)


@dataclasses.dataclass(frozen=True)
class _Root:
    """One stage output B starts from: its gradient edge, output gradient, and tensor (if any)."""

    edge: GradientEdge
    grad: torch.Tensor
    tensor: torch.Tensor | None


def _implied_grad(shape: torch.Size, path: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if math.prod(shape) != 1:
        raise SplitBackwardError(
            f"stage output {path} requires grad but its output gradient is None, and a gradient "
            "can only be implied for a single-element output (a loss). Pass its gradient, or a "
            "zero tensor if it gets none."
        )
    return torch.ones(shape, dtype=dtype, device=device)


def _collect_roots(output: Any, grad: Any, path: str, roots: list[_Root], implied: bool) -> None:
    """Pair every tensor / GradientEdge in ``output`` with its gradient in ``grad`` (same nesting).

    A None gradient for a tuple/list/dict means no gradient flows there (as in
    torch's ``stage_backward``), unless ``implied`` (a loss: output_grads=None).
    """
    if isinstance(output, torch.Tensor):
        if grad is not None and not isinstance(grad, torch.Tensor):
            raise SplitBackwardError(
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
            grad = _implied_grad(output.shape, path, output.dtype, output.device)
        elif grad.shape != output.shape:
            raise SplitBackwardError(
                f"stage output {path} has shape {tuple(output.shape)} but its output gradient "
                f"has shape {tuple(grad.shape)}."
            )
        roots.append(_Root(get_gradient_edge(output), grad, output))
    elif isinstance(output, GradientEdge):
        if grad is not None and not isinstance(grad, torch.Tensor):
            raise SplitBackwardError(
                f"the output gradient for GradientEdge {path} is a {type(grad).__name__}; "
                "expected a Tensor or None."
            )
        shape, dtype, device = input_meta(output.node, output.output_nr)
        if grad is None:
            grad = _implied_grad(shape, path, dtype, device)
        elif grad.shape != shape:
            raise SplitBackwardError(
                f"GradientEdge {path} expects a gradient of shape {tuple(shape)}, got "
                f"{tuple(grad.shape)}."
            )
        roots.append(_Root(output, grad, None))
    elif isinstance(output, (tuple, list, dict)) and grad is None and not implied:
        return
    elif isinstance(output, (tuple, list)):
        if grad is not None and (not isinstance(grad, (tuple, list)) or len(grad) != len(output)):
            raise SplitBackwardError(
                f"stage output {path} is a {type(output).__name__} of {len(output)} but its output "
                f"gradient is {_shape_of(grad)}: pass one gradient (or None) per output, nested "
                "the same way, or output_grads=None for a loss."
            )
        for index, item in enumerate(output):
            _collect_roots(
                item, None if grad is None else grad[index], f"{path}[{index}]", roots, implied
            )
    elif isinstance(output, dict):
        if grad is not None and (not isinstance(grad, dict) or set(grad) != set(output)):
            raise SplitBackwardError(
                f"stage output {path} is a dict with keys {sorted(map(str, output))} but its output "
                f"gradient is {_shape_of(grad)}: pass a dict with the same keys."
            )
        for key, item in output.items():
            _collect_roots(
                item, None if grad is None else grad[key], f"{path}[{key!r}]", roots, implied
            )
    elif not isinstance(output, _INERT):
        raise SplitBackwardError(
            f"stage output {path} is a {type(output).__name__}: B takes Tensors, GradientEdges, "
            "and tuples/lists/dicts of them (None and Python scalars are ignored)."
        )


def _shape_of(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _record(store: dict[Node, tuple[torch.Tensor | None, ...]], node: Node, grads: Any) -> None:
    store[node] = tuple(grads)


def _record_sent(
    sums: GradSums, edges: tuple[WeightEdge, ...], sent: Any, arrived: Any
) -> None:
    # Summed per edge as they come: a Function applied at many sites keeps
    # one gradient per weight edge, not one per call.
    for e in edges:
        add_grad(sums, e.node, e.input_nr, sent[e.output_index])


def _tensor_list(values: Iterable[Any], what: str) -> list[torch.Tensor]:
    items = list(values)
    for index, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise SplitBackwardError(
                f"{what}[{index}] is a {type(item).__name__}; expected the stage's parameters "
                "(tensors), e.g. submod.parameters()."
            )
    return items


@functools.cache
def _missing_feature() -> str | None:
    return missing_feature()  # depends only on the installed torch: probed once


def _require_features() -> None:
    """Refuse, on the first B, a torch whose autograd internals the split backward cannot use.

    ``gradsafe.patch("pipelining")`` turns the same probe into a skip; this
    covers the functions imported directly.
    """
    missing = _missing_feature()
    if missing is not None:
        raise SplitBackwardError(
            f"gradsafe's split backward cannot run on torch {torch.__version__}: {missing}. "
            "Use torch's own stage_backward_input/stage_backward_weight on this torch, or a "
            "torch gradsafe supports (2.11-2.15)."
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
        single-use hand-off W needs. No weight gradient is computed here and no
        parameter hook runs. Like torch's B, the outputs are detached in place,
        except those another node of the stage consumes (a node W calls may
        have saved one): W detaches those.

    Raises:
        SplitBackwardError: malformed outputs or gradients, B already run from
            these outputs, a parameter passed as a stage input, a non-leaf input
            modified in place with a parameter, or a leaf in the graph that is
            none of ``weights``. Nothing has changed then.
    """
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
    _require_features()
    if not isinstance(input_values, (tuple, list)):
        raise SplitBackwardError(
            f"input_values must be a tuple or list of the stage inputs, got "
            f"{type(input_values).__name__}."
        )
    weight_list = _tensor_list(weights, "weights")
    roots: list[_Root] = []
    _collect_roots(stage_outputs_or_loss, output_grads, "", roots, output_grads is None)
    if any(_B_DONE in root.edge.node.metadata for root in roots):  # type: ignore[operator]
        raise SplitBackwardError(
            "stage_backward_input already ran from these stage outputs: B runs once per "
            "microbatch (a second B would add the input gradients twice). Redo the forward for "
            "another backward."
        )
    weight_ids = {id(w) for w in weight_list}
    inputs = [
        (i, t) for i, t in enumerate(input_values) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    for i, t in inputs:
        if id(t) in weight_ids:
            raise SplitBackwardError(
                f"input_values[{i}] is also one of the stage's parameters; a split backward "
                "cannot give it one gradient with its hooks run once. Pass a copy of it as the "
                "stage input, or use stage_backward (fused)."
            )
    for i, t in inputs:
        _refuse_in_place_weight_use(i, t, weight_ids)
    graph = analyze([r.edge for r in roots], [get_gradient_edge(t).node for _, t in inputs])
    owners = _owners(graph.leaves.values(), weight_ids)

    in_b, checkpointed = _weight_parts_in_b(graph)
    targets = list(dict.fromkeys((e.node, e.input_nr) for item in in_b for e in item.weight_edges))
    group = _group_for(graph, checkpointed)

    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    sent = GradSums()
    # A custom Function's backward (a compiled block's too) computes all its
    # gradients at once and may have side effects (e.g. adding into
    # main_grad): B runs it, so keep what it sends to the weight side and never
    # call it again (captured at its weight edges when in `in_b`, else summed
    # by a post-hook). A built-in node is called again in W for its weight
    # part, unless it is in `in_b`: then B captures its weight-side gradients.
    handles = [
        item.node.register_hook(functools.partial(_record_sent, sent, item.weight_edges))
        if is_python_node(item.node)
        else item.node.register_prehook(functools.partial(_record, captured, item.node))
        for item in graph.intermediates
        if item not in in_b
    ]
    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    at_targets: Sequence[torch.Tensor | None] = ()
    try:
        b_roots = [roots[i] for i in graph.input_side_outputs]
        if b_roots and inputs:
            target_leaves = [v for n, _ in targets if (v := leaf_variable(n)) is not None]
            with _entered(group), silenced_tensor_hooks(target_leaves):
                grads = torch.autograd.grad(
                    [r.edge if r.tensor is None else r.tensor for r in b_roots],  # type: ignore[arg-type]
                    [t for _, t in inputs] + [GradientEdge(n, nr) for n, nr in targets],  # type: ignore[operator, misc]
                    [r.grad for r in b_roots],
                    retain_graph=True,  # W still needs the saved tensors of the intermediates
                    allow_unused=True,
                )
            for (i, _), grad in zip(inputs, grads):
                dinputs[i] = grad
            at_targets = grads[len(inputs) :]
    except RuntimeError as exc:
        if "donated_buffer" in str(exc):
            raise SplitBackwardError(
                "a torch.compile'd block in this stage donates its saved buffers (the default), so "
                "its backward can run only once, and a split backward keeps the graph from B "
                "for W. Set torch._functorch.config.donated_buffer = False before compiling "
                "(no parameter gradient has changed)."
            ) from exc
        raise
    finally:
        for handle in handles:
            handle.remove()
    for i in graph.input_side_outputs:
        if leaf_variable(roots[i].edge.node) is None:
            roots[i].edge.node.metadata[_B_DONE] = True  # type: ignore[index]

    for i, tensor in inputs:
        dinput = dinputs[i]
        # Like a fused backward (and torch's B), leaf inputs also get `.grad`.
        # Out of place: the previous `.grad` may be a gradient already handed on.
        if dinput is not None and tensor.is_leaf:
            tensor.grad = dinput if tensor.grad is None else tensor.grad + dinput

    tensors = [r.tensor for r in roots if r.tensor is not None]
    keep: list[torch.Tensor] = []
    if any(is_python_node(n) for n in (*captured, *graph.weight_nodes)):
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
    recorded: list[Recorded] = []
    for (node, nr), at_target in zip(targets, at_targets):
        add_grad(sent, node, nr, at_target)
    kept: list[Kept] = [(grad, node, nr) for (node, nr), grad in sent.items()]
    del sent
    for item in graph.intermediates:
        if item in in_b or is_python_node(item.node):
            continue
        arrived = captured.get(item.node, ())
        if any(g is not None for g in arrived):
            edges = tuple((e.output_index, e.node, e.input_nr) for e in item.weight_edges)
            recorded.append((item.node, arrived, edges))
    handoff = WeightGradHandoff(
        recorded=recorded,
        kept=kept,
        output_roots=[
            (roots[i].edge.node, roots[i].edge.output_nr, roots[i].grad)
            for i in graph.weight_only_outputs
        ],
        weight_nodes=graph.weight_nodes,
        leaf_nodes=list(graph.leaves),
        leaves=list(graph.leaves.values()),
        owners=owners,
        outputs=later,
        keep_alive=keep,
        num_nodes=graph.num_nodes,
        group=group,
    )
    return tuple(dinputs), handoff


def _weight_parts_in_b(graph: StageGraph) -> tuple[set[Intermediate], bool]:
    """The intermediates whose weight-side gradients B computes, captured at their weight
    edges, and whether any of them is checkpointed.

    A built-in intermediate whose saved tensors come back through saved-tensor
    hooks (a checkpointed region) may unpack them once per checkpoint group,
    so W cannot call it again: it must be in B. A custom Function's node runs
    whole in B anyway; capturing its weight edges lets the engine sum what it
    sends there (in place, like a fused backward) instead of a Python hook
    per call. Every intermediate sending into a captured edge joins (the
    capture sums them all).
    """
    checkpointed: set[Intermediate] = set()
    custom: set[Intermediate] = set()
    for item in graph.intermediates:
        if is_python_node(item.node):
            custom.add(item)
        elif has_hooked_saved(item.node):
            checkpointed.add(item)
    if not checkpointed and not custom:
        return set(), False
    senders: dict[tuple[Node, int], list[Intermediate]] = {}
    for item in graph.intermediates:
        for e in item.weight_edges:
            senders.setdefault((e.node, e.input_nr), []).append(item)
    in_b, blocked = _closure(graph, senders, checkpointed)
    if blocked is not None:
        raise SplitBackwardError(
            f"a checkpointed {blocked.name()} on the weight side sends its gradient into the "
            "same node as a checkpointed op that also depends on a stage input: B would run "
            "it while capturing the latter. Use the weight inside the checkpointed region "
            "through one op, or use stage_backward (fused). No gradient has changed."
        )
    custom -= in_b
    if custom:
        with_custom, blocked = _closure(graph, senders, in_b | custom)
        # A weight-only node sending into a captured edge would run in B and
        # again in W; then the custom nodes' weight-side results are summed by
        # a hook during B instead (see _record_sent).
        if blocked is None:
            in_b = with_custom
    return in_b, bool(checkpointed)


def _closure(
    graph: StageGraph,
    senders: dict[tuple[Node, int], list[Intermediate]],
    seed: set[Intermediate],
) -> tuple[set[Intermediate], Node | None]:
    """``seed`` plus every intermediate sending into an edge it sends into (transitively);
    ``senders`` lists the intermediates sending into each weight-side edge.

    Also returns a weight-only node that sends into one of those edges (the
    engine would run it in B, and W would run it again), or None.
    """
    in_b = set(seed)
    if not in_b:
        return in_b, None
    targets: set[tuple[Node, int]] = set()
    pending = list(in_b)
    while pending:
        for e in pending.pop().weight_edges:
            key = (e.node, e.input_nr)
            if key not in targets:
                targets.add(key)
                joining = [item for item in senders[key] if item not in in_b]
                in_b.update(joining)
                pending.extend(joining)
    for node in graph.weight_nodes:
        if any((child, nr) in targets for child, nr in node.next_functions):
            return in_b, node
    return in_b, None


def _group_for(graph: StageGraph, checkpointed: bool) -> Any:
    """A checkpoint group shared by B and W when W will unpack checkpointed tensors, else None."""
    if not checkpointed and not any(has_hooked_saved(n) for n in graph.weight_nodes if not is_python_node(n)):
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
def _entered(group: Any) -> Iterator[None]:
    if group is None:
        yield
    else:
        with group:
            yield


def _refuse_in_place_weight_use(index: int, tensor: torch.Tensor, weight_ids: set[int]) -> None:
    """Refuse a non-leaf stage input that the stage modified in place with one of its parameters.

    B reads the input's gradient edge after the forward, when it is already the
    in-place node (``x.mul_(w)``): the walk would stop there, dropping ``w``'s
    gradient and returning the gradient of the modified value, not of the input.
    Detected when the input's node reaches a parameter within two steps (e.g.
    through ``w.t()``); the previous stage's nodes reach none of this stage's.
    """
    node = tensor.grad_fn
    if node is None:
        return
    frontier = [node]
    for _ in range(2):
        nxt = []
        for current in frontier:
            for child, _ in current.next_functions:
                if child is None:
                    continue
                variable = leaf_variable(child)
                if variable is not None and id(variable) in weight_ids:
                    raise SplitBackwardError(
                        f"input_values[{index}] was modified in place using one of the stage's "
                        f"parameters ({describe(variable)}, through {node.name()}): a split "
                        "backward would drop that parameter's gradient and return the gradient "
                        "of the modified value. Clone the input before modifying it in place "
                        "(x = x.clone()), or use stage_backward (fused)."
                    )
                nxt.append(child)
        frontier = nxt


def _owners(leaves: Iterable[torch.Tensor], weight_ids: set[int]) -> list[tuple[torch.Tensor, ...]]:
    """For each leaf, the tensors a caller may name it by; a leaf none of the weights names is an error."""
    counterparts: dict[int, torch.Tensor] | None = None
    owners: list[tuple[torch.Tensor, ...]] = []
    for leaf in leaves:
        if id(leaf) in weight_ids:
            owners.append((leaf,))
            continue
        if counterparts is None:
            counterparts = fsdp_counterparts()
        other = counterparts.get(id(leaf))
        if other is None or id(other) not in weight_ids:
            raise SplitBackwardError(
                f"the stage's graph accumulates into a {describe(leaf)} that is neither a stage "
                "input nor one of `weights` (nor, for FSDP2, the counterpart of one). Pass every "
                "parameter the stage uses in `weights` (submod.parameters()), or detach the tensor."
            )
        owners.append((leaf, other))
    return owners


def _expect_handoff(param_groups: object) -> WeightGradHandoff:
    if isinstance(param_groups, WeightGradHandoff):
        return param_groups
    if param_groups is None:
        raise SplitBackwardError(
            "stage_backward_weight got no hand-off (None): W needs the value "
            "stage_backward_input returned for this microbatch. Run B first (or, for a stage "
            "whose inputs need no gradient, use stage_backward)."
        )
    if isinstance(param_groups, list):
        raise SplitBackwardError(
            "stage_backward_weight got torch's own param_groups list, i.e. B ran with torch's "
            "stage_backward_input. B and W must come from the same implementation: apply "
            "gradsafe.patch('pipelining') before the schedule's first backward, not between B and W."
        )
    raise SplitBackwardError(
        f"stage_backward_weight expected the WeightGradHandoff returned by stage_backward_input, "
        f"got {type(param_groups).__name__}."
    )


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
            ``retain_graph``, or a weight pass that cannot be computed (saved
            tensors freed). No gradient has changed and no hook has run then,
            and the hand-off is ``FAILED``. A user hook's own exception
            propagates unchanged from the delivery step: parameters whose
            AccumulateGrad ran before it keep their new gradient (their hooks
            ran), the others do not, and the hand-off is ``FAILED``.
    """
    weight_list = _tensor_list(weights, "weights")
    _expect_handoff(param_groups).run(weight_list, retain_graph)
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
    """
    if outputs_with_grads_idxs is not None:
        stage_output = [stage_output[i] for i in outputs_with_grads_idxs]
        output_grads = [output_grads[i] for i in outputs_with_grads_idxs]
    roots: list[_Root] = []
    _collect_roots(stage_output, output_grads, "", roots, output_grads is None)
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
