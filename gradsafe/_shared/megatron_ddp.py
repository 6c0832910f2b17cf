"""Megatron-core's gradient delivery without Megatron, for testing weight-gradient kernels.

Public as :class:`gradsafe.testing.MegatronStyleDDP`; it lives here, below
both, because the wgrad capability's H4 reproduction runs under it too (and
:func:`gradsafe.wgrad.megatron.module_of` gives it a model over bare
parameters).

:class:`MegatronStyleDDP` gives a module's parameters what Megatron-core's
``DistributedDataParallel`` (0.19.2, read and run side by side in
``tests/wgrad/test_megatron_real.py``) gives them, with a plain all-reduce
for its bucketed communication:

* ``param.main_grad``: fp32 with ``grad_reduce_in_fp32``, else the
  parameter's dtype; ``grad_added_to_main_grad = False`` on every parameter;
* one hook per parameter: under ``overlap_grad_reduce`` it raises
  ``AssertionError`` if ``.grad`` is None; it adds ``.grad`` into
  ``main_grad`` unless ``grad_added_to_main_grad`` is set (or
  ``zero_out_wgrad`` is set, which makes it add regardless), then clears
  ``.grad``;
* the hook's route: for a parameter with ``skip_backward_post_hook`` under
  ``delay_wgrad_compute``, ``register_wgrad_accumulation_and_reduce_hooks(hook)``
  of every module that holds it (none: no hook at all); otherwise a post-hook
  on its AccumulateGrad node (``p.expand_as(p).grad_fn.next_functions[0][0]``);
* :meth:`~MegatronStyleDDP.zero_grad_buffer` zeroes ``main_grad`` and resets
  the flag, and leaves ``.grad`` as it is;
* the reduction, :meth:`~MegatronStyleDDP.start_grad_sync` and
  :meth:`~MegatronStyleDDP.finish_grad_sync`: ``main_grad`` scaled by
  1/world, then summed over the default process group (where one is
  initialised), as Megatron's all-reduce does; :func:`gradsafe.wgrad.guard_ddp_step`
  guards these and ``zero_grad_buffer`` as it guards Megatron's.

Where it differs from Megatron: no buckets, no ``no_sync`` and no grad-ready
counting (``overlap_grad_reduce`` only adds the assert; the reduction runs
once per step, at the first of the two calls, never from a hook); hooks
return at once only inside :meth:`~MegatronStyleDDP.graph_capture` (Megatron's
own capture flag, which it sets around its CUDA-graph capture); it does not
wrap ``forward``; ``grad_added_flag=False`` (no flag) is not a Megatron mode.

Every hook call is recorded (:class:`HookCall`), so a test can check what
Megatron would only notice later: the final ``main_grad`` against plain
autograd, the number of hook calls (one per parameter per microbatch), that no
hook ran before its gradient was complete (``main_grad`` after each call), the
thread it ran on, and whether ``.grad`` was None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["DDPConfig", "HookCall", "MegatronStyleDDP"]


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """The switches of Megatron-core's ``DistributedDataParallelConfig`` that :class:`MegatronStyleDDP` follows."""

    overlap_grad_reduce: bool = False
    grad_reduce_in_fp32: bool = False
    delay_wgrad_compute: bool = False


@dataclasses.dataclass(frozen=True)
class HookCall:
    """One call of a parameter's gradient hook."""

    thread: int  # threading.get_ident() of the thread it ran on
    grad_was_none: bool  # .grad was None when the hook ran
    # A copy of main_grad right after the call (None: snapshots off).
    main_grad_after: torch.Tensor | None


def _grad_accumulator(p: torch.Tensor) -> torch.autograd.graph.Node:
    # Megatron's way to reach a leaf's AccumulateGrad node.
    view_fn = p.expand_as(p).grad_fn
    node = None if view_fn is None else view_fn.next_functions[0][0]
    if node is None:
        raise ValueError("MegatronStyleDDP: every parameter must be a leaf that requires grad")
    return node


