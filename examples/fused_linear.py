"""A fused Linear (no bias) built on gradsafe's wgrad policy: a template for your own kernel.

Its backward computes the input gradient and then, for the weight, one of:

* returns the weight gradient (plain),
* adds it straight into ``weight.main_grad`` (``accumulate_into_main_grad``),
* records a closure in a :class:`gradsafe.wgrad.WeightGradStore` for the W
  pass (``wgrad_store``), fused into ``main_grad`` or not; the module then
  marks its weight ``skip_backward_post_hook`` and offers
  ``register_wgrad_accumulation_and_reduce_hooks``, which is what Megatron-core's
  ``DistributedDataParallel`` with ``delay_wgrad_compute=True`` needs,

and fills the weight slot with :func:`gradsafe.wgrad.wgrad_return`. Under
gradsafe's split backward (``gradsafe.pipelining.stage_backward_input`` /
``stage_backward_weight``, what a zero-bubble schedule calls), the backward
finds a store without being given one (:func:`gradsafe.wgrad.split_wgrad_store`)
and records there: B computes only the input gradient and W the weight GEMM.
A real kernel library replaces the matmuls with its GEMMs and keeps the rest.

Run it (from the repository root): ``PYTHONPATH=. python examples/fused_linear.py``
checks every configuration under :class:`gradsafe.testing.MegatronStyleDDP`
against ``torch.nn.Linear`` and prints the largest difference, then runs a
stage of these layers under gradsafe's B and W and prints the share of the
backward's matmul FLOPs that W does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import MatmulFlops, MegatronStyleDDP
from gradsafe.wgrad import (
    WeightGradStore,
    mark_delayed_wgrad,
    register_megatron_hook,
    split_wgrad_store,
    wgrad_return,
)


def _main_grad(weight: torch.Tensor) -> torch.Tensor:
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            "fused_linear(accumulate_into_main_grad=True): the weight has no main_grad; "
            "allocate weight.main_grad (e.g. torch.zeros_like(weight, dtype=torch.float32)) "
            "before backward"
        )
    return main_grad


class _FusedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        accumulate_into_main_grad: bool,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        # The parameter object itself (not an unpacked saved tensor): the store and
        # hooks key on its identity.
        ctx.weight = weight
        ctx.fuse = accumulate_into_main_grad
        ctx.store = store
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        weight: torch.Tensor = ctx.weight
        dgrad = grad_out @ weight if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dgrad, None, None, None
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad_out.reshape(-1, grad_out.shape[-1])

        def compute(main_grad: torch.Tensor | None) -> torch.Tensor | None:
            if main_grad is None:
                return g2.t() @ x2
            # The fused GEMM: accumulate in main_grad's precision, no wgrad tensor.
            main_grad.addmm_(g2.t().to(main_grad.dtype), x2.to(main_grad.dtype))
            return None

        wgrad = None
        # A store given at forward wins; otherwise gradsafe's split B offers one
        # (None anywhere else): either way the weight GEMM runs later, in W.
        store = ctx.store if ctx.store is not None else split_wgrad_store(ctx)
        if store is not None:
            # reads=: W refuses if x or the gradient changed in place since B (e.g. x
            # is a CUDA-graphed callable's output and the callable ran again).
            store.record(weight, compute, accumulate_into_main_grad=ctx.fuse, reads=(x2, g2))
        elif ctx.fuse:
            compute(_main_grad(weight))
        else:
            wgrad = compute(None)
        returned = wgrad_return(
            weight, wgrad, accumulate_into_main_grad=ctx.fuse, delayed=store is not None
        )
        return dgrad, returned, None, None


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    accumulate_into_main_grad: bool = False,
    wgrad_store: WeightGradStore | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` whose weight gradient is returned, fused into ``main_grad`` or delayed.

    Args:
        accumulate_into_main_grad: add the weight gradient into
            ``weight.main_grad`` (fp32 or the weight's dtype) instead of
            returning it.
        wgrad_store: compute the weight gradient at W time instead; B records
            it here (with ``accumulate_into_main_grad`` deciding where W puts it).
    """
    return _FusedLinearFunction.apply(x, weight, accumulate_into_main_grad, wgrad_store)


