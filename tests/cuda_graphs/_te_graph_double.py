"""A CPU-runnable double of TransformerEngine's ``transformer_engine/pytorch/graph.py`` (TE needs a GPU).

Tests copy this file into a fake ``transformer_engine.pytorch`` package and run
it under ``gradsafe.testing.emulate_cuda_graphs``. It follows the non-``_order``
path of TE's ``_make_graphed_callables`` as of NVIDIA/TransformerEngine commit
a6c70f4dc ("Fix CUDA graph parameter grad lifetime (#2937)", 2026-07-30; the
same code on release_v2.19 b44757633 and main d0067d0da, absent from every tag
up to v2.18), keeping what decides whether a parameter's ``.grad`` aliases a
static buffer and the structure gradsafe's patch reads:

* ``_make_graphed_callables(callables, sample_args, *, ...,
  clone_param_grads_on_return=True, ...)`` behind the public
  ``make_graphed_callables``, which looks it up as a module global;
* warm-up drops module parameters that get no gradient from the input surface
  (``_run_warmup_backward``);
* the backward graph is captured with ``torch.autograd.backward`` and the
  inputs' ``.grad`` set to None, the static gradients read back from ``.grad``;
* ``_returned_param_grad_clone_slots``: the slots of module parameters are
  cloned on return unless the parameter has ``skip_backward_post_hook``, or
  ``clone_param_grads_on_return`` is False (TE's rule, verbatim);
* ``Graphed(torch.autograd.Function)`` is defined in
  ``make_graphed_autograd_function``; its ``forward(ctx, skip_fp8_weight_update,
  cuda_graph_stream, cuda_graph_event, *inputs)`` replays the forward graph,
  its ``once_differentiable`` ``backward`` closes over ``static_grad_inputs``
  and ``returned_param_grad_clone_slots`` and returns ``(None, None, None) +``
  one gradient per input: ``grad.detach().clone()`` where the slot is cloned,
  ``grad.detach()`` elsewhere;
* ``functionalized`` closes over ``Graphed`` and ``module_params``; a module's
  ``forward`` becomes ``new_fwd``, a closure over ``graphed`` (functionalized).

* with ``_order`` (Megatron-core's pipeline capture) a module's graphed
  ``forward`` itself is returned instead of the module.

Left out (not involved in gradient ownership): FP8, the capture order
``_order`` describes and buffer reuse, kwargs, streams and events,
capture-time hooks, ``backward_dw``.
"""

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__version__ = "2.19.0+double"


