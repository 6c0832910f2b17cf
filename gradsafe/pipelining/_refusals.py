"""What a split backward refuses, each with its cause and fix; nothing has changed when one is raised.

B refuses before running anything (malformed inputs, parameters passed as
inputs, in-place use of a parameter on an input, hooks a split backward cannot
honour, compiled blocks already compiled donating buffers, reentrant
checkpoints, saved-tensor hooks that keep a node's output alive, leaves that
are none of the weights), and right after its engine call a post hook
registered meanwhile; W refuses a hand-off it cannot use.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

from gradsafe._torch_support import SUPPORTED_TORCH
from gradsafe.pipelining._graph import StageGraph
from gradsafe.pipelining._handoff import SplitBackwardError, WeightGradHandoff, describe
from gradsafe.pipelining._torch import (
    DONATED_BUFFERS,
    DONATED_BUFFERS_FROM_CACHE,
    backward_from_cache,
    donates_buffers,
    engine_error,
    fsdp_counterparts,
    fsdp_reducing_in_backward,
    has_other_post_hooks,
    is_python_kind,
    is_reentrant_checkpoint,
    leaf_variable,
    missing_feature,
    multi_grad_hook_spans,
    refusable_kind,
    saves_itself,
)

__all__ = [
    "expect_handoff",
    "leaf_owners",
    "refuse_engine_error",
    "refuse_fsdp_reduction_in_b",
    "refuse_inputs",
    "refuse_other_post_hooks",
    "refuse_post_hooks_added_in_b",
    "refuse_weight_side",
    "require_features",
    "require_input_list",
]


@functools.cache
def _missing_feature() -> str | None:
    return missing_feature()  # depends only on the installed torch: probed once


def require_features() -> None:
    """Refuse, on the first B, a torch whose autograd internals the split backward cannot use.

    ``gradsafe.patch("pipelining")`` turns the same probe into a skip; this
    covers the functions imported directly.
    """
    missing = _missing_feature()
    if missing is not None:
        raise SplitBackwardError(
            f"gradsafe's split backward cannot run on torch {torch.__version__}: {missing}. "
            "Use torch's own stage_backward_input/stage_backward_weight on this torch, or a "
            f"torch gradsafe supports ({SUPPORTED_TORCH})."
        )


def require_input_list(input_values: object) -> None:
    """Refuse ``input_values`` that is not a tuple or list (a single tensor, a generator)."""
    if not isinstance(input_values, (tuple, list)):
        raise SplitBackwardError(
            f"input_values must be a tuple or list of the stage inputs, got "
            f"{type(input_values).__name__}."
        )


def refuse_inputs(
    inputs: Sequence[tuple[int, torch.Tensor]],
    input_nodes: set[Node],
    weights: Sequence[torch.Tensor],
) -> None:
    """Refuse stage inputs a split backward cannot give exact gradients (``input_nodes``: their gradient-edge nodes)."""
    weight_ids = {id(w) for w in weights}
    for i, t in inputs:
        if id(t) in weight_ids:
            raise SplitBackwardError(
                f"input_values[{i}] is also one of the stage's parameters; a split backward "
                "cannot give it one gradient with its hooks run once. Pass a copy of it as the "
                "stage input, or use stage_backward (fused)."
            )
    for i, t in inputs:
        _refuse_in_place_weight_use(i, t, weight_ids)
    _refuse_multi_grad_hooks_across(inputs, input_nodes, weights)


def refuse_weight_side(graph: StageGraph, input_nodes: set[Node]) -> None:
    """Refuse compiled blocks already compiled donating buffers, reentrant checkpoints anywhere
    in the stage, and saved-tensor hooks that pack a node's own output as itself."""
    # The kinds in one pass at C speed; node by node only those that may be refused.
    kinds = set(map(type, graph.nodes))
    if any(map(is_python_kind, kinds)):
        # Only a custom Function's node (a compiled block's) may donate buffers.
        for node in (*(item.node for item in graph.intermediates), *graph.weight_nodes):
            if donates_buffers(node):
                raise SplitBackwardError(
                    DONATED_BUFFERS_FROM_CACHE if backward_from_cache(node) else DONATED_BUFFERS
                )
    suspects = {kind for kind in kinds if refusable_kind(kind)}
    if not suspects:
        return
    weight_side = set(graph.weight_nodes)
    for node in graph.nodes:
        if type(node) not in suspects or node in input_nodes:
            continue  # the previous stage's node: B captures there and never runs it
        if is_reentrant_checkpoint(node):
            side = "weight" if node in weight_side else "input"
            raise SplitBackwardError(
                f"a torch.utils.checkpoint region with use_reentrant=True is on this stage's {side} "
                "side; its "
                'backward refuses torch.autograd.grad ("call .backward() without passing the '
                "inputs argument\"), which B and W run it under, and torch's own split fails the "
                "same way. Use use_reentrant=False (or checkpoint_wrapper's non-reentrant mode), "
                "or stage_backward (fused). No gradient has changed."
            )
        if saves_itself(node):
            raise SplitBackwardError(
                f"{node.name()} saved its own output through saved-tensor hooks that pack a "
                "tensor as itself (identity hooks, or save_on_cpu on a CPU tensor): the tensor "
                "and the node keep each other alive until the engine frees the saved tensors, "
                "which a fused backward does and a split backward cannot (B and W keep the "
                "graph), so the microbatch's graph and activations would stay alive after W, "
                "every step. Pack a copy or a handle instead (save_on_cpu does for accelerator "
                "tensors), leave CPU tensors unhooked, or use stage_backward (fused). No "
                "gradient has changed."
            )


