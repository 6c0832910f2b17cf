"""Which parameters have their gradient lifetime managed by a delayed weight-gradient path.

The CUDA-graphs wrapper leaves such parameters' returned gradients alone (the
returned gradient is a dummy; the real one is written at W time), so the two
capabilities share this one definition.
"""

from __future__ import annotations

import torch

__all__ = ["grad_lifetime_is_managed", "mark_delayed_wgrad"]

# gradsafe's own marker; TransformerEngine/Megatron use ``skip_backward_post_hook``.
_MARKER = "_gradsafe_delayed_wgrad"


def mark_delayed_wgrad(param: torch.Tensor) -> None:
    """Mark ``param`` as having its weight gradient produced by a delayed W pass."""
    setattr(param, _MARKER, True)


def grad_lifetime_is_managed(param: torch.Tensor) -> bool:
    """True if a delayed-wgrad path (gradsafe's or TransformerEngine's) owns ``param``'s gradient."""
    return bool(getattr(param, _MARKER, False) or getattr(param, "skip_backward_post_hook", False))
