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

from gradsafe.pipelining._graph import Intermediate, StageGraph, analyze
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
    donates_buffers,
    has_hooked_saved,
    has_other_post_hooks,
    is_reentrant_checkpoint,
    multi_grad_hook_cells,
    silenced_tensor_hooks,
    fsdp_counterparts,
    input_meta,
    is_python_node,
    is_view,
    leaf_variable,
    missing_feature,
    runs_whole,
)
from gradsafe.pipelining._weight_pass import Kept, Recorded

__all__ = ["stage_backward", "stage_backward_input", "stage_backward_weight"]


_B_DONE = object()  # key in Node.metadata: B already ran from this node

_DONATED = (
    "a torch.compile'd block in this stage donates its saved buffers (the default), so its "
    "backward can run only once, and a split backward keeps the graph from B for W. Set "
    "torch._functorch.config.donated_buffer = False before compiling (no parameter gradient "
    "has changed)."
)

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


def _record(
    store: dict[Node, tuple[torch.Tensor | None, ...]], node: Node, grad_inputs: Any, grad_outputs: Any
) -> None:
    # A post hook: what arrived, after every pre-hook and tensor hook changed it.
    store[node] = tuple(grad_outputs)


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
        single-use hand-off W needs. No parameter hook runs here, and weight
        gradients are computed only where W cannot compute them: for
        checkpointed or offloaded ops and custom Functions that depend on a
        stage input, with the weight side they reach (kept for W, which
        delivers them). Like torch's B, the outputs are detached in place,
        except those another node of the stage consumes (a node W calls may
        have saved one): W detaches those.

    Raises:
        SplitBackwardError: malformed outputs or gradients, B already run from
            these outputs, a parameter passed as a stage input, a non-leaf input
            modified in place with a parameter, a leaf in the graph that is
            none of ``weights``, a post hook on a node that depends on both a
            stage input and a parameter, or a ``register_multi_grad_hook``
            spanning a stage input and a parameter. Nothing has changed then.
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
    _refuse_multi_grad_hooks_across(inputs, weight_list)
    graph = analyze([r.edge for r in roots], [get_gradient_edge(t).node for _, t in inputs])
    owners = _owners(graph.leaves.values(), weight_ids)

    for node in (*(item.node for item in graph.intermediates), *graph.weight_nodes):
        if donates_buffers(node):
            raise SplitBackwardError(_DONATED)
    for node in graph.weight_nodes:
        if is_reentrant_checkpoint(node):
            raise SplitBackwardError(
                "a torch.utils.checkpoint region with use_reentrant=True is on this stage's "
                "weight side; its backward refuses torch.autograd.grad, which B or W runs it "
                "under. Use use_reentrant=False (or checkpoint_wrapper's non-reentrant mode), "
                "or stage_backward (fused). No gradient has changed."
            )
    in_b, in_k, has_checkpoints = _weight_parts_in_b(graph)
    k_leaves = [n for n in graph.leaves if n in in_k]
    k_outputs = {i for i in graph.weight_only_outputs if roots[i].edge.node in in_k}
    group = _group_for(has_checkpoints)

    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
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
            if has_other_post_hooks(handle):
                raise SplitBackwardError(
                    f"a post hook is registered on {item.node.name()}, an autograd node of this "
                    "stage that depends on both a stage input and a parameter (Node.register_hook, "
                    "or the deprecated Module.register_backward_hook): a split backward computes "
                    "its input and weight gradients in separate passes, so the hook cannot see "
                    "them together as in a fused backward. Register a tensor hook on the "
                    "activation or the parameter, or Module.register_full_backward_hook, instead; "
                    "or use stage_backward (fused). No gradient has changed."
                )
        # A weight-only output whose node is in `in_k` is one of B's roots, so
        # that node gets its whole gradient in B. The accumulators in `in_k`
        # are captured, not run: their gradients go to W's delivery, and their
        # tensor hooks (which the engine runs at a capture) run there, once.
        b_roots = [roots[i] for i in (*graph.input_side_outputs, *sorted(k_outputs))]
        if b_roots and inputs:
            with _entered(group), silenced_tensor_hooks([graph.leaves[n] for n in k_leaves]):
                grads = torch.autograd.grad(
                    [r.edge if r.tensor is None else r.tensor for r in b_roots],  # type: ignore[arg-type]
                    [t for _, t in inputs] + [GradientEdge(n, 0) for n in k_leaves],  # type: ignore[operator, misc]
                    [r.grad for r in b_roots],
                    retain_graph=True,  # W still needs the saved tensors of the intermediates
                    allow_unused=True,
                )
            for (i, _), grad in zip(inputs, grads):
                dinputs[i] = grad
            at_leaves = grads[len(inputs) :]
    except RuntimeError as exc:
        if "donated_buffer" in str(exc):  # a compiled block without parameters
            raise SplitBackwardError(
                _DONATED + " (Custom backwards that ran before it in B may have had side effects.)"
            ) from exc
        if "_will_engine_execute_node" in str(exc):
            raise SplitBackwardError(
                "a torch.autograd.graph.register_multi_grad_hook(mode='all') on this stage's "
                "tensors (also what FlopCounterMode and ModuleTracker register per module) cannot "
                "run under torch.autograd.grad, which a split backward's B runs (torch's own B "
                "fails the same way). Use stage_backward (fused) while such a hook or mode is "
                "active. No parameter or input gradient has changed."
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
    w_nodes = [n for n in graph.weight_nodes if n not in in_k]
    if any(is_python_node(n) for n in w_nodes):
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
    kept: list[Kept] = [(grad, node, 0) for node, grad in zip(k_leaves, at_leaves) if grad is not None]
    for item in graph.intermediates:
        if item in in_b:
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
            if i not in k_outputs
        ],
        weight_nodes=w_nodes,
        leaf_nodes=list(graph.leaves),
        leaves=list(graph.leaves.values()),
        owners=owners,
        outputs=later,
        keep_alive=keep,
        num_nodes=graph.num_nodes,
        group=group,
    )
    return tuple(dinputs), handoff


