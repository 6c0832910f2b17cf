"""The weight side B computes whole: ``K``, closed so that nothing outside it sends into it.

Checkpointed (or offloaded) built-in intermediates and custom Function intermediates cannot be
run again in W, so B computes their weight parts, together with every weight-side node below
them and everything else sending into those nodes (L2 terms, tied ``w.t()`` uses, weight-only
stage outputs). Each case runs a fused backward and B then W on the same forward, in fp64, and
asserts equal gradients, every hook run as often as fused with the gradient fused gives it, and
the hooks on ``K`` run in B (W runs none of ``K`` again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import (
    CheckpointedWeights,
    checkpointed_weights,
    stage_backward_input,
    stage_backward_weight,
)

pytestmark = pytest.mark.usefixtures("fp64")


def _offload() -> Any:
    """Activation offloading as ``save_on_cpu`` does it on a GPU: every saved tensor packed as a
    copy. (On a CPU tensor ``save_on_cpu`` packs the tensor itself, which keeps a node saving its
    own output alive after W; B refuses that: test_pipelining_hook_edges.py.)"""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


class Calls:
    """What each named hook saw, in order."""

    def __init__(self) -> None:
        self.seen: dict[str, list[tuple[torch.Tensor | None, ...]]] = {}

    def add(self, name: str, grads: Any) -> None:
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        self.seen.setdefault(name, []).append(
            tuple(None if t is None else t.detach().clone() for t in grads)
        )

    def tensor_hook(self, name: str, scale: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor]:
        # Scaling makes a hook that runs twice, or on a partial gradient, change the result.
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self.add(name, grad)
            return grad * scale

        return hook

    def counts(self) -> dict[str, int]:
        return {name: len(seen) for name, seen in self.seen.items()}


#: (w, u, x, calls) -> (stage outputs, their gradients, tensors whose retained .grad is compared)
Forward = Callable[
    [nn.Parameter, nn.Parameter, torch.Tensor, Calls],
    tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
]


def _run(forward: Forward, split: bool) -> tuple[list[Any], Calls, dict[str, int]]:
    """One microbatch, fused or B then W: the gradients, the hooks' calls, and the counts after B."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    calls = Calls()
    for name, p in (("w", w), ("u", u)):
        p.register_hook(calls.tensor_hook(f"param {name}"))
        p.register_post_accumulate_grad_hook(lambda t, name=name: calls.add(f"post {name}", t.grad))
    outputs, grads, retained = forward(w, u, x, calls)
    after_b: dict[str, int] = {}
    if split:
        _, handoff = stage_backward_input(outputs, grads, [x], [w, u])
        after_b = calls.counts()
        stage_backward_weight([w, u], handoff)
    else:
        torch.autograd.backward(outputs, grads)
    return [x.grad, w.grad, u.grad, *(t.grad for t in retained)], calls, after_b


def _assert_same(forward: Forward, in_b: tuple[str, ...] = ()) -> None:
    """Split equals fused under every policy; with ``IN_B`` (where B computes ``K`` for
    checkpointed ops as for offloaded ops and custom Functions), the hooks named in ``in_b``
    all ran in B (and W ran them no more)."""
    for policy in CheckpointedWeights:
        with checkpointed_weights(policy):
            _assert_same_under(forward, in_b if policy is CheckpointedWeights.IN_B else ())


def _assert_same_under(forward: Forward, in_b: tuple[str, ...]) -> None:
    fused, fused_calls, _ = _run(forward, split=False)
    split, split_calls, after_b = _run(forward, split=True)
    assert split_calls.counts() == fused_calls.counts()
    for f, s in zip(fused, split):
        assert (f is None) == (s is None)
        if f is not None:
            torch.testing.assert_close(s, f, rtol=0, atol=1e-12)
    for name, seen in fused_calls.seen.items():
        for f_call, s_call in zip(seen, split_calls.seen[name]):
            for ft, st in zip(f_call, s_call):
                assert (ft is None) == (st is None), (
                    f"{name}: a hook saw None where fused has a gradient"
                )
                if ft is not None:
                    torch.testing.assert_close(st, ft, rtol=0, atol=1e-12)
    for name in in_b:
        assert after_b.get(name) == fused_calls.counts()[name], f"{name} did not run (only) in B"
    # Parameter hooks run in W's delivery, never in B.
    assert not any(name.startswith(("param ", "post ")) for name in after_b)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_l2_term_next_to_a_checkpoint_with_a_hooked_weight_transform(where: str) -> None:
    """``checkpoint(x @ (w * 2))`` plus L2 terms on ``w`` and on ``w * 2`` in the same loss; the
    scaling hook on ``w * 2`` is registered outside the checkpointed function (the tensor is
    both consumed by the checkpointed op and by the L2 term) or inside it (recomputed in B)."""

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: Calls) -> Any:
        if where == "outside":
            wt = w * 2
            wt.register_hook(calls.tensor_hook("w*2", 3.0))
            h = checkpoint(lambda a, b: torch.tanh(a @ b), x, wt, use_reentrant=False)
            l2 = (wt**2).sum() + (w**2).sum()
        else:

            def block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                bt = b * 2
                bt.register_hook(calls.tensor_hook("w*2", 3.0))
                return torch.tanh(a @ bt)

            h = checkpoint(block, x, w, use_reentrant=False)
            l2 = (w**2).sum()
        loss = (h @ u).pow(2).sum() + 1e-2 * l2
        return [loss], [None], []

    _assert_same(forward, in_b=("w*2",))


