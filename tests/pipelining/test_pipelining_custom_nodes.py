"""Split backward through custom autograd.Functions, compiled blocks and checkpointing (issue 11).

Each case runs a fused backward and gradsafe's B then W on the same forward, in
fp64, and asserts equal gradients and that every backward, side effect and
hook ran as often as in the fused backward.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable

import pytest
import torch
import torch._functorch.config
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight

torch.set_default_dtype(torch.float64)


class Counts:
    """How often each backward / hook ran."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def hit(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1


class Linear(torch.autograd.Function):
    """``x @ w.T`` with a counted backward; optionally Megatron-style: adds into ``w.main_grad``."""

    @staticmethod
    def forward(ctx, x, w, counts, main_grad):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.main_grad = counts, main_grad
        return x @ w.T

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        x, w = ctx.saved_tensors
        ctx.counts.hit("Linear.backward")
        dx = grad @ w if ctx.needs_input_grad[0] else None
        dw = grad.T @ x
        if ctx.main_grad:
            w.main_grad.add_(dw)  # the side effect; no gradient returned for w
            return dx, None, None, None
        return dx, dw, None, None


class Stage(torch.nn.Module):
    def __init__(self, counts: Counts, main_grad: bool = False) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(4, 4))
        self.w2 = torch.nn.Parameter(torch.randn(4, 4))
        self.counts, self.main_grad = counts, main_grad

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = Linear.apply(x, self.w1, self.counts, self.main_grad).tanh()
        return Linear.apply(h, self.w2, self.counts, self.main_grad) * 2