class FusedLinear(torch.nn.Module):
    """A bias-free Linear on :func:`fused_linear`. Share ``weight`` to tie it across modules."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        accumulate_into_main_grad: bool = False,
        wgrad_store: WeightGradStore | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.wgrad_store = wgrad_store
        if wgrad_store is not None:
            # Before any data-parallel wrapper decides which parameters to hook:
            # sets skip_backward_post_hook, which Megatron-core's DDP reads.
            mark_delayed_wgrad(self.weight)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], object]) -> None:
        """Where Megatron-core's DDP (``delay_wgrad_compute=True``) hands its hook for the delayed weight.

        It then fires after each W pass that computes the weight's gradient.
        """
        if self.wgrad_store is None:
            # DDP calls this for a marked weight, so this module shares (ties) a
            # weight that another module delays: that module registers the hook.
            return
        register_megatron_hook(self.wgrad_store, self.weight, hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_linear(
            x,
            self.weight,
            accumulate_into_main_grad=self.accumulate_into_main_grad,
            wgrad_store=self.wgrad_store,
        )


def largest_error(*, fused: bool, delayed: bool, microbatches: int = 4) -> float:
    """``main_grad`` of a :class:`FusedLinear` used twice per step vs ``torch.nn.Linear``, fp64."""
    torch.manual_seed(0)
    store = WeightGradStore() if delayed else None
    lin = FusedLinear(8, 8, accumulate_into_main_grad=fused, wgrad_store=store, dtype=torch.float64)
    ref = torch.nn.Linear(8, 8, bias=False, dtype=torch.float64)
    ref.weight.data.copy_(lin.weight.data)
    # main_grad and Megatron's hooks on both (kept alive by these names); the
    # delayed weight's hook comes through lin.register_wgrad_accumulation_and_reduce_hooks.
    ddps = (MegatronStyleDDP(lin, delay_wgrad_compute=delayed), MegatronStyleDDP(ref))
    for _ in range(microbatches):
        x = torch.randn(4, 8, dtype=torch.float64)
        lin(torch.tanh(lin(x))).pow(2).sum().backward()  # B (the weight is used twice)
        if store is not None:
            store.seal().run()  # W: main_grad += both uses, the hook fires once
        ref(torch.tanh(ref(x))).pow(2).sum().backward()
    err = (lin.weight.main_grad - ref.weight.main_grad).abs().max().item()  # type: ignore[attr-defined]
    for ddp in ddps:
        ddp.remove()
    return err


class Stage(torch.nn.Sequential):
    """A pipeline stage of fused layers: (FusedLinear d->4d, GELU, FusedLinear 4d->d) x ``blocks``."""

    def __init__(self, d: int, blocks: int, dtype: torch.dtype = torch.float64) -> None:
        layers: list[torch.nn.Module] = []
        for _ in range(blocks):
            layers += [FusedLinear(d, 4 * d, dtype=dtype), torch.nn.GELU()]
            layers += [FusedLinear(4 * d, d, dtype=dtype)]
        super().__init__(*layers)


def split_flops(d: int = 64, tokens: int = 64, blocks: int = 2) -> dict[str, int]:
    """Matmul FLOPs of one microbatch's B and W under gradsafe's split, on a :class:`Stage`."""
    torch.manual_seed(0)
    stage = Stage(d, blocks)
    x = torch.randn(tokens, d, dtype=torch.float64, requires_grad=True)
    y = stage(x)
    counter = MatmulFlops()
    with counter:
        counter.phase = "B"
        _, handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
        counter.phase = "W"
        stage_backward_weight(stage.parameters(), handoff)
    return dict(counter.counts)


def w_share(d: int = 64, tokens: int = 64, blocks: int = 2) -> float:
    """The fraction of the backward's matmul FLOPs that W does (gradsafe's split)."""
    counts = split_flops(d, tokens, blocks)
    return counts.get("W", 0) / (counts.get("B", 0) + counts.get("W", 0))


def main() -> None:
    for delayed in (False, True):
        for fused in (False, True):
            err = largest_error(fused=fused, delayed=delayed)
            print(
                f"delayed={delayed!s:5} fused={fused!s:5} max |main_grad - nn.Linear's| = {err:.2e}"
            )
    counts = split_flops()
    print(
        f"split B/W, d=64, 64 tokens, 2 blocks: B {counts.get('B', 0)} W {counts.get('W', 0)} "
        f"matmul FLOPs, W share {w_share():.3f}"
    )


if __name__ == "__main__":
    main()
