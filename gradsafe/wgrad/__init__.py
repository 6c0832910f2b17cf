"""One wgrad-return policy for fused and delayed weight gradients.

* :func:`wgrad_return` — what a custom backward returns in a weight's slot.
* :func:`dummy_wgrad` — the zero gradient it returns when ``main_grad`` already has it.
* :class:`WeightGradStore` / :class:`PendingWeightGrads` — delayed weight
  gradients: B records, W computes, accumulates and fires grad-ready hooks.
* :mod:`gradsafe.wgrad.markers` — which parameters a delayed W pass owns.
* :func:`register_megatron_hook` — Megatron-core DDP's grad-ready hook for a
  delayed parameter; :func:`guard_ddp_step` — DDP's reduction and
  ``zero_grad_buffer()`` refuse while a W pass (or a pipelining B's W) is
  outstanding; :class:`UnguardedDDPWarning` — delayed work met a Megatron
  DDP no guard covers (:mod:`gradsafe.wgrad.megatron`).
* :func:`split_wgrad_store` — in gradsafe's split backward (B/W), the store a
  custom Function records its weight part into, so W runs it
  (:mod:`gradsafe.wgrad.split`).

No patch: this is a library that kernels call. ``examples/fused_linear.py``
shows a kernel built on it; :class:`gradsafe.testing.MegatronStyleDDP` tests
one under Megatron-core's hooks without Megatron.
"""

import warnings

from gradsafe._shared.deprecation import removal_notice
from gradsafe.wgrad._policy import dummy_wgrad, wgrad_return
from gradsafe.wgrad._store import (
    GradReadyHook,
    PendingWeightGrads,
    WeightGradClosure,
    WeightGradStore,
)
from gradsafe.wgrad.markers import grad_lifetime_is_managed, mark_delayed_wgrad
from gradsafe.wgrad.megatron import (
    DDPStepGuard,
    UnguardedDDPWarning,
    guard_ddp_step,
    register_megatron_hook,
)
from gradsafe.wgrad.split import SplitWeightGradStore, split_wgrad_store

__all__ = [
    "DDPStepGuard",
    "GradReadyHook",
    "PendingWeightGrads",
    "SplitWeightGradStore",
    "UnguardedDDPWarning",
    "WeightGradClosure",
    "WeightGradStore",
    "dummy_wgrad",
    "grad_lifetime_is_managed",
    "guard_ddp_step",
    "mark_delayed_wgrad",
    "register_megatron_hook",
    "split_wgrad_store",
    "wgrad_return",
]


def __getattr__(name: str) -> object:
    # The 0.1 name of WeightGradClosure, kept with a warning (CHANGELOG.md, deprecation policy).
    if name == "WgradClosure":
        warnings.warn(
            "gradsafe.wgrad.WgradClosure was renamed WeightGradClosure in gradsafe 0.2.0; "
            + removal_notice(),
            DeprecationWarning,
            stacklevel=2,
        )
        return WeightGradClosure
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
