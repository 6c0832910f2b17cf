"""One wgrad-return policy for fused and delayed weight gradients.

* :func:`wgrad_return` — what a custom backward returns in a weight's slot.
* :func:`dummy_wgrad` — the zero gradient it returns when ``main_grad`` already has it.
* :class:`WeightGradStore` / :class:`PendingWeightGrads` — delayed weight
  gradients: B records, W computes, accumulates and fires grad-ready hooks.
* :mod:`gradsafe.wgrad.markers` — which parameters a delayed W pass owns.

No patch: this is a library that kernels call. ``examples/fused_linear.py``
shows a kernel built on it; :class:`gradsafe.testing.MegatronStyleDDP` tests
one under Megatron-style hooks.
"""

from gradsafe.wgrad._policy import dummy_wgrad, wgrad_return
from gradsafe.wgrad._store import GradReadyHook, PendingWeightGrads, WeightGradClosure, WeightGradStore
from gradsafe.wgrad.markers import grad_lifetime_is_managed, mark_delayed_wgrad

__all__ = [
    "GradReadyHook",
    "PendingWeightGrads",
    "WeightGradClosure",
    "WeightGradStore",
    "dummy_wgrad",
    "grad_lifetime_is_managed",
    "mark_delayed_wgrad",
    "wgrad_return",
]
