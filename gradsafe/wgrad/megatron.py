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

Every W pass of a step must run before the step's reduction, and none may
be left for the next step. :func:`guard_ddp_step` makes DDP check it: the
reduction (``start_grad_sync``, ``finish_grad_sync``, hence
``finalize_model_grads``) and ``zero_grad_buffer()`` refuse, before changing
anything, while a W pass of the model's parameters is outstanding.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradsafe._shared import pending_w
from gradsafe.wgrad._store import forget_lost_w, outstanding_w
from gradsafe.wgrad.markers import grad_lifetime_is_managed, mark_delayed_wgrad

UnguardedDDPWarning = pending_w.UnguardedDDPWarning

__all__ = [
    "DDPStepGuard",
    "UnguardedDDPWarning",
    "GradReadyRegistry",
    "Removable",
    "guard_ddp_step",
    "module_of",
    "register_megatron_hook",
]


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


# The DDP methods the guard wraps: the reduction's two entry points
# (finalize_model_grads calls finish_grad_sync on every model chunk) and the
# start of a step.
_REDUCTIONS = ("start_grad_sync", "finish_grad_sync")
_ZERO = "zero_grad_buffer"


class DDPStepGuard:
    """The checks :func:`guard_ddp_step` put on one DDP; :meth:`remove` takes them off again."""

    def __init__(self, ddp: Any) -> None:
        self._ddp = ddp
        # The parameters it covers (delayed work on uncovered ones with a main_grad warns once).
        self._covered = self._params()
        pending_w.cover(self._covered)
        # What each wrapped name was in the instance's own __dict__ (absent: the class's method).
        self._before: dict[str, object] = {}
        self._installed: dict[str, Callable[..., Any]] = {}
        for name in (*_REDUCTIONS, _ZERO):
            original = getattr(ddp, name)
            wrapper = self._wrap(name, original)
            if name in vars(ddp):
                self._before[name] = vars(ddp)[name]
            setattr(ddp, name, wrapper)
            self._installed[name] = wrapper

    def _params(self) -> list[torch.Tensor]:
        return [p for p in self._ddp.module.parameters() if p.requires_grad]

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            params = self._params()
            found = outstanding_w(params)
            if name == _ZERO:
                if found.open_records or found.unrun or found.handoffs:
                    raise RuntimeError(_zero_refusal(found.describe()))
                if found.lost:
                    _forget_abandoned_readiness(self._ddp)
                result = original(*args, **kwargs)
                forget_lost_w(params)  # a new step: passes lost in the last one no longer count
                return result
            if found:
                raise RuntimeError(_reduction_refusal(name, found.describe()))
            return original(*args, **kwargs)

        guarded.__dict__[_GUARD_MARK] = True
        return guarded

    def remove(self) -> None:
        """Restore the DDP's methods. Raises ``RuntimeError`` if something replaced a guarded one since."""
        for name, wrapper in self._installed.items():
            if vars(self._ddp).get(name) is not wrapper:
                raise RuntimeError(
                    f"DDPStepGuard.remove: the DDP's {name} was replaced after the guard was put "
                    "on; remove that replacement first (guards and wrappers come off in reverse order)"
                )
        for name in self._installed:
            if name in self._before:
                setattr(self._ddp, name, self._before[name])
            else:
                delattr(self._ddp, name)
        self._installed.clear()
        pending_w.uncover(self._covered)
        self._covered = []


_GUARD_MARK = "_gradsafe_ddp_step_guard"


def guard_ddp_step(ddp: Any) -> DDPStepGuard:
    """Make ``ddp``'s reduction and ``zero_grad_buffer()`` refuse while a W pass of its parameters is outstanding.

    ``ddp`` is a Megatron-core ``DistributedDataParallel`` (one per model
    chunk) or :class:`gradsafe.testing.MegatronStyleDDP`. Wraps, on this
    instance only, ``start_grad_sync`` and ``finish_grad_sync`` (so
    ``finalize_model_grads`` too), which raise ``RuntimeError`` before
    reducing anything while any live :class:`~gradsafe.wgrad.WeightGradStore`
    holds, for a parameter of ``ddp.module``, a use recorded since the last
    ``seal()``, a sealed pass not yet run, or a pass dropped unrun or failed
    part-way in this step; and ``zero_grad_buffer()``, which raises before
    zeroing anything while a use or a sealed pass is not yet run (a W run
    after it would bring its microbatch into the new step), and otherwise
    starts a new step (lost passes of the last one no longer count).
    :meth:`DDPStepGuard.remove` restores the methods.

    Also refuses, here, a module that offers
    ``register_wgrad_accumulation_and_reduce_hooks`` and holds more than one
    delayed parameter (``skip_backward_post_hook``) under
    ``delay_wgrad_compute``: DDP hands it one hook per such parameter without
    saying which, so one parameter's hook would serve another.

    Raises:
        ValueError: ``ddp`` is already guarded, or a module holds two delayed parameters.
    """
    if any(
        vars(ddp).get(name) is not None and _GUARD_MARK in getattr(vars(ddp)[name], "__dict__", {})
        for name in (*_REDUCTIONS, _ZERO)
    ):
        raise ValueError("guard_ddp_step: this DDP is already guarded (one guard per DDP)")
    if getattr(ddp.ddp_config, "delay_wgrad_compute", False):
        _refuse_two_delayed_parameters_in_one_module(ddp.module)
    return DDPStepGuard(ddp)


