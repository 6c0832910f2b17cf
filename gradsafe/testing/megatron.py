"""Megatron-core-style gradient delivery, for testing weight-gradient kernels without Megatron.

:class:`MegatronStyleDDP` gives parameters what Megatron-core's data
parallelism gives them, minus the communication: an fp32-or-wider
``param.main_grad``, the ``grad_added_to_main_grad`` flag, and one hook per
parameter that adds ``.grad`` into ``main_grad`` unless the flag is set, then
clears ``.grad``. Undelayed parameters get it as a post-hook on their
AccumulateGrad node (``p.expand_as(p).grad_fn.next_functions[0][0]``, as
Megatron registers it); parameters marked as delayed
(:func:`gradsafe.wgrad.markers.grad_lifetime_is_managed`, which includes
TransformerEngine's ``skip_backward_post_hook``) get it through the store's
grad-ready hooks instead, as Megatron does for ``skip_backward_post_hook``.

Every hook call is recorded (:class:`HookCall`), so a test can check what
Megatron would only notice later: the final ``main_grad`` against plain
autograd, the number of hook calls (one per parameter per microbatch), that no
hook ran before its gradient was complete (``main_grad`` after each call), the
thread it ran on, and whether ``.grad`` was None (Megatron asserts it is not
when it overlaps the reduction).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from gradsafe.wgrad.markers import grad_lifetime_is_managed

__all__ = ["GradReadyRegistry", "HookCall", "MegatronStyleDDP"]


class GradReadyRegistry(Protocol):
    """Where delayed parameters' grad-ready hooks are registered (a :class:`gradsafe.wgrad.WeightGradStore`)."""

    def register_grad_ready_hook(
        self, param: torch.Tensor, hook: Callable[[torch.Tensor], None]
    ) -> object: ...


@dataclasses.dataclass(frozen=True)
class HookCall:
    """One call of a parameter's gradient hook."""

    thread: int  # threading.get_ident() of the thread it ran on
    grad_was_none: bool  # .grad was None when the hook ran
    main_grad_after: torch.Tensor | None  # a copy of main_grad right after the call (None: snapshots off)


def _grad_accumulator(p: torch.Tensor) -> torch.autograd.graph.Node:
    # Megatron's way to reach a leaf's AccumulateGrad node.
    view_fn = p.expand_as(p).grad_fn
    node = None if view_fn is None else view_fn.next_functions[0][0]
    if node is None:
        raise ValueError("MegatronStyleDDP: every parameter must be a leaf that requires grad")
    return node


class MegatronStyleDDP:
    """Megatron-style ``main_grad`` buffers and gradient hooks over ``params`` (no communication).

    Args:
        params: the parameters to manage. Mark delayed ones
            (:func:`~gradsafe.wgrad.markers.mark_delayed_wgrad`) before this,
            as a real wrapper decides at construction which node to hook.
        store: where delayed parameters' hooks go; required if any is marked.
        grad_added_flag: give every parameter ``grad_added_to_main_grad``
            (Megatron does). With False, only parameters that already have it
            keep it (other wrappers' behaviour).
        snapshots: copy ``main_grad`` at each hook call into
            :attr:`HookCall.main_grad_after`; turn off to time a kernel under
            the hook without that copy.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        store: GradReadyRegistry | None = None,
        *,
        grad_added_flag: bool = True,
        snapshots: bool = True,
    ) -> None:
        self.params = tuple(params)
        self._snapshots = snapshots
        self._calls: dict[int, list[HookCall]] = {id(p): [] for p in self.params}
        self._handles: list[object] = []
        # A parameter holds its AccumulateGrad node only weakly: keep the nodes
        # (and their hooks) alive, as Megatron does.
        self._grad_accs: list[object] = []
        for p in self.params:
            # fp32 for low-precision parameters, as Megatron; fp64 stays fp64.
            p.main_grad = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))  # type: ignore[attr-defined]
            if grad_added_flag:
                p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            hook = self._hook_for(p)
            if grad_lifetime_is_managed(p):
                if store is None:
                    raise ValueError(
                        "MegatronStyleDDP: a parameter is marked as delayed (its gradient arrives at W), "
                        "so its hook goes to the store's grad-ready hooks: pass store="
                    )
                self._handles.append(store.register_grad_ready_hook(p, hook))
            else:
                node = _grad_accumulator(p)
                self._grad_accs.append(node)
                self._handles.append(node.register_hook(hook))

    def _hook_for(self, p: torch.Tensor) -> Callable[..., None]:
        calls = self._calls[id(p)]

        def hook(*_: object) -> None:  # store: (param); AccumulateGrad post-hook: (grad_in, grad_out)
            grad_was_none = p.grad is None
            if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
                p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
            p.grad = None
            snapshot = p.main_grad.detach().clone() if self._snapshots else None  # type: ignore[attr-defined]
            calls.append(HookCall(threading.get_ident(), grad_was_none, snapshot))

        return hook

    def calls(self, param: torch.Tensor) -> tuple[HookCall, ...]:
        """Every hook call for ``param`` so far, oldest first."""
        return tuple(self._calls[id(param)])

    def zero_grad(self) -> None:
        """Start a step: zero ``main_grad``, reset the flag, clear ``.grad`` and the recorded calls."""
        for p in self.params:
            p.main_grad.zero_()  # type: ignore[attr-defined]
            if hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            p.grad = None
            self._calls[id(p)].clear()

    def remove(self) -> None:
        """Remove every hook this object registered."""
        for handle in self._handles:
            handle.remove()  # type: ignore[attr-defined]
        self._handles.clear()
        self._grad_accs.clear()
