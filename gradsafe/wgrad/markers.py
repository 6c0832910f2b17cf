"""What the wgrad library tells the CUDA-graphs wrapper about parameters and hooks.

* Parameters whose gradient lifetime is managed by a delayed weight-gradient
  path: data-parallel wrappers hook them through the store's grad-ready hooks
  (:class:`gradsafe.testing.MegatronStyleDDP`). gradsafe's CUDA-graphs wrapper
  does not read the mark: a marked weight may also have an undelayed use whose
  real gradient fills its slot. TransformerEngine's ``make_graphed_callables``
  does read it (it leaves marked weights' slots as static-buffer views), so
  the ``cuda_graphs`` patch clones the slots of the parameters gradsafe marked
  (:func:`marked_by_gradsafe`) in TransformerEngine's graphed callables.
* Tensor hooks gradsafe registers that only look at the incoming gradient and
  keep no reference to it: the CUDA-graphs wrapper need not copy a static
  buffer for them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "grad_lifetime_is_managed",
    "hook_keeps_no_gradient",
    "mark_delayed_wgrad",
    "mark_hook_keeps_no_gradient",
    "marked_by_gradsafe",
]

# The attribute TransformerEngine sets on its delayed parameters and Megatron-core's
# DDP reads (with ``delay_wgrad_compute``) to hook them through their module
# instead of AccumulateGrad: one marker, so every reader agrees.
_MARKER = "skip_backward_post_hook"

# The parameters gradsafe itself marked, as opposed to TransformerEngine's own
# delayed weights (whose graphed slots hold placeholders TE need not clone).
_marked_by_gradsafe: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_delayed_wgrad(param: torch.Tensor) -> None:
    """Mark ``param`` as having its weight gradient produced by a delayed W pass.

    Sets ``param.skip_backward_post_hook = True``, TransformerEngine's marker,
    which Megatron-core's ``DistributedDataParallel`` reads (see
    :mod:`gradsafe.wgrad.megatron`).
    """
    setattr(param, _MARKER, True)
    _marked_by_gradsafe[param] = True


def marked_by_gradsafe(param: torch.Tensor) -> bool:
    """Whether :func:`mark_delayed_wgrad` marked ``param`` (whatever else marked it too)."""
    return param in _marked_by_gradsafe


def grad_lifetime_is_managed(param: torch.Tensor) -> bool:
    """True if a delayed-wgrad path (gradsafe's or TransformerEngine's) owns ``param``'s gradient."""
    return bool(getattr(param, _MARKER, False))


_HOOK_MARKER = "_gradsafe_keeps_no_gradient"


def mark_hook_keeps_no_gradient(hook: Callable[..., object]) -> None:
    """Declare that the tensor hook ``hook`` neither keeps nor changes the gradient it receives."""
    setattr(hook, _HOOK_MARKER, True)


def hook_keeps_no_gradient(hook: object) -> bool:
    """Whether ``hook`` was declared with :func:`mark_hook_keeps_no_gradient`."""
    return bool(getattr(hook, _HOOK_MARKER, False))
