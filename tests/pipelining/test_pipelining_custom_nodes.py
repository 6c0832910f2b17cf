"""Split backward through custom autograd.Functions, compiled blocks and checkpointing (issue 11).

Each case runs a fused backward and gradsafe's B then W on the same forward, in
fp64 (conftest.py's autouse fixture, restored after each test), and asserts equal
gradients and that every backward, side effect and hook ran as often as in the
fused backward.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable

import pytest
import torch
import torch._functorch.config
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight


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
        handles.append(
            p.register_post_accumulate_grad_hook(lambda t, n=name: counts.hit(f"post:{n}"))
        )
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
    with pytest.raises(
        SplitBackwardError, match=r"torch\._functorch\.config\.donated_buffer = False"
    ):
        stage_backward_input([out], [torch.ones_like(out)], [x], module.parameters())
    assert x.grad is None and all(p.grad is None for p in module.parameters())


@pytest.mark.usefixtures("fp64")
def test_checkpointed_forward_side_effects_happen_as_often_as_in_a_fused_backward() -> None:
    """A checkpointed block's forward side effects happen as often with B + W as in a fused backward.

    With non-reentrant activation checkpointing the block's forward is recomputed on unpack:
    once in a fused backward. Recomputing it in B and again in W would update a train-mode
    BatchNorm's running_mean/var and num_batches_tracked (or MoE load counters) once too often.
    """
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 4)).train()
    x = torch.randn(8, 4, requires_grad=True)
    g = torch.randn(8, 4)
    checkpoint(m, x, use_reentrant=False).backward(g)
    fused_updates = int(m[1].num_batches_tracked)
    fused_mean = m[1].running_mean.clone()
    m[1].reset_running_stats()
    out = checkpoint(m, x, use_reentrant=False)
    _, handoff = stage_backward_input([out], [g], [x], m.parameters())
    stage_backward_weight(m.parameters(), handoff)
    assert int(m[1].num_batches_tracked) == fused_updates
    torch.testing.assert_close(m[1].running_mean, fused_mean)


@pytest.mark.usefixtures("fp64")
def test_reentrant_checkpoint_on_the_weight_only_side_is_refused_in_b() -> None:
    """A reentrant checkpoint computed from parameters alone is refused in B, before anything changes.

    B never runs ``checkpoint(f, w, use_reentrant=True)``; W's engine pass would, and torch
    refuses reentrant checkpoints under ``autograd.grad(inputs=...)``. Failing there would lose
    the microbatch's weight gradient after B's input gradients were sent on.
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    wt = checkpoint(lambda a: torch.sin(a) * 2, w, use_reentrant=True)
    out = torch.tanh(x @ wt)
    try:
        _, handoff = stage_backward_input([out], [torch.randn(3, 4)], [x], [w])
    except SplitBackwardError:
        assert x.grad is None and w.grad is None  # refused in B, nothing changed: fine
        return
    stage_backward_weight([w], handoff)


@pytest.mark.usefixtures("fp64")
def test_compiled_weight_only_block_with_donated_buffers() -> None:
    """A compiled weight-only block (weight-norm, fake-quant, LoRA merge) gets the fused backward's gradients, or is refused in B.

    Computed from parameters alone it is a weight-only ``CompiledFunctionBackward`` that B never
    runs; W's engine pass runs it, and a block that donates its saved buffers cannot run there.
    Such a block must not fail late in W with a message about freed saved tensors.
    """
    transform = torch.compile(
        lambda w: torch.sin(torch.cos(w) * 3) @ torch.tanh(w * 2), backend="aot_eager"
    )

    def stage(w: nn.Parameter, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ transform(w))

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    stage(w, x).backward(g)  # compiles the backward (buffers donated from now on)
    want = torch.autograd.grad(stage(w, x), [x, w], g)
    w.grad = None
    x.grad = None
    with pytest.raises(SplitBackwardError, match="donated_buffer = False"):
        stage_backward_input([stage(w, x)], [g], [x], [w])
    assert w.grad is None and x.grad is None
    torch._dynamo.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        stage(w, x).backward(g)
        w.grad = None
        x.grad = None
        _, handoff = stage_backward_input([stage(w, x)], [g], [x], [w])
        stage_backward_weight([w], handoff)
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=1e-12)