def refuse_other_post_hooks(handle: Any, node: Node) -> None:
    """Refuse a user's post hook on ``node`` (an intermediate W calls again); ``handle`` is B's own."""
    if has_other_post_hooks(handle):
        raise SplitBackwardError(
            f"a post hook is registered on {node.name()}, an autograd node of this "
            "stage that depends on both a stage input and a parameter (Node.register_hook, "
            "or the deprecated Module.register_backward_hook): a split backward computes "
            "its input and weight gradients in separate passes, so the hook cannot see "
            "them together as in a fused backward. Register a tensor hook on the "
            "activation or the parameter, or Module.register_full_backward_hook, instead; "
            "or use stage_backward (fused). No gradient has changed."
        )


def refuse_post_hooks_added_in_b(handles: Sequence[Any]) -> None:
    """Refuse a post hook registered, while B's engine call ran, on an intermediate W calls again
    (``handles``: B's own recording hooks on them)."""
    if any(has_other_post_hooks(handle) for handle in handles):
        raise SplitBackwardError(
            "a post hook was registered, while B ran (by another hook), on an autograd node of "
            "this stage that depends on both a stage input and a parameter: it ran in B without "
            "the weight half of its gradients, which W computes in a separate pass. Register it "
            "before the backward on a tensor (the activation or the parameter) instead, or use "
            "stage_backward (fused). No parameter or input gradient has changed (hooks that "
            "ran in B ran)."
        )