def _weight_parts_in_b(graph: StageGraph) -> tuple[set[Intermediate], set[Node], bool]:
    """The intermediates B runs whole, ``K`` (the weight side B computes with them), and
    whether the stage has checkpointed (or offloaded) built-in nodes.

    A custom Function's node computes all its gradients in one call (B runs
    it, so W must not again), and a built-in intermediate whose saved tensors
    come back through saved-tensor hooks (checkpointing, offloading) may
    unpack them once per checkpoint group: W cannot call either. ``K`` is
    every weight-side node (accumulators included) below their weight edges,
    closed so that nothing outside it sends into it: an intermediate with a
    weight edge into ``K`` joins them (and what lies below its weight edges
    joins ``K``), and so does a weight-only node with a child in ``K``. B's
    engine then runs each node of ``K`` once, with its complete gradient, and
    W runs none of them; nothing W runs reaches ``K``.
    """
    # A custom Function's own saved tensors never matter here: B runs it whole
    # and nothing unpacks them again.
    in_b = {item for item in graph.intermediates if runs_whole(item.node)}
    checkpointed = {
        item for item in graph.intermediates if item not in in_b and has_hooked_saved(item.node)
    }
    in_b |= checkpointed
    in_k: set[Node] = set()
    # A checkpointed (or offloaded) weight-only node joins K too: its region
    # then recomputes in B's engine call, in the order a fused backward
    # recomputes regions (dropout with preserve_rng_state=False draws the same
    # masks), never in W after all of B's.
    hooked = [n for n in graph.weight_nodes if has_hooked_saved(n)]
    has_checkpoints = bool(checkpointed or hooked)
    if not graph.intermediates:
        # B computes no weight part at all: W runs the whole weight side.
        return in_b, in_k, has_checkpoints
    if not in_b and not hooked:
        return in_b, in_k, has_checkpoints
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
    return in_b, in_k, has_checkpoints


def _group_for(has_checkpoints: bool) -> Any:
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


def _refuse_multi_grad_hooks_across(
    inputs: Sequence[tuple[int, torch.Tensor]], weights: Sequence[torch.Tensor]
) -> None:
    """Refuse a ``register_multi_grad_hook`` spanning a stage input and a parameter.

    B computes the input's gradient and W the parameter's, in two engine
    passes: mode ``"any"`` would fire once in each, mode ``"all"`` cannot
    collect both (torch's own B crashes in it).
    """
    if not inputs:
        return
    input_cells: set[int] = set()
    for _, t in inputs:
        input_cells |= multi_grad_hook_cells(t)
    if not input_cells:
        return
    for w in weights:
        if input_cells & multi_grad_hook_cells(w):
            raise SplitBackwardError(
                f"a torch.autograd.graph.register_multi_grad_hook spans a stage input and a "
                f"{describe(w)}: a split backward gives them gradients in separate passes (B and "
                "W), so the hook would fire twice (mode 'any') or never see both (mode 'all'). "
                "Register it over the parameters only, or over the inputs only; or use "
                "stage_backward (fused). No gradient has changed."
            )


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
            tensors freed, or a hook on a weight-side node or tensor raised).
            No parameter gradient has changed then (only hooks on weight-side
            nodes and tensors may have run), and the hand-off is ``FAILED``.
            A parameter hook's own exception
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
