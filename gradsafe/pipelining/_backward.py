"""Drop-in ``stage_backward_input`` / ``stage_backward_weight`` / ``stage_backward``.

Call-compatible with how ``torch.distributed.pipelining.stage`` calls torch's
own functions (positional arguments, ``(dinputs, param_groups)`` from B, the
``param_groups`` value stored by the schedule and passed back to W), but the
value handed from B to W is a :class:`WeightGradHandoff`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node, get_gradient_edge

from gradsafe.pipelining._graph import analyze, is_python_node
from gradsafe.pipelining._handoff import (
    CapturedIntermediate,
    HandoffState,
    OutputRoot,
    SplitBackwardError,
    WeightGradHandoff,
)
from gradsafe.pipelining._weight_pass import deliver, weight_edge_grads

__all__ = ["stage_backward", "stage_backward_input", "stage_backward_weight"]


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    return list(value)


def _output_pairs(
    stage_outputs_or_loss: torch.Tensor | Sequence[Any], output_grads: Any
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    outputs = _as_list(stage_outputs_or_loss)
    grads = [None] * len(outputs) if output_grads is None else _as_list(output_grads)
    if len(grads) != len(outputs):
        raise SplitBackwardError(
            f"stage_backward_input got {len(outputs)} stage outputs but {len(grads)} output "
            "gradients; pass one gradient (or None) per output, or output_grads=None for a loss."
        )
    pairs = []
    for index, (out, grad) in enumerate(zip(outputs, grads)):
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            continue  # non-tensor outputs and outputs without a graph carry no gradient
        if grad is None:
            if output_grads is not None and out.numel() != 1:
                raise SplitBackwardError(
                    f"stage output {index} requires grad but its output gradient is None, and "
                    "a gradient can only be implied for a single-element output (a loss). Pass "
                    "its gradient, or a zero tensor if it gets none."
                )
            grad = torch.ones_like(out)
        pairs.append((out, grad))
    return pairs


def _record(store: dict[Node, tuple[torch.Tensor | None, ...]], node: Node, grads: Any) -> None:
    store[node] = tuple(grads)


def stage_backward_input(
    stage_outputs_or_loss: torch.Tensor | Sequence[Any],
    output_grads: torch.Tensor | Sequence[torch.Tensor | None] | None,
    input_values: Sequence[Any],
    weights: Iterable[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradHandoff]:
    """B: gradients of the stage inputs only, and a hand-off for :func:`stage_backward_weight`.

    Args:
        stage_outputs_or_loss: the stage's output tensors (or its loss). Entries that
            are not tensors or do not require grad are ignored.
        output_grads: one gradient per output, or None for a loss (ones are used).
        input_values: the stage inputs; those that are tensors requiring grad get gradients.
        weights: the stage's parameters (e.g. ``submod.parameters()``).

    Returns:
        ``(dinputs, handoff)``: ``dinputs[i]`` is the gradient of ``input_values[i]``
        (None for non-tensors, inputs not requiring grad, or unused ones; it is also
        accumulated into the input's ``.grad``, as torch does), and the single-use
        hand-off W needs. No weight gradient is computed here and no parameter hook
        runs. Unlike torch's B, the outputs are not detached in place: a node W
        still needs may have saved an output tensor (a parameter-only output, an
        output that is also used inside the stage), and detaching it would break
        W. The hand-off holds only what W needs; the rest of the graph is freed
        when the caller drops the outputs (the schedule does after W).
    """
    weight_list = list(weights)
    pairs = _output_pairs(stage_outputs_or_loss, output_grads)
    inputs = [
        (i, t) for i, t in enumerate(input_values) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    params = [w for w in weight_list if w.requires_grad]
    out_edges = [get_gradient_edge(out) for out, _ in pairs]
    graph = analyze(out_edges, [get_gradient_edge(t).node for _, t in inputs], params)

    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [
        item.node.register_prehook(functools.partial(_record, captured, item.node))
        for item in graph.intermediates
    ]
    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    try:
        b_pairs = [pairs[i] for i in graph.input_side_outputs]
        if b_pairs and inputs:
            grads = torch.autograd.grad(
                [out for out, _ in b_pairs],
                [t for _, t in inputs],
                [g for _, g in b_pairs],
                retain_graph=True,  # W still needs the saved tensors of the intermediates
                allow_unused=True,
            )
            for (i, _), grad in zip(inputs, grads):
                dinputs[i] = grad
    finally:
        for handle in handles:
            handle.remove()

    for i, tensor in inputs:
        dinput = dinputs[i]
        # Like a fused backward (and torch's B), leaf inputs also get `.grad`.
        # Out of place: the previous `.grad` may be a gradient already handed on.
        if dinput is not None and tensor.is_leaf:
            tensor.grad = dinput if tensor.grad is None else tensor.grad + dinput

    needs_owner = any(is_python_node(item.node) for item in graph.intermediates)
    owners: list[Node] = []
    if needs_owner:
        # A custom Function's node is kept alive only by its C++ parents; a view
        # of each output is a C++ node that owns the whole graph until W ends,
        # even if the caller drops the outputs first.
        with torch.enable_grad():
            owners = [out.view_as(out).grad_fn for out, _ in pairs]  # type: ignore[misc]

    handoff = WeightGradHandoff(
        captured=[
            CapturedIntermediate(item, captured.get(item.node, ()))
            for item in graph.intermediates
            if any(g is not None for g in captured.get(item.node, ()))
        ],
        output_roots=[OutputRoot(out_edges[i], pairs[i][1]) for i in graph.weight_only_outputs],
        params=list(graph.reached_params.values()),
        weight_ids=frozenset(id(w) for w in weight_list),
        owners=owners,
        num_nodes=graph.num_nodes,
    )
    return tuple(dinputs), handoff


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
        weights: the parameters given to B (more are fine; missing ones are an error).
        param_groups: the hand-off B returned (named as in torch's signature).
        retain_graph: keep the saved tensors of the weight-only part of the graph
            (only needed if that part is shared with a later backward).

    Returns:
        The parameters' ``.grad`` after accumulation, in ``weights`` order.

    Raises:
        SplitBackwardError: no hand-off, one from torch's own B, one already used,
            or one made for other parameters. No gradient is changed.
    """
    weight_list = list(weights)
    if not isinstance(retain_graph, bool):
        raise SplitBackwardError(
            f"retain_graph must be a bool, got {type(retain_graph).__name__}; W's third "
            "positional argument is retain_graph, not another hand-off."
        )
    handoff = _expect_handoff(param_groups)
    handoff._claim(weight_list)
    try:
        sums = weight_edge_grads(handoff._captured)
        deliver(sums, handoff._output_roots, handoff._params, retain_graph)
    except RuntimeError as exc:
        handoff._finish(HandoffState.FAILED, f"{type(exc).__name__}: {exc}".splitlines()[0])
        if "second time" in str(exc) or "already been freed" in str(exc):
            raise SplitBackwardError(
                "the weight pass needs saved tensors that were already freed: another backward "
                "ran through this microbatch's graph without retain_graph=True between B and W "
                "(or an earlier W freed a weight-only part this microbatch shares; pass "
                "retain_graph=True to that W)."
            ) from exc
        raise
    handoff._finish(HandoffState.CONSUMED)
    return tuple(w.grad for w in weight_list)


def _flatten_pairs(
    output: Any, grad: Any, out_tensors: list[torch.Tensor], out_grads: list[torch.Tensor | None]
) -> None:
    if isinstance(output, torch.Tensor):
        if not output.requires_grad:
            return
        if not isinstance(grad, (torch.Tensor, type(None))):
            raise TypeError(f"expected a Tensor or None as gradient, got {type(grad).__name__}")
        out_tensors.append(output)
        out_grads.append(grad)
    elif isinstance(output, (tuple, list)):
        if grad is None:
            return
        if not isinstance(grad, (tuple, list)) or len(grad) != len(output):
            raise TypeError("stage output and output gradient structures differ")
        for out_item, grad_item in zip(output, grad):
            _flatten_pairs(out_item, grad_item, out_tensors, out_grads)
    elif isinstance(output, dict):
        if grad is None:
            return
        if not isinstance(grad, dict) or set(grad) != set(output):
            raise TypeError("stage output and output gradient dicts have different keys")
        for key in output:
            _flatten_pairs(output[key], grad[key], out_tensors, out_grads)


def stage_backward(
    stage_output: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    outputs_with_grads_idxs: list[int] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """A fused backward for one stage: parameters accumulate, input gradients are returned.

    Same contract as torch's ``stage_backward``: nested tuples/lists/dicts of
    outputs are matched with their gradients, non-tensor outputs ignored; each
    tensor input's gradient is returned and its ``.grad`` cleared.
    ``outputs_with_grads_idxs`` (deprecated upstream) selects outputs by index.
    """
    if outputs_with_grads_idxs is not None:
        stage_output = [stage_output[i] for i in outputs_with_grads_idxs]
        output_grads = [output_grads[i] for i in outputs_with_grads_idxs]
    out_tensors: list[torch.Tensor] = []
    out_grads: list[torch.Tensor | None] = []
    _flatten_pairs(stage_output, output_grads, out_tensors, out_grads)
    torch.autograd.backward(out_tensors, grad_tensors=out_grads)  # type: ignore[arg-type]
    grads: list[torch.Tensor | None] = []
    for value in input_values:
        if isinstance(value, torch.Tensor):
            grads.append(value.grad)
            value.grad = None  # the gradient is sent on; do not keep it alive here
        else:
            grads.append(None)
    return tuple(grads)