class MegatronStyleDDP:
    """Megatron-core's ``main_grad`` buffers and gradient hooks over ``module`` (its reduction a plain all-reduce).

    Args:
        module: the model; every parameter that requires grad is managed.
        overlap_grad_reduce, grad_reduce_in_fp32, delay_wgrad_compute: as in
            Megatron-core's ``DistributedDataParallelConfig`` (same defaults).
        grad_added_flag: give every parameter ``grad_added_to_main_grad``
            (Megatron does). With False, only parameters that already have it
            keep it (other wrappers' behaviour; not Megatron's).
        snapshots: copy ``main_grad`` at each hook call into
            :attr:`HookCall.main_grad_after`; turn off to time a kernel under
            the hook without that copy.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        overlap_grad_reduce: bool = False,
        grad_reduce_in_fp32: bool = False,
        delay_wgrad_compute: bool = False,
        grad_added_flag: bool = True,
        snapshots: bool = True,
    ) -> None:
        self.module = module
        self.params = tuple(p for p in module.parameters() if p.requires_grad)
        # Megatron's attribute name: gradsafe.wgrad.guard_ddp_step reads delay_wgrad_compute there.
        self.ddp_config = DDPConfig(overlap_grad_reduce, grad_reduce_in_fp32, delay_wgrad_compute)
        self._overlap = overlap_grad_reduce
        self._reduced = False  # the reduction ran in this step
        self._snapshots = snapshots
        self._capturing = False
        self._calls: dict[int, list[HookCall]] = {id(p): [] for p in self.params}
        # A parameter holds its AccumulateGrad node only weakly: keep the nodes
        # (and their hooks) alive, as Megatron does.
        self._grad_accs: list[torch.autograd.graph.Node] = []
        self._handles: list[object] = []
        for p in self.params:
            dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
            p.main_grad = torch.zeros_like(p, dtype=dtype)  # type: ignore[attr-defined]
            if grad_added_flag:
                p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        for p in self.params:
            if delay_wgrad_compute and getattr(p, "skip_backward_post_hook", False):
                # Megatron's routing: every module that holds p and offers the
                # method gets a hook; none offering it leaves p unhooked.
                for owner in module.modules():
                    offer = getattr(owner, "register_wgrad_accumulation_and_reduce_hooks", None)
                    if offer is not None and any(q is p for q in owner.parameters()):
                        offer(self._hook_for(p))
            else:
                node = _grad_accumulator(p)
                self._grad_accs.append(node)
                self._handles.append(node.register_hook(self._hook_for(p)))

    def _hook_for(self, p: torch.Tensor) -> Callable[..., None]:
        calls = self._calls[id(p)]

        # Called with () through a module, with (grad_in, grad_out) as an AccumulateGrad post-hook.
        def hook(*_: object) -> None:
            if self._capturing:
                return  # Megatron: `if is_graph_capturing(): return`
            grad_was_none = p.grad is None
            if self._overlap and grad_was_none:
                # Megatron asserts here before marking the parameter ready for the reduction.
                raise AssertionError(
                    "param.grad being None is not safe when overlap_grad_reduce is True"
                )
            if p.grad is not None and (
                not getattr(p, "grad_added_to_main_grad", False)
                or getattr(p, "zero_out_wgrad", False)
            ):
                p.main_grad.add_(p.grad.data)  # type: ignore[attr-defined]
            p.grad = None
            snapshot = p.main_grad.detach().clone() if self._snapshots else None  # type: ignore[attr-defined]
            calls.append(HookCall(threading.get_ident(), grad_was_none, snapshot))

        return hook

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Megatron's CUDA-graph capture window: every hook returns at once, touching nothing.

        Megatron-core sets its capturing flag (``_set_capture_start`` ...
        ``_set_capture_end``) around the whole capture, TransformerEngine's
        warm-up backward passes included, and its hooks return at once while
        it is set; wrap the graphing call in this to do the same.
        """
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def calls(self, param: torch.Tensor) -> tuple[HookCall, ...]:
        """Every hook call for ``param`` since the last :meth:`zero_grad_buffer`, oldest first."""
        return tuple(self._calls[id(param)])

    def start_grad_sync(self) -> None:
        """Megatron's reduction: each ``main_grad`` scaled by 1/world, then summed over the ranks.

        Summed with ``torch.distributed.all_reduce`` over the default process
        group where one is initialised (without one, world is 1 and nothing
        changes). Once per step: a second call (``finish_grad_sync`` after
        this) does nothing until :meth:`zero_grad_buffer`.
        """
        if self._reduced:
            return
        self._reduced = True
        if not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size()
        for p in self.params:
            p.main_grad.mul_(1.0 / world)  # type: ignore[attr-defined]
            dist.all_reduce(p.main_grad)  # type: ignore[attr-defined]

    def finish_grad_sync(self) -> None:
        """End the step's reduction (:meth:`start_grad_sync`, if it has not run in this step)."""
        self.start_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Start a step as Megatron does: zero ``main_grad``, reset the flag; ``.grad`` is left as it is.

        Also forgets the recorded hook calls.
        """
        self._reduced = False
        for p in self.params:
            p.main_grad.zero_()  # type: ignore[attr-defined]
            if hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            self._calls[id(p)].clear()

    def remove(self) -> None:
        """Remove the AccumulateGrad hooks this object registered (module-routed hooks are the module's)."""
        for handle in self._handles:
            handle.remove()  # type: ignore[attr-defined]
        self._handles.clear()
        self._grad_accs.clear()