def test_tied_weight_under_offloading_with_retain_grad_on_a_weight_only_tensor() -> None:
    """``h @ w.t()`` after ``x @ w`` under activation offloading, with ``retain_grad`` (and a
    hook) on the weight-only ``w.t()``: every intermediate is offloaded, so the whole weight
    side runs in B; the retained gradient is the fused one."""

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: Calls) -> Any:
        with _offload():
            wt = w.t()
            wt.retain_grad()
            wt.register_hook(calls.tensor_hook("w.t()", 0.5))
            out = torch.tanh(x @ w) @ wt @ u
        return [out], [torch.randn(3, 4)], [wt]

    _assert_same(forward, in_b=("w.t()",))


@pytest.mark.parametrize("output", ["transform", "parameter", "l2"])
def test_weight_only_stage_output_in_the_closure(output: str) -> None:
    """A weight-only stage output whose node B's closure reaches: ``w * 2`` that a checkpointed
    op consumes, the parameter ``w`` itself, or an L2 term of ``w`` returned as its own output.
    It becomes one of B's roots, so the nodes below it see their whole gradient once."""

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: Calls) -> Any:
        wt = w * 2
        wt.register_hook(calls.tensor_hook("w*2", 3.0))
        h = checkpoint(lambda a, b: torch.tanh(a @ b), x, wt, use_reentrant=False) @ u
        if output == "transform":
            return [h, wt], [torch.randn(3, 4), torch.randn(4, 4)], []
        if output == "parameter":
            return [h, w], [torch.randn(3, 4), torch.randn(4, 4)], []
        l2 = (w**2).sum()
        l2.register_hook(calls.tensor_hook("l2"))
        return [h, l2], [torch.randn(3, 4), None], []

    _assert_same(forward, in_b=("w*2",) + (("l2",) if output == "l2" else ()))


class _MatmulT(torch.autograd.Function):
    """``a @ b.T`` as a custom Function (B runs it whole)."""

    @staticmethod
    def forward(ctx, a, b):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(a, b)
        return a @ b.T

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        a, b = ctx.saved_tensors
        return grad @ b, grad.T @ a


@pytest.mark.parametrize("via", ["checkpoint", "offloading", "custom"])
def test_node_hooks_on_the_closure_run_once_in_b(via: str) -> None:
    """Node pre- and post hooks on weight-only nodes B computes (``w * 2``'s ``MulBackward0``,
    ``w.t()``'s ``TBackward0``, also fed by an ordinary intermediate ``x @ w.t()``) run once,
    in B, with the fused gradients; before this they were refused."""

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: Calls) -> Any:
        offload = _offload() if via == "offloading" else None
        if offload is not None:
            offload.__enter__()
        wt = w * 2
        wtt = wt.t()
        for name, t in (("mul", wt), ("t", wtt)):
            node = t.grad_fn
            assert node is not None
            node.register_prehook(lambda g, name=name: calls.add(f"{name} pre", g))
            node.register_hook(lambda gi, go, name=name: calls.add(f"{name} post", (*gi, *go)))
        if via == "checkpoint":
            h = checkpoint(lambda a, b: torch.tanh(a @ b), x, wtt, use_reentrant=False)
        elif via == "custom":
            h = torch.tanh(_MatmulT.apply(x, wt))
        else:
            h = torch.tanh(x @ wtt)
        out = (h + x @ wtt) @ u
        if offload is not None:
            offload.__exit__(None, None, None)
        return [out], [torch.randn(3, 4)], []

    _assert_same(forward, in_b=("mul pre", "mul post", "t pre", "t post"))


def test_closure_leaves_ordinary_weights_to_w() -> None:
    """Only the closure moves to B: a parameter no checkpointed op reaches still gets its
    weight gradient in W (its weight-only hook runs in W, not B)."""

    def forward(w: nn.Parameter, u: nn.Parameter, x: torch.Tensor, calls: Calls) -> Any:
        h = checkpoint(lambda a, b: torch.tanh(a @ b), x, w, use_reentrant=False)
        ut = u * 2
        ut.register_hook(calls.tensor_hook("u*2", 3.0))
        return [h @ ut], [torch.randn(3, 4)], []

    _assert_same(forward)
    _, _, after_b = _run(forward, split=True)
    assert "u*2" not in after_b
