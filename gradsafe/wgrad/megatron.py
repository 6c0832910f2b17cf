"""Delayed weight gradients under Megatron-core's ``DistributedDataParallel``.

Megatron-core's DDP (read and run: 0.19.2) hooks a parameter through its
module instead of its AccumulateGrad node only when all three hold:

* ``param.skip_backward_post_hook`` is True — gradsafe's delayed path sets it
  (:func:`~gradsafe.wgrad.markers.mark_delayed_wgrad`, called by
  ``WeightGradStore.record`` and ``register_grad_ready_hook``);
* ``DistributedDataParallelConfig(delay_wgrad_compute=True)``;
* a module whose ``parameters()`` include ``param`` has
  ``register_wgrad_accumulation_and_reduce_hooks(hook)``.

DDP then calls that method once per such module with a hook for ``param``
(``hook()`` adds ``.grad`` into ``main_grad`` unless
``grad_added_to_main_grad``, clears ``.grad``, and under
``overlap_grad_reduce`` asserts ``.grad`` is not None and marks the parameter
ready for the reduction). The hook does not say which parameter it serves, so
a module that offers the method must hold exactly one delayed parameter, and
its method passes that parameter here::

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        register_megatron_hook(self.wgrad_store, self.weight, hook)

If any of the three is missing, DDP hooks AccumulateGrad, which runs in B
with ``.grad`` None (an ``AssertionError`` under ``overlap_grad_reduce``;
without it, W's gradient would stay in ``.grad``, which
:meth:`~gradsafe.wgrad.PendingWeightGrads.run` refuses rather than leave
``main_grad`` short).

An undelayed use of a delayed parameter (a tied embedding next to a delayed
head) puts its gradient into ``.grad`` through AccumulateGrad, which DDP does
not hook for such a parameter. While the store holds a use of the parameter
that no W pass has delivered yet, that W pass's hook adds ``.grad``. When none
does (the use's backward ran after the parameter's last W pass so far: a
ZBV rank's first stage after its last stage's W), nothing else would ever add
it, so the hook fires from the parameter's post-accumulate-grad hook at once,
as DDP's AccumulateGrad hook would for an undelayed parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradsafe.wgrad.markers import mark_delayed_wgrad

__all__ = ["GradReadyRegistry", "Removable", "module_of", "register_megatron_hook"]


class Removable(Protocol):
    def remove(self) -> None: ...


class GradReadyRegistry(Protocol):
    """Where delayed parameters' grad-ready hooks are registered (a :class:`gradsafe.wgrad.WeightGradStore`)."""

    def register_grad_ready_hook(
        self, param: torch.Tensor, hook: Callable[[torch.Tensor], None]
    ) -> Removable: ...

    def awaits_w(self, param: torch.Tensor) -> bool: ...


class _Both:
    """Removes the W-pass hook and the post-accumulate-grad hook of one Megatron hook."""

    def __init__(self, *handles: Removable) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# One Megatron hook per parameter: the handle of the one now registered.
_handles: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_megatron_hook(
    store: GradReadyRegistry, param: torch.Tensor, hook: Callable[[], object]
) -> Removable:
    """Fire Megatron-core DDP's grad-ready ``hook`` for ``param`` in each of ``store``'s W passes that computes it.

    Also fire it when an undelayed use's gradient reaches ``param.grad``
    (``param``'s post-accumulate-grad hook) and no use of ``param`` in
    ``store`` awaits a W pass (:meth:`~gradsafe.wgrad.WeightGradStore.awaits_w`),
    which would otherwise add it: so ``main_grad`` holds every gradient of the
    step whatever order the undelayed and delayed uses' passes ran in.

    Call it from a module's ``register_wgrad_accumulation_and_reduce_hooks``
    with the module's one delayed parameter. Marks ``param`` as delayed. A
    call of the hook raises ``RuntimeError`` if the hook leaves ``param.grad`` in place
    (Megatron's hook clears its own parameter's): it was DDP's hook for another
    delayed parameter of the same module. At
    most one Megatron hook per parameter: a later call replaces the earlier
    one. DDP registers a weight tied across two modules once per module, and
    a second hook in the same W pass would meet ``.grad`` already cleared (an
    ``AssertionError`` under ``overlap_grad_reduce``); a DDP built again over
    the same model likewise takes over from the old one.
    """
    mark_delayed_wgrad(param)
    old = _handles.get(param)
    if old is not None:
        old.remove()

    def grad_ready(p: torch.Tensor) -> None:
        hook()
        # Megatron's hook always clears its parameter's .grad (W set one before
        # calling it); one left in place means the hook serves another parameter.
        if p.grad is not None:
            raise RuntimeError(
                f"register_megatron_hook: the Megatron-core DDP hook registered for a delayed "
                f"parameter of shape {tuple(p.shape)} left its .grad in place, so it serves another "
                "parameter and this one's W gradient would never reach main_grad. DDP calls "
                "register_wgrad_accumulation_and_reduce_hooks once per delayed parameter of a "
                "module without saying which: a module offering it must hold exactly one delayed "
                "parameter (give each delayed parameter, e.g. a bias, its own module, or do not "
                "delay it)"
            )

    param_ref = weakref.ref(param)  # the hook is stored on the parameter itself

    def undelayed_grad_arrived(_: torch.Tensor) -> None:
        # Read through the reference, not the argument: a copy of the parameter
        # given this hook (pipelining's verify) must not fire DDP's hook for it.
        p = param_ref()
        if p is None or p.grad is None or store.awaits_w(p):
            return  # nothing arrived (a delayed B), or a W pass still to run adds it
        # Not grad_ready's check: Megatron's hook returns at once, leaving
        # .grad, while Megatron captures a CUDA graph (TransformerEngine's
        # warm-up backward included), as its AccumulateGrad hooks do.
        hook()

    handle = _Both(
        store.register_grad_ready_hook(param, grad_ready),
        param.register_post_accumulate_grad_hook(undelayed_grad_arrived),
    )
    _handles[param] = handle
    return handle


class _Holder(torch.nn.Module):
    """One parameter; offers Megatron's delayed-hook method when a store computes it."""

    def __init__(self, param: torch.nn.Parameter, store: GradReadyRegistry | None) -> None:
        super().__init__()
        self.param = param
        self._store = store

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], object]) -> None:
        if self._store is None:
            raise RuntimeError(
                "module_of(params): a parameter is marked delayed (skip_backward_post_hook) but no "
                "store was given to deliver its hook: pass store="
            )
        register_megatron_hook(self._store, self.param, hook)


def module_of(
    params: Iterable[torch.nn.Parameter], store: GradReadyRegistry | None = None
) -> torch.nn.Module:
    """A module holding ``params``, each in a child that routes Megatron's delayed hook to ``store``.

    The wiring above (one delayed parameter per module, whose
    ``register_wgrad_accumulation_and_reduce_hooks`` calls
    :func:`register_megatron_hook`), for tests written over bare parameters
    (also :func:`gradsafe.testing.module_of`): ``MegatronStyleDDP(module_of(params,
    store), delay_wgrad_compute=True)`` hooks the delayed ones (marked with
    :func:`~gradsafe.wgrad.markers.mark_delayed_wgrad`) through ``store``, as
    Megatron-core does for a module that offers
    ``register_wgrad_accumulation_and_reduce_hooks``.
    """
    return torch.nn.ModuleList(_Holder(p, store) for p in params)
