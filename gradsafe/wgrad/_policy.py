"""What a custom backward returns in a weight's gradient slot.

Megatron-style data parallelism keeps an fp32 ``param.main_grad`` and hooks
each parameter's AccumulateGrad node: the hook adds ``param.grad`` into
``main_grad`` unless ``param.grad_added_to_main_grad`` is set, then clears
``param.grad``. A fused or delayed weight-gradient kernel must return, in the
weight slot, something that hook handles right. :func:`wgrad_return` is the one
answer for every such kernel.
"""

from __future__ import annotations

import torch

__all__ = ["dummy_wgrad", "wgrad_return"]

# The one feature probe of this capability: torch >= 2.13 lets a thread relax
# AccumulateGrad's gradient layout contract, and with it relaxed a zero-stride
# gradient can be stolen as ``.grad`` (older torch always enforces it).
_layout_enforced = getattr(torch._C, "_is_grad_layout_enforcement_enabled", lambda: True)

# One shared element per (dtype, device), never written: see dummy_wgrad.
_shared_zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _zero_element(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    zero = _shared_zeros.get((dtype, device))
    if zero is None:
        # setdefault: two autograd threads racing here agree on one element.
        zero = _shared_zeros.setdefault((dtype, device), torch.zeros((), dtype=dtype, device=device))
    return zero


def dummy_wgrad(param: torch.Tensor) -> torch.Tensor:
    """A zero gradient with ``param``'s shape, dtype and device that costs no memory of its own.

    It is a zero-stride view (``expand``) of one zero element. AccumulateGrad
    never keeps a zero-stride gradient as ``.grad`` while the layout contract
    is enforced (the default): with ``.grad`` None it copies the dummy into a
    fresh ``param``-layout tensor (the same transient ``param``-sized buffer any
    returned gradient costs; Megatron's hook frees it at once), otherwise it
    adds zeros in place. So the shared element is cached per (dtype, device).
    Where the calling thread has relaxed the contract
    (``torch.autograd.enforce_grad_layout_policy(False)``), AccumulateGrad could
    keep the view itself as ``.grad``, and an in-place ``fill_`` on that
    ``.grad`` would write the shared element; there the element is fresh per
    call (one element, owned by that ``.grad`` alone).
    """
    if _layout_enforced():
        zero = _zero_element(param.dtype, param.device)
    else:
        zero = torch.zeros((), dtype=param.dtype, device=param.device)
    return zero.expand(param.shape)


def wgrad_return(
    param: torch.Tensor,
    wgrad: torch.Tensor | None,
    *,
    accumulated_into_main_grad: bool,
    delayed: bool,
) -> torch.Tensor | None:
    """What to return in ``param``'s gradient slot of a custom ``backward``.

    Args:
        param: the weight whose gradient slot is being filled.
        wgrad: the weight gradient this backward computed and did not put
            anywhere else (only used in the plain, undelayed, unfused case;
            may be None otherwise).
        accumulated_into_main_grad: this backward (or, when ``delayed``, the
            later W pass) adds the weight gradient straight into
            ``param.main_grad``.
        delayed: the weight gradient is not computed now but by a later W
            pass (see :class:`gradsafe.wgrad.WeightGradStore`).

    Returns, by the one table for every kernel:

    ======= =================== ============================ ==========================
    delayed into ``main_grad``  has ``grad_added_to_main_grad`` return
    ======= =================== ============================ ==========================
    no      no                  –                            ``wgrad``
    yes     no                  –                            None
    no      yes                 no                           None
    no      yes                 yes                          set it True, a dummy
    yes     yes                 no                           None
    yes     yes                 yes                          None (W does the rest)
    ======= =================== ============================ ==========================

    The dummy (:func:`dummy_wgrad`) is a zero gradient: AccumulateGrad and its
    hooks then run on the same thread as the rest of this device's backward
    and see a non-None ``.grad``, which the hook does not add again because
    ``grad_added_to_main_grad`` is True. Never return a view of ``main_grad``:
    AccumulateGrad copies it into ``.grad`` and a hook adds it a second time.
    """
    if delayed:
        return None
    if not accumulated_into_main_grad:
        if wgrad is None:
            raise ValueError(
                "wgrad_return: wgrad is None but the weight gradient was neither delayed nor "
                "accumulated into main_grad; pass the computed weight gradient"
            )
        return wgrad
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    return dummy_wgrad(param)
