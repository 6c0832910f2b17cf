"""On a GPU, which thread runs the AccumulateGrad hook, and what ``.grad`` it sees, dummy vs None.

Measured on an H200 with torch 2.11: with either return the hook runs on the
thread that ran the policy (autograd's device thread, not the caller's); a
None return leaves ``.grad`` None at the hook.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gradsafe.wgrad import wgrad_return
from gradsafe.wgrad._hazards import repro_linear


def _hook_and_backward_threads(return_none: bool) -> tuple[int, int, bool]:
    w = torch.nn.Parameter(torch.randn(8, 8, device="cuda"))
    w.main_grad = torch.zeros_like(w)
    w.grad_added_to_main_grad = False
    seen: dict[str, int] = {}
    grad_none: list[bool] = []

    def policy(param, wgrad, *, accumulate_into_main_grad, delayed):  # type: ignore[no-untyped-def]
        seen["backward"] = threading.get_ident()
        if return_none:
            return None
        return wgrad_return(
            param, wgrad, accumulate_into_main_grad=accumulate_into_main_grad, delayed=delayed
        )

    node = w.expand_as(w).grad_fn.next_functions[0][0]

    def hook(_gi, _go):  # type: ignore[no-untyped-def]
        seen["hook"] = threading.get_ident()
        grad_none.append(w.grad is None)

    node.register_hook(hook)
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    repro_linear(x, w, fuse=True, store=None, policy=policy).sum().backward()
    torch.cuda.synchronize()
    return seen["hook"], seen["backward"], grad_none[0]


@pytest.mark.cuda
def test_dummy_keeps_the_hook_on_the_device_thread() -> None:
    hook, backward, grad_none = _hook_and_backward_threads(return_none=False)
    assert hook == backward != threading.get_ident() and not grad_none


@pytest.mark.cuda
def test_hazard_none_leaves_the_hook_without_grad_on_the_device_thread() -> None:
    hook, backward, grad_none = _hook_and_backward_threads(return_none=True)
    assert hook == backward != threading.get_ident() and grad_none
