"""A delayed-wgrad matmul the graphed-callable tests share (a head or tied use whose W is deferred)."""

from __future__ import annotations

from typing import Any

import torch

from gradsafe.wgrad import WeightGradStore


class DelayedMatmul(torch.autograd.Function):
    """``h @ w`` whose weight gradient is delayed to W: added into ``main_grad`` (fused) or ``.grad``."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, w: torch.Tensor, store: WeightGradStore, fused: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        ctx.store, ctx.fused = store, fused
        return h @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        h, w = ctx.saved_tensors

        def compute(main_grad: torch.Tensor | None) -> torch.Tensor | None:
            if main_grad is None:
                return h.t() @ g
            main_grad.add_(h.t() @ g)
            return None

        ctx.store.record(w, compute, accumulate_into_main_grad=ctx.fused, reads=(h, g))
        return g @ w.t(), None, None, None