def _scale(counts: Counts, name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
    counts.hit(name)
    return None if grad is None else grad * 3


def _hook_all(params, counts: Counts) -> list:  # type: ignore[no-untyped-def]
    handles = []
    for name, p in params:
        handles.append(p.register_hook(functools.partial(_scale, counts, f"tensor:{name}")))
        handles.append(p.register_post_accumulate_grad_hook(lambda t, n=name: counts.hit(f"post:{n}")))
    handles.append(
        torch.autograd.graph.register_multi_grad_hook(
            [p for _, p in params], lambda gs: counts.hit("multi"), mode="all"
        )
    )
    return handles


def _fused_and_split(make: Callable[[Counts], torch.nn.Module], hooks: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    """(fused counts, fused grads), (split counts, split grads) for the same inputs."""
    results = []
    for split in (False, True):
        counts = Counts()
        torch.manual_seed(seed)
        module = make(counts)
        for p in module.parameters():
            p.main_grad = torch.zeros_like(p)
        x = torch.randn(3, 4, requires_grad=True)
        handles = _hook_all(list(module.named_parameters()), counts) if hooks else []
        torch.manual_seed(seed + 1)
        out = module(x)
        g = torch.ones_like(out)
        if split:
            (dx,), handoff = stage_backward_input([out], [g], [x], module.parameters())
            counts.hit("after B")
            stage_backward_weight(module.parameters(), handoff)
        else:
            out.backward(g)
            dx = x.grad
            counts.hit("after B")
        for h in handles:
            h.remove()
        grads = {n: (p.grad, p.main_grad) for n, p in module.named_parameters()}
        results.append((counts.calls, dx, grads))
    return results


def _assert_same(fused, split) -> None:  # type: ignore[no-untyped-def]
    assert split[0] == fused[0]
    torch.testing.assert_close(split[1], fused[1], rtol=0, atol=1e-12)
    for name, (grad, main) in fused[2].items():
        got_grad, got_main = split[2][name]
        if grad is None:
            assert got_grad is None, name
        else:
            torch.testing.assert_close(got_grad, grad, rtol=0, atol=1e-12, msg=name)
        torch.testing.assert_close(got_main, main, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("main_grad", [False, True])
def test_custom_function_backward_runs_once(hooks: bool, main_grad: bool) -> None:
    fused, split = _fused_and_split(lambda c: Stage(c, main_grad), hooks)
    assert fused[0]["Linear.backward"] == 2
    _assert_same(fused, split)


def test_custom_function_stage_runs_inside_a_users_checkpoint_group() -> None:
    # Only a checkpointed stage needs B and W in a group of their own (groups cannot nest).
    with torch.utils.checkpoint.GraphExecGroup():
        fused, split = _fused_and_split(lambda c: Stage(c), hooks=False)
    _assert_same(fused, split)


class SharedTranspose(torch.nn.Module):
    """A custom Function and a weight-only op both consume ``w.t()``: ``w.t()``'s node, below
    the custom Function's weight edge, also gets a gradient from the weight-only ``wt * wt``,
    which B therefore computes with it."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.counts = counts

    def forward(self, x):  # type: ignore[no-untyped-def]
        wt = self.w.t()
        return Linear.apply(x, wt, self.counts, False).tanh() + (wt * wt).sum(0)


@pytest.mark.parametrize("hooks", [False, True])
def test_custom_function_sharing_a_weight_node_with_a_weight_only_op(hooks: bool) -> None:
    fused, split = _fused_and_split(SharedTranspose, hooks)
    assert fused[0]["Linear.backward"] == 1
    _assert_same(fused, split)


class Aliasing(torch.autograd.Function):
    """``a + b``; its backward returns its incoming gradient itself, twice, and logs it."""

    @staticmethod
    def forward(ctx, a, b, log):  # type: ignore[no-untyped-def, override]
        ctx.log = log
        return a + b

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        ctx.log.append((grad, grad.clone()))
        return grad, grad, None


class AliasingUses(torch.nn.Module):
    """Three aliasing gradients summed at one weight-side edge: in W (custom weight-only
    nodes) or in B (custom intermediates sharing ``w.t()`` with a weight-only op)."""

    def __init__(self, in_b: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.in_b = in_b
        self.log: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x):  # type: ignore[no-untyped-def]
        if self.in_b:
            wt = self.w.t()
            for _ in range(3):
                x = Aliasing.apply(x, wt, self.log).tanh()
            return x + (wt * wt).sum(0)
        zero = torch.zeros(4, 4)
        return sum(x @ Aliasing.apply(self.w, zero, self.log) for _ in range(3))


@pytest.mark.parametrize("in_b", [False, True])
def test_summed_gradients_never_modify_a_tensor_a_backward_returned(in_b: bool) -> None:
    grads = []
    for split in (False, True):
        torch.manual_seed(0)
        module = AliasingUses(in_b)
        x = torch.randn(4, 4, requires_grad=True)
        out = module(x)
        if split:
            _, handoff = stage_backward_input([out], [torch.ones_like(out)], [x], [module.w])
            stage_backward_weight([module.w], handoff)
        else:
            out.backward(torch.ones_like(out))
        assert len(module.log) == 3
        for returned, value in module.log:
            torch.testing.assert_close(returned, value, rtol=0, atol=0)
        grads.append(module.w.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-12)


class Checkpointed(torch.nn.Module):
    """A checkpointed block (with dropout) whose first weight is also used outside it."""

    def __init__(self, counts: Counts, wrap: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(4, 4))
        self.w2 = torch.nn.Parameter(torch.randn(4, 4))
        # Its node inside the region sends straight into its AccumulateGrad.
        self.scale = torch.nn.Parameter(torch.randn(4))
        self.counts, self.wrap = counts, wrap

    def block(self, x: torch.Tensor) -> torch.Tensor:
        self.counts.hit("block forward")
        h = torch.nn.functional.dropout(torch.tanh(x @ self.w1.T) * self.scale, 0.5, training=True)
        # A custom Function inside the region too.
        return Linear.apply(h, self.w2, self.counts, False)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.wrap(self.block, x) + x @ self.w1.T


_CHECKPOINTS = {
    "non-reentrant": functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False),
    "non-reentrant, rng preserved": functools.partial(checkpoint, use_reentrant=False),
}


def _wrapper(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Fn(torch.nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            return fn(x)

    return checkpoint_wrapper(Fn(), preserve_rng_state=False)(x)


def _selective(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        # torchtitan's policy saves matmul outputs and recomputes the rest.
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return checkpoint(
        fn,
        x,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
    )


_CHECKPOINTS["checkpoint_wrapper"] = _wrapper
_CHECKPOINTS["selective"] = _selective


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("form", sorted(_CHECKPOINTS))
def test_checkpoint_recomputes_once(form: str, hooks: bool) -> None:
    fused, split = _fused_and_split(lambda c: Checkpointed(c, _CHECKPOINTS[form]), hooks)
    assert fused[0]["block forward"] == 2  # the forward and one recomputation
    _assert_same(fused, split)


class Compiled(torch.nn.Module):
    """Two compiled blocks; the first weight also used outside them."""

    def __init__(self, counts: Counts, backend: str) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(4, 4))
        self.w2 = torch.nn.Parameter(torch.randn(4, 4))
        self.block = torch.compile(self._block, backend=backend, fullgraph=True)

    @staticmethod
    def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w.T) * 2

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.block(self.block(x, self.w1), self.w2) + x @ self.w1.T


@pytest.mark.parametrize("hooks", [False, True])
def test_aot_eager_compiled_blocks_exact(hooks: bool) -> None:
    torch._dynamo.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        fused, split = _fused_and_split(lambda c: Compiled(c, "aot_eager"), hooks)
    _assert_same(fused, split)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor on CPU needs a C++ compiler",
)
def test_inductor_compiled_blocks_exact_without_donated_buffers() -> None:
    torch._dynamo.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        fused, split = _fused_and_split(lambda c: Compiled(c, "inductor"), hooks=True)
    _assert_same(fused, split)


def test_donated_buffers_are_a_clear_error_at_b() -> None:
    torch._dynamo.reset()
    module = Compiled(Counts(), "aot_eager")  # donates like inductor; no C++ compiler needed
    x = torch.randn(3, 4, requires_grad=True)
    # The backward is compiled at the first backward, with donated buffers
    # unless that one retained the graph: a fused step (or warm-up) first.
    module(x).sum().backward()
    for p in (x, *module.parameters()):
        p.grad = None
    out = module(x)
    with pytest.raises(SplitBackwardError, match=r"torch\._functorch\.config\.donated_buffer = False"):
        stage_backward_input([out], [torch.ones_like(out)], [x], module.parameters())
    assert x.grad is None and all(p.grad is None for p in module.parameters())