def _make_graphed_callables(
    callables,
    sample_args,
    *,
    num_warmup_iters=3,
    allow_unused_input=False,
    _order=None,
    clone_param_grads_on_return=True,
):
    just_one_callable = not isinstance(callables, tuple)
    if just_one_callable:
        callables, sample_args = (callables,), (sample_args,)
    flatten_sample_args = [tuple(tree_flatten(args)[0]) for args in sample_args]
    per_callable_module_params = [tuple(c.parameters()) for c in callables]
    surfaces = [a + p for a, p in zip(flatten_sample_args, per_callable_module_params)]

    def _returned_param_grad_clone_slots(static_grad_inputs, module_params):
        if not clone_param_grads_on_return:
            return (False,) * len(static_grad_inputs)
        module_param_start = len(static_grad_inputs) - len(module_params)
        return tuple(
            idx >= module_param_start
            and not getattr(
                module_params[idx - module_param_start], "skip_backward_post_hook", False
            )
            for idx in range(len(static_grad_inputs))
        )

    for func_idx, func in enumerate(callables):
        for warmup_iter in range(num_warmup_iters):
            outputs = tree_flatten(func(*sample_args[func_idx]))[0]
            inputs = tuple(i for i in surfaces[func_idx] if i.requires_grad)
            saved = [i.grad for i in inputs]
            for i in inputs:
                i.grad = None
            torch.autograd.backward(
                tuple(o for o in outputs if o.requires_grad),
                grad_tensors=tuple(torch.empty_like(o) for o in outputs if o.requires_grad),
            )
            grad_inputs = tuple(i.grad for i in inputs)
            for i, g in zip(inputs, saved):
                i.grad = g
            num_args = sum(a.requires_grad for a in flatten_sample_args[func_idx])
            with_grad = tuple(
                p for p, g in zip(inputs[num_args:], grad_inputs[num_args:]) if g is not None
            )
            if len(with_grad) != len(per_callable_module_params[func_idx]):
                if warmup_iter != 0:
                    raise RuntimeError("no-grad params only in the first warmup iteration")
                per_callable_module_params[func_idx] = with_grad
                surfaces[func_idx] = flatten_sample_args[func_idx] + with_grad

    ret = []
    for func_idx, func in enumerate(callables):
        fwd_graph, bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd_graph):
            outputs = func(*sample_args[func_idx])
        static_outputs, spec = tree_flatten(outputs)
        static_outputs = tuple(static_outputs)
        static_grad_outputs = tuple(
            torch.empty_like(o) if o.requires_grad else None for o in static_outputs
        )
        inputs = tuple(i for i in surfaces[func_idx] if i.requires_grad)
        saved = [i.grad for i in inputs]
        for i in inputs:
            i.grad = None
        with torch.cuda.graph(bwd_graph):
            torch.autograd.backward(
                tuple(o for o in static_outputs if o.requires_grad),
                grad_tensors=tuple(g for g in static_grad_outputs if g is not None),
            )
            grad_inputs = tuple(i.grad for i in inputs)
        for i, g in zip(inputs, saved):
            i.grad = g
        grad_iter = iter(grad_inputs)
        static_grad_inputs = tuple(
            next(grad_iter) if a.requires_grad else None for a in surfaces[func_idx]
        )
        clone_slots = _returned_param_grad_clone_slots(
            static_grad_inputs, per_callable_module_params[func_idx]
        )
        graphed = _make_graphed_autograd_function(
            fwd_graph,
            bwd_graph,
            per_callable_module_params[func_idx],
            len(flatten_sample_args[func_idx]),
            spec,
            surfaces[func_idx],
            static_outputs,
            static_grad_outputs,
            static_grad_inputs,
            clone_slots,
        )
        if isinstance(func, torch.nn.Module):

            def make_graphed_forward(func, graph_training_state, graphed, orig_fwd):
                def new_fwd(*user_args):
                    if func.training == graph_training_state:
                        return graphed(*user_args)
                    return orig_fwd(*user_args)

                return new_fwd

            forward = make_graphed_forward(func, func.training, graphed, func.forward)
            if _order is None:
                func.forward = forward
                ret.append(func)
            else:
                ret.append(forward)
        else:
            ret.append(graphed)
    return ret[0] if just_one_callable else tuple(ret)


def _make_graphed_autograd_function(
    fwd_graph,
    bwd_graph,
    module_params,
    len_user_args,
    output_unflatten_spec,
    static_input_surface,
    static_outputs,
    static_grad_outputs,
    static_grad_inputs,
    returned_param_grad_clone_slots,
):
    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, skip_fp8_weight_update, cuda_graph_stream, cuda_graph_event, *inputs):
            for i in range(len_user_args):
                if static_input_surface[i].data_ptr() != inputs[i].data_ptr():
                    static_input_surface[i].copy_(inputs[i])
            fwd_graph.replay()
            return tuple(o.detach() for o in static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            for g, grad in zip(static_grad_outputs, grads):
                if g is not None and g.data_ptr() != grad.data_ptr():
                    g.copy_(grad)
            bwd_graph.replay()
            grad_inputs = []
            for idx, grad_input in enumerate(static_grad_inputs):
                if grad_input is None:
                    grad_inputs.append(None)
                elif returned_param_grad_clone_slots[idx]:
                    grad_inputs.append(grad_input.detach().clone())
                else:
                    grad_inputs.append(grad_input.detach())
            return (None, None, None) + tuple(grad_inputs)

    def functionalized(*user_args):
        func_args = tuple(tree_flatten(user_args)[0]) + module_params
        out = Graphed.apply(None, None, None, *func_args)
        return tree_unflatten(list(out), output_unflatten_spec)

    return functionalized


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters=3,
    allow_unused_input=False,
    _order=None,
    clone_param_grads_on_return=True,
):
    # TE's public function: module checks, FP8 wrapping and RNG handling around
    # a call of the module global _make_graphed_callables.
    return _make_graphed_callables(
        modules,
        sample_args,
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input,
        _order=_order,
        clone_param_grads_on_return=clone_param_grads_on_return,
    )