class _Scale(torch.autograd.Function):
    """A custom Function weight transform (what a quantizer or weight-norm kernel is)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(w)
        return w * 1.5

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (w,) = ctx.saved_tensors
        return g * 1.5 + 0 * w


def _backward(
    loss: torch.Tensor, x: torch.Tensor, params: list[nn.Parameter], split: bool
) -> list[torch.Tensor | None]:
    if split:
        (dx,), handoff = stage_backward_input(loss, None, [x], params)
        stage_backward_weight(params, handoff)
    else:
        loss.backward()
        dx = x.grad
    return [dx, *(p.grad for p in params)]


def _weight_only_custom_function_in_a_region(split: bool) -> tuple[int, list[torch.Tensor | None]]:
    torch.manual_seed(0)
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    runs = [0]

    def region(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        runs[0] += 1
        return a.sin(), _Scale.apply(b)

    s, ws = checkpoint(region, x, u, use_reentrant=False)
    loss = (s @ ws).pow(2).sum()
    before = runs[0]
    grads = _backward(loss, x, [u], split)
    return runs[0] - before, grads


@pytest.mark.usefixtures("fp64")
def test_custom_function_on_the_weight_side_of_a_checkpointed_region_recomputes_once() -> None:
    """A checkpointed region holding a weight-only custom Function recomputes once across B and W.

    The region computes ``sin(x)`` (input side) and a custom Function of the parameter ``u``
    (weight-only); a plain ``@`` joins them. Both nodes' saved tensors come through the
    checkpoint's hooks, so B and W must share one checkpoint group: B unpacking ``sin``'s input
    and W the Function's would otherwise recompute the region twice (and, with dropout and
    ``preserve_rng_state=False``, draw a different mask for W).
    """
    fused_runs, fused = _weight_only_custom_function_in_a_region(split=False)
    split_runs, split = _weight_only_custom_function_in_a_region(split=True)
    for f, s in zip(fused, split):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)
    assert (fused_runs, split_runs) == (1, 1)


def _dropconnect(split: bool) -> list[torch.Tensor | None]:
    torch.manual_seed(0)
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    h = checkpoint(
        lambda a: F.dropout(a.sin(), 0.5), x, use_reentrant=False, preserve_rng_state=False
    )
    # A checkpointed weight-only region with dropout (DropConnect-style), created after `h`'s.
    wd = checkpoint(
        lambda b: F.dropout(b * 1.0, 0.5), u, use_reentrant=False, preserve_rng_state=False
    )
    loss = (h @ wd).pow(2).sum()
    torch.manual_seed(1)  # the same RNG state at the start of both backwards
    return _backward(loss, x, [u], split)


@pytest.mark.usefixtures("fp64")
def test_weight_only_checkpointed_dropout_sees_the_fused_masks() -> None:
    """With ``preserve_rng_state=False`` every checkpointed region draws the fused backward's dropout masks.

    A fused backward recomputes the regions in its own (sequence-number) order, here the
    weight-only one first; a weight-only region recomputed in W's pass after every region B
    recomputed would draw its mask from the global RNG in a different order, changing ``dx``
    and ``u.grad``.
    """
    fused = _dropconnect(split=False)
    split = _dropconnect(split=True)
    for f, s in zip(fused, split):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)


def _in_place_on_a_view_in_a_region(
    split: bool, dropout: bool
) -> tuple[int, list[torch.Tensor | None]]:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    runs = [0]

    def region(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        y = torch.tanh(a) * 1.0
        if dropout:
            y = F.dropout(y, 0.3)
        y[:, :2].mul_(b[0, :2])  # in place on a view: a CopySlices node wrapping MulBackward0
        return y

    h = checkpoint(region, x, w, use_reentrant=False, preserve_rng_state=False)
    loss = (h @ w).pow(2).sum()
    before = runs[0]
    torch.manual_seed(7)  # the same RNG state at the start of both backwards
    grads = _backward(loss, x, [w], split)
    return runs[0] - before, grads


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("dropout", [False, True])
def test_in_place_on_a_view_inside_a_checkpoint_recomputes_once(dropout: bool) -> None:
    """An in-place write into a view inside a checkpoint (a ``CopySlices`` node) recomputes the region once.

    ``y[:, :2].mul_(w[0, :2])`` makes a ``CopySlices`` node whose saved tensors live in the
    wrapped ``MulBackward0``, not in ``_raw_saved_*`` attributes of its own. Calling it again in
    W would unpack the checkpointed tensors a second time and, with dropout and
    ``preserve_rng_state=False``, give ``w.grad`` a new mask (off by ~5.8 here).
    """
    fused_runs, fused = _in_place_on_a_view_in_a_region(split=False, dropout=dropout)
    split_runs, split = _in_place_on_a_view_in_a_region(split=True, dropout=dropout)
    for f, s in zip(fused, split):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)
    assert (fused_runs, split_runs) == (1, 1)


_CPP_MATMUL = r"""
#include <torch/extension.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
static int64_t backward_calls = 0;
struct MatmulFn : public torch::autograd::Function<MatmulFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w) {
    ctx->save_for_backward({x, w});
    return x.mm(w);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    backward_calls += 1;  // a kernel library's side effect (e.g. main_grad += dW) would go here
    auto saved = ctx->get_saved_variables();
    return {grads[0].mm(saved[1].t()), saved[0].t().mm(grads[0])};
  }
};
torch::Tensor matmul(torch::Tensor x, torch::Tensor w) { return MatmulFn::apply(x, w); }
int64_t calls() { return backward_calls; }
"""


def _cpp_matmul_stage(
    ext, split: bool, checkpointed: bool
) -> tuple[int, int, list[torch.Tensor | None]]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    runs = [0]

    def region(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        return torch.tanh(ext.matmul(F.dropout(a.sin(), 0.3), b))

    if checkpointed:
        h = checkpoint(region, x, w, use_reentrant=False, preserve_rng_state=False)
    else:
        h = torch.tanh(ext.matmul(x, w))
    loss = h.pow(2).sum()
    before, calls = runs[0], ext.calls()
    torch.manual_seed(7)
    grads = _backward(loss, x, [w], split)
    return runs[0] - before, ext.calls() - calls, grads


@pytest.mark.usefixtures("fp64")
@pytest.mark.skipif(
    shutil.which("c++") is None or os.environ.get("GRADSAFE_BUILD_EXTENSIONS") != "1",
    reason="builds a C++ extension (about a minute): set GRADSAFE_BUILD_EXTENSIONS=1 (CI does on one torch)",
)
@pytest.mark.parametrize("checkpointed", [False, True])
def test_cpp_custom_function_backward_runs_once(checkpointed: bool) -> None:
    """A C++ extension's custom Function runs its backward once per microbatch, inside a checkpoint too.

    A ``torch::autograd::Function`` has a ``CppNode`` that is no ``torch._C._FunctionBase``;
    running its backward in B for ``dx`` and again in W for ``dW`` would repeat side effects such
    as ``main_grad += dW``, and inside a checkpoint (its saved tensors are no ``_raw_saved_*``
    attributes) recompute the region with a new dropout mask (``w.grad`` off by ~2 here).
    The extension is built once per torch into torch's extension cache (about a minute).
    """
    from torch.utils.cpp_extension import load_inline

    ext = load_inline(
        "gradsafe_test_cpp_matmul", cpp_sources=_CPP_MATMUL, functions=["matmul", "calls"]
    )
    fused_runs, fused_calls, fused = _cpp_matmul_stage(ext, split=False, checkpointed=checkpointed)
    split_runs, split_calls, split = _cpp_matmul_stage(ext, split=True, checkpointed=checkpointed)
    for f, s in zip(fused, split):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)
    assert (fused_runs, split_runs) == (int(checkpointed), int(checkpointed))
    assert (fused_calls, split_calls) == (1, 1)


class _InPlaceScale(torch.autograd.Function):
    """An in-place custom Function (``mark_dirty``), Megatron-style: ``dv`` goes to ``v.main_grad``."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a.clone(), v)
        ctx.weight = v
        a.mul_(v)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        a0, v = ctx.saved_tensors
        ctx.weight.main_grad += (g * a0).sum(0)
        return g * v, None


def _in_place_custom_function_on_a_view(split: bool) -> list[torch.Tensor | None]:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    v = nn.Parameter(torch.randn(2))
    v.main_grad = torch.zeros(2)  # type: ignore[attr-defined]
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.tanh(x) * 1.0
    _InPlaceScale.apply(y[:, :2], v)  # on a view: the node is a CopySlices wrapping the PyNode
    loss = (y @ w).pow(2).sum()
    return [*_backward(loss, x, [w, v], split), v.main_grad]  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fp64")
def test_in_place_custom_function_on_a_view_runs_once() -> None:
    """A custom Function applied in place to a view (``mark_dirty``) runs its backward once per microbatch.

    autograd wraps it in a built-in ``CopySlices`` node. Running that node in B for ``dx`` and
    again in W for ``w``'s side would run the Function's backward twice, doubling its
    ``main_grad += dv``.
    """
    fused = _in_place_custom_function_on_a_view(split=False)
    split = _in_place_custom_function_on_a_view(split=True)
    for f, s in zip(fused, split):
        torch.testing.assert_close(s, f, rtol=0, atol=1e-12)
