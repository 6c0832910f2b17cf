"""Findings of a hostile review of the split backward, kept as regression tests.

Hooks a split backward cannot honour (they would need the input and weight
halves of a gradient in one pass) are refused at B before anything changes;
every other hook on the weight side fires once, as in a fused backward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight

pytestmark = pytest.mark.usefixtures("fp64")


def _setup() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    return m, x, torch.randn(3, 4)


@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_over_weight_and_input_is_refused_before_anything_changes(mode: str) -> None:
    """A fused backward fires it once; B + W would fire it in each pass (mode "any") or
    crash in torch's internals (mode "all", as torch's own B does). Refused at B instead."""
    m, x, g = _setup()
    calls: list[int] = []
    torch.autograd.graph.register_multi_grad_hook((m.weight, x), lambda grads: calls.append(1), mode=mode)  # type: ignore[arg-type]
    out = m(m(x))
    with pytest.raises(SplitBackwardError, match="register_multi_grad_hook spans a stage input"):
        stage_backward_input([out], [g], [x], m.parameters())
    assert calls == [] and x.grad is None and m.weight.grad is None


@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_over_parameters_only_fires_once(mode: str) -> None:
    m, x, g = _setup()
    calls: list[int] = []
    torch.autograd.graph.register_multi_grad_hook((m.weight, m.bias), lambda grads: calls.append(1), mode=mode)  # type: ignore[arg-type]
    m(m(x)).backward(g)
    fused = len(calls)
    calls.clear()
    _, handoff = stage_backward_input([m(m(x))], [g], [x], m.parameters())
    assert calls == []
    stage_backward_weight(m.parameters(), handoff)
    assert len(calls) == fused == 1


def test_node_post_hook_on_an_intermediate_is_refused_before_anything_changes() -> None:
    """A post hook on an activation's grad_fn that rescales grad_inputs scales the weight
    gradient in a fused backward; B cannot show it both halves at once, so B refuses it
    (before, the weight gradient came out unscaled, silently)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    u = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    calls: list[int] = []

    def scale(gi: tuple[torch.Tensor | None, ...], go: object) -> tuple[torch.Tensor | None, ...]:
        calls.append(1)
        return tuple(None if t is None else t * 3 for t in gi)

    h = x @ w
    assert h.grad_fn is not None
    h.grad_fn.register_hook(scale)
    out = torch.tanh(h) @ u
    with pytest.raises(SplitBackwardError, match="post hook is registered on MmBackward0"):
        stage_backward_input([out], [g], [x], [w, u])
    assert calls == [] and x.grad is None and w.grad is None and u.grad is None
    # Nothing of gradsafe's stays registered: a fused backward afterwards is plain.
    out.backward(g)
    assert len(calls) == 1


def test_deprecated_module_backward_hook_is_refused() -> None:
    """Module.register_backward_hook puts a post hook on the module output's node."""
    m, x, g = _setup()
    inner = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some torch versions warn that it is deprecated
        inner.register_backward_hook(lambda mod, gi, go: None)
    out = m(inner(x))
    with pytest.raises(SplitBackwardError, match="register_full_backward_hook"):
        stage_backward_input([out], [g], [x], [*m.parameters(), *inner.parameters()])


def test_node_post_hook_on_a_weight_only_node_fires_once_with_the_full_gradient() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    calls: list[int] = []

    def forward() -> torch.Tensor:
        wt = w.t()
        assert wt.grad_fn is not None
        wt.grad_fn.register_hook(
            lambda gi, go: (calls.append(1), tuple(None if t is None else t * 3 for t in gi))[1]
        )
        return x @ wt

    want = torch.autograd.grad(forward(), [w], g)[0]
    assert len(calls) == 1
    calls.clear()
    _, handoff = stage_backward_input([forward()], [g], [x], [w])
    assert calls == []
    stage_backward_weight([w], handoff)
    assert len(calls) == 1
    torch.testing.assert_close(w.grad, want)


def test_tensor_hook_on_weight_only_nonleaf_is_applied() -> None:
    """A gradient-scaling hook on a tensor computed from parameters alone (w * 2, w.t(), a
    weight-norm'd / quantized weight) runs once in W, as in a fused backward (W used to
    call weight-only nodes directly and skip it, silently)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)

    def forward() -> torch.Tensor:
        w2 = w * 2
        w2.register_hook(lambda grad: grad * 3)
        return x @ w2

    want = torch.autograd.grad(forward(), [w], g)[0]
    out = forward()
    _, handoff = stage_backward_input([out], [g], [x], [w])
    stage_backward_weight([w], handoff)
    torch.testing.assert_close(w.grad, want)


def test_module_backward_hooks_fire_on_a_stage_whose_inputs_need_no_grad() -> None:
    """A stage whose inputs do not require grad (token ids / the first stage) is all
    weight-only: W runs it through the engine, so a full backward pre-hook that rescales
    grad_output fires as often as in a fused backward (it used to fire 0 times, silently)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    calls: list[str] = []

    def pre(mod: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        calls.append("pre")
        return (grad_output[0] * 3,)

    lin.register_full_backward_pre_hook(pre)
    x = torch.randn(3, 4)  # no grad: a first stage
    g = torch.randn(3, 4)
    want = torch.autograd.grad(lin(torch.tanh(lin(x))), [lin.weight, lin.bias], g)
    fused_calls = len(calls)
    calls.clear()
    _, handoff = stage_backward_input([lin(torch.tanh(lin(x)))], [g], [x], lin.parameters())
    stage_backward_weight(lin.parameters(), handoff)
    assert len(calls) == fused_calls == 2
    torch.testing.assert_close(lin.weight.grad, want[0])
    torch.testing.assert_close(lin.bias.grad, want[1])


def test_checkpointed_forward_side_effects_happen_as_often_as_in_a_fused_backward() -> None:
    """Severity: wrong model state silently. With non-reentrant activation checkpointing the
    checkpointed forward is recomputed on unpack - once in a fused backward, but twice with B + W
    (once in B, once in W; docs only mention the cost). Forward side effects therefore happen an
    extra time: a train-mode BatchNorm inside the block updates running_mean/var and
    num_batches_tracked 3 times per microbatch instead of 2 (MoE load counters, etc. likewise)."""
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