def _refuse_two_delayed_parameters_in_one_module(model: torch.nn.Module) -> None:
    # Megatron-core's routing, read in 0.19.2: every module offering the method
    # and holding (recursively) a marked parameter gets one call per such parameter.
    for name, module in model.named_modules():
        if not hasattr(module, "register_wgrad_accumulation_and_reduce_hooks"):
            continue
        delayed = {
            id(p): p for p in module.parameters() if p.requires_grad and grad_lifetime_is_managed(p)
        }
        if len(delayed) > 1:
            shapes = ", ".join(str(tuple(p.shape)) for p in delayed.values())
            raise ValueError(
                f"guard_ddp_step: module {name or '(the model)'} ({type(module).__name__}) offers "
                "register_wgrad_accumulation_and_reduce_hooks and holds "
                f"{len(delayed)} delayed parameters (skip_backward_post_hook; shapes {shapes}). "
                "Megatron-core's DDP (delay_wgrad_compute=True) calls that method once per delayed "
                "parameter without saying which, so the module registers every hook for one "
                "parameter (the last replacing the others): one parameter's W would fire another's "
                "hook, and the others' W gradients would never reach main_grad. Give each "
                "delayed parameter (e.g. a delayed bias) its own module offering the method, or "
                "do not delay it"
            )


def _forget_abandoned_readiness(ddp: Any) -> None:
    """Let Megatron's ``zero_grad_buffer()`` start a new step after one abandoned with a W lost.

    Under ``overlap_grad_reduce`` Megatron-core (read in 0.19.2) counts, per
    bucket group, the grad-ready hook calls of the step's last microbatch:
    ``bucket_group.reset()`` records the first step's counts as the golden
    ones and asserts that every parameter of the group was counted, which a
    lost W leaves short (a bare ``AssertionError``, and the guard then refused
    every later reduction). The abandoned step's counts are dropped here (so
    the next step counts as the first again where it was), and a bucket
    group whose reduction the hooks already started is waited for, so the
    next step's does not find one outstanding. Nothing else of Megatron's is
    touched; a DDP without bucket groups (``MegatronStyleDDP``) has nothing to forget.
    """
    if not getattr(getattr(ddp, "ddp_config", None), "overlap_grad_reduce", False):
        return
    groups = [
        *getattr(ddp, "bucket_groups", ()),
        *getattr(ddp, "expert_parallel_bucket_groups", ()),
    ]
    for group in groups:
        if getattr(group, "grad_reduce_handle", None) is not None:
            group.finish_grad_sync()
        counts = getattr(group, "per_param_grad_ready_counts", None)
        if isinstance(counts, dict):
            counts.clear()


def _reduction_refusal(name: str, what: str) -> str:
    return (
        f"DDP.{name}(): delayed weight gradients of this model are outstanding: {what}. "
        "The reduction would average main_grad without them, and a W pass run after it adds "
        "its gradient to the already-reduced main_grad (each rank its own gradient, unreduced). "
        "Every W pass of a step must run before the step's reduction: with Megatron-core's "
        "schedules (forward_backward_no_pipelining, "
        "forward_backward_pipelining_without_interleaving), run them in a "
        "config.finalize_model_grads_func wrapper before calling finalize_model_grads "
        "(docs/wgrad.md). Nothing was reduced."
    )


def _zero_refusal(what: str) -> str:
    return (
        "DDP.zero_grad_buffer(): delayed weight gradients of the step being zeroed are "
        f"outstanding: {what}. Run after the zeroing, such a W pass would bring its "
        "microbatch into the next step (with a tied weight's undelayed gradient waiting in "
        ".grad for it). Every W pass of a step runs before the step's reduction (docs/wgrad.md). "
        "To abandon the step instead: drop every reference to its unrun passes (after "
        "store.seal(), for uses recorded since the last seal), set each parameter's .grad to "
        "None, then call zero_grad_buffer(). Nothing was zeroed."
    )
