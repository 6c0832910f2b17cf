"""Whether the installed torch has every internal the split backward relies on."""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from gradsafe.pipelining._torch._engine import backwards_spare, run_backward
from gradsafe.pipelining._torch._hooks import has_other_post_hooks, multi_grad_hook_spans
from gradsafe.pipelining._torch._nodes import call_node, leaf_variable

__all__ = [
    "missing_feature",
]


def missing_feature() -> str | None:
    """The internal autograd feature the split backward needs and this torch lacks, if any.

    Runs on tiny tensors with gradients enabled, whatever the caller's grad mode.
    """
    with torch.enable_grad(), torch.inference_mode(False):
        x = torch.ones(2, device="cpu", requires_grad=True)
        w = torch.ones(2, device="cpu", requires_grad=True)
        node = (x * w).grad_fn
        if node is None:
            return "autograd records no graph here"
        if not hasattr(node, "_input_metadata"):
            return "autograd nodes have no _input_metadata"
        try:
            call_node(node, (torch.ones(2, device="cpu"),))
        except TypeError as exc:
            return f"built-in autograd nodes cannot be called directly ({exc})"
        accumulator = node.next_functions[1][0]
        if accumulator is None or leaf_variable(accumulator) is not w:
            return "AccumulateGrad nodes do not expose their variable"
        try:
            run_backward(
                [GradientEdge(node, 0)], [torch.ones(2, device="cpu")]
            )  # retains the graph
            torch.autograd.grad([GradientEdge(node, 0)], [w], [torch.ones(2, device="cpu")])  # type: ignore[list-item]
        except (TypeError, RuntimeError, AttributeError) as exc:
            return f"the autograd engine does not take GradientEdge roots ({exc})"
        return _missing_hook_introspection(node, x, w) or _missing_sparing()
    return None


def _missing_sparing() -> str | None:
    """Whether :func:`backwards_spare` keeps a backward off a parameter and feeds the other leaf."""
    param = torch.nn.Parameter(torch.ones(2, device="cpu"))
    leaf = torch.ones(2, device="cpu", requires_grad=True)
    try:
        with backwards_spare([param]):
            (param * leaf * 3).sum().backward()
    except (TypeError, RuntimeError, AttributeError) as exc:
        return f"autograd's engine object cannot be wrapped to spare parameters ({exc})"
    if (
        param.grad is not None
        or leaf.grad is None
        or not torch.equal(leaf.grad, param.detach() * 3)
    ):
        return "a backward with inputs= the other leaves still reaches the parameter"
    return None


def _missing_hook_introspection(node: Node, x: torch.Tensor, w: torch.Tensor) -> str | None:
    # Without these, B could not refuse hooks it cannot honour: it would
    # silently give them partial gradients instead.
    first = node.register_hook(lambda grad_inputs, grad_outputs: None)
    second = node.register_hook(lambda grad_inputs, grad_outputs: None)
    try:
        if not has_other_post_hooks(second):
            return "a node's post-hook handles do not expose the node's hook dict"
    except AttributeError as exc:
        return f"a node's post-hook handles do not expose the node's hook dict ({exc})"
    finally:
        first.remove()
        second.remove()
    for mode in ("all", "any"):
        handle = torch.autograd.graph.register_multi_grad_hook(
            (x, w),
            lambda grads: None,
            mode=mode,  # type: ignore[arg-type]
        )
        try:
            spans = multi_grad_hook_spans([x, w])
            joined = list(spans.values()) == [
                (get_gradient_edge(x).node, get_gradient_edge(w).node)
            ]
        finally:
            handle.remove()
        if not joined:
            return f"register_multi_grad_hook(mode={mode!r}) registrations are not recognisable"
    return None