def refuse_engine_error(exc: RuntimeError) -> None:
    """Turn a known failure of B's engine call into an error naming its fix (others: return)."""
    kind = engine_error(exc)
    if kind == "donated_buffer":  # a compiled block without parameters
        raise SplitBackwardError(
            DONATED_BUFFERS
            + " If no backward of it ran in this process, that backward was loaded from "
            "AOTAutograd's on-disk cache (under TORCHINDUCTOR_CACHE_DIR) as an earlier process "
            "compiled it: run with TORCHINDUCTOR_AUTOGRAD_CACHE=0 or delete that cache entry, or "
            "set donated_buffer = False as above."
            + " (Custom backwards that ran before it in B may have had side effects.)"
        ) from exc
    if kind == "reentrant_checkpoint":  # on the input side: the weight side is refused before
        raise SplitBackwardError(
            "a torch.utils.checkpoint region with use_reentrant=True is on this stage's input "
            "side; its backward refuses torch.autograd.grad, which B runs it under (and it "
            "would accumulate the parameter gradients inside it during B). Use "
            "use_reentrant=False (or checkpoint_wrapper's non-reentrant mode), or "
            "stage_backward (fused). No parameter or input gradient has changed."
        ) from exc
    if kind == "multi_grad_hook_all":
        raise SplitBackwardError(
            "a torch.autograd.graph.register_multi_grad_hook(mode='all') on this stage's "
            "tensors (also what FlopCounterMode and ModuleTracker register per module) cannot "
            "run under torch.autograd.grad, which a split backward's B runs (torch's own B "
            "fails the same way). Use stage_backward (fused) while such a hook or mode is "
            "active. No parameter or input gradient has changed."
        ) from exc


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
    inputs: Sequence[tuple[int, torch.Tensor]],
    input_nodes: set[Node],
    weights: Sequence[torch.Tensor],
) -> None:
    """Refuse a ``register_multi_grad_hook`` on a stage input or parameter that spans anything else.

    B computes the inputs' gradients and W the parameters', and W reaches the
    weight-only side and the parameters in two engine passes: a registration
    over an input and anything but inputs, or over a parameter and anything
    but leaves (non-leaf tensors computed from parameters, activations),
    would fire twice (mode ``"any"``) or see only part of its gradients
    (mode ``"all"``) where a fused backward fires once with all of them.
    Registrations over inputs only (B) or leaves only (W's delivery) are exact.
    """
    tensors = [t for _, t in inputs] + [w for w in weights if w.requires_grad]
    for nodes in multi_grad_hook_spans(tensors).values():
        if all(n in input_nodes for n in nodes):
            continue
        leaves = [
            n is not None and n not in input_nodes and leaf_variable(n) is not None for n in nodes
        ]
        if all(leaves):
            continue
        what = (
            "a stage input and a parameter"
            if any(leaves) and any(n in input_nodes for n in nodes)
            else "a stage input or a parameter and a non-leaf tensor (an activation, or a "
            "tensor computed from parameters such as w * 2)"
        )
        raise SplitBackwardError(
            f"a torch.autograd.graph.register_multi_grad_hook spans {what}: a split backward "
            "gives them gradients in separate engine passes (B, then W's weight-only pass and "
            "its delivery to the parameters), so the hook would fire twice (mode 'any') or see "
            "only part of its gradients (mode 'all'). Register it over the stage inputs only, "
            "or over parameters only; or use stage_backward (fused). No gradient has changed."
        )


def leaf_owners(
    leaves: Iterable[torch.Tensor], weight_ids: set[int], *, loss: bool
) -> list[tuple[torch.Tensor, ...]]:
    """For each leaf, the tensors a caller may name it by; a leaf none of the weights names is an error.

    ``loss``: B started from a loss (no output gradients), as a schedule's last
    stage does; its graph includes the schedule's ``loss_fn``.
    """
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
            if loss:
                raise SplitBackwardError(
                    f"the loss accumulates into a {describe(leaf)} that is neither a stage input "
                    "nor one of `weights`: on a pipeline's last stage, a parameter used only by "
                    "the schedule's loss_fn (e.g. an nn.Module loss with a learned scale or "
                    "class weights), which the schedule does not pass as the stage's parameters. "
                    "Move that part of the loss into the last stage's module, so the parameter "
                    "is one of submod.parameters(); or use it detached (or with "
                    "requires_grad=False) in loss_fn. No gradient has changed."
                )
            raise SplitBackwardError(
                f"the stage's graph accumulates into a {describe(leaf)} that is neither a stage "
                "input nor one of `weights` (nor, for FSDP2, the counterpart of one). Pass every "
                "parameter the stage uses in `weights` (submod.parameters()), or detach the tensor."
            )
        owners.append((leaf, other))
    return owners


def refuse_fsdp_reduction_in_b(leaves: Iterable[torch.Tensor]) -> None:
    """Refuse a stage whose FSDP2 modules reduce gradients in their backward hook, which fires in B.

    FSDP2 reduce-scatters (and may reshard) when the gradient reaches a module's
    inputs: in B, before W computes the weight gradients, which would then be
    left on the unsharded parameters and never reduced (a silent wrong gradient).
    """
    param = fsdp_reducing_in_backward({id(leaf) for leaf in leaves})
    if param is None:
        return
    raise SplitBackwardError(
        f"the stage's FSDP2 module that owns a {describe(param)} reduces its gradients in its "
        "backward hook (requires_gradient_sync is on), which fires in B, before W computes the "
        "weight gradients: they would never be reduced. Call "
        "set_requires_gradient_sync(False) and set_reshard_after_backward(False) on the stage's "
        "FSDP2 modules before B (torch's PipelineStage does), and reduce after the last W (the "
        "stage's post-backward finalization does). No gradient has changed."
    )


def expect_handoff(param_groups: object) -> WeightGradHandoff:
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
