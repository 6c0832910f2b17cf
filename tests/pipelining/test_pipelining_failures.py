"""Misuse and failures never half-apply: detected before any gradient or hook, hand-off FAILED after any exception."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradsafe
from gradsafe.pipelining import (
    HandoffState,
    SplitBackwardError,
    WeightGradHandoff,
    stage_backward_input,
    stage_backward_weight,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


class Recorder:
    """Counts every hook kind on every parameter; ``raise_on`` makes one post-accumulate hook raise."""

    def __init__(self, model: nn.Module, raise_on: str | None = None) -> None:
        self.events: list[tuple[str, str]] = []
        self.grad_accs = []
        for name, p in model.named_parameters():
            p.register_hook(lambda g, name=name: self.events.append(("tensor", name)))

            def post(p: torch.Tensor, name: str = name) -> None:
                self.events.append(("post", name))
                if name == raise_on:
                    raise ValueError(f"hook on {name} refuses")

            p.register_post_accumulate_grad_hook(post)
            acc = p.view_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda gi, go, name=name: self.events.append(("node", name)))
            self.grad_accs.append(acc)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _unchanged(model: nn.Module, before: list[torch.Tensor | None]) -> bool:
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(before, _grads(model))
    )


def test_b_twice_for_one_microbatch_is_refused_before_and_after_w() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    used = out * 2  # consumed inside the stage: stays attached until W
    g = torch.ones(3, 4)
    _, handoff = stage_backward_input([out, used], [g, g], [x], model.parameters())
    x_grad = x.grad.clone()
    assert out.requires_grad and not used.requires_grad, "B detaches exactly the unconsumed outputs"
    with pytest.raises(SplitBackwardError, match="already ran from these stage outputs"):
        stage_backward_input([out], [g], [x], model.parameters())
    with pytest.raises(SplitBackwardError, match="detached by an earlier split backward"):
        stage_backward_input([used], [g], [x], model.parameters())
    assert torch.equal(x.grad, x_grad), "the refused B changed an input gradient"
    stage_backward_weight(model.parameters(), handoff)
    assert not out.requires_grad, "W leaves a consumed output attached to the graph"
    with pytest.raises(SplitBackwardError, match="detached by an earlier split backward"):
        stage_backward_input([out], [g], [x], model.parameters())


def test_wrong_types_are_refused_before_anything_runs() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    rec = Recorder(model)
    cases: list[tuple[Any, str]] = [
        (
            lambda: stage_backward_input([out], [torch.ones(3, 4)], x, model.parameters()),
            "tuple or list",
        ),
        (
            lambda: stage_backward_input([out], [torch.ones(3, 4)], [x], [*model.parameters(), 3]),
            r"weights\[4\] is a int",
        ),
        (lambda: stage_backward_input([out], ["grad"], [x], model.parameters()), "is a str"),
        (lambda: stage_backward_input({out}, None, [x], model.parameters()), "is a set"),
        (
            lambda: stage_backward_input([out], [torch.ones(4, 3)], [x], model.parameters()),
            r"shape \(3, 4\).*\(4, 3\)",
        ),
        (
            lambda: stage_backward_input([out], [None], [x], model.parameters()),
            "can only be implied",
        ),
        (
            lambda: stage_backward_input(
                {"a": out}, {"b": torch.ones(3, 4)}, [x], model.parameters()
            ),
            "same keys",
        ),
    ]
    for call, message in cases:
        with pytest.raises(SplitBackwardError, match=message):
            call()
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    assert rec.events == []
    _, handoff = stage_backward_input([out], [torch.ones(3, 4)], [x], model.parameters())
    with pytest.raises(SplitBackwardError, match=r"weights\[0\] is a str"):
        stage_backward_weight(["w"], handoff)  # type: ignore[list-item]
    with pytest.raises(SplitBackwardError, match="expected the WeightGradHandoff"):
        stage_backward_weight(model.parameters(), {"handoff": handoff})  # type: ignore[arg-type]


def test_leaf_outside_weights_is_named_before_anything_runs() -> None:
    model = _model()
    stray = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x) @ stray
    with pytest.raises(
        SplitBackwardError, match=r"leaf tensor of shape \(4, 4\).*neither a stage input"
    ):
        stage_backward_input([out], [torch.ones(3, 4)], [x], model.parameters())
    assert x.grad is None and stray.grad is None


def test_parameter_passed_as_stage_input_is_refused() -> None:
    model = _model()
    weight = model[0].weight
    out = model(torch.randn(3, 4)) + weight.sum()
    with pytest.raises(
        SplitBackwardError, match=r"input_values\[0\] is also one of the stage's parameters"
    ):
        stage_backward_input([out], [torch.ones(3, 4)], [weight], model.parameters())
    assert weight.grad is None


def test_freed_saved_tensors_detected_before_any_gradient_or_hook() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    # A backward from the first Linear's output runs only nodes W calls (B freed the tanh's
    # saved output, which W never needs: a backward through it would stop there).
    hidden = model[0](x)
    out = model[2](model[1](hidden))
    _, handoff = stage_backward_input([out], [torch.ones(3, 4)], [x], model.parameters())
    hidden.sum().backward()  # another backward frees saved tensors W needs
    before = _grads(model)
    rec = Recorder(model)
    with pytest.raises(SplitBackwardError, match="before changing any parameter's gradient"):
        stage_backward_weight(model.parameters(), handoff)
    assert rec.events == [] and _unchanged(model, before)
    assert handoff.state is HandoffState.FAILED


class _TwoBranches(nn.Module):
    """``a(x) + c(x)``: the sum's backward hands the one output gradient to both Linear nodes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.c = nn.Linear(4, 4), nn.Linear(4, 4)
        self.hook: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        if self.hook is not None:
            a.register_hook(self.hook)
        return a + self.c(x)


def _w_refused(model: nn.Module, handoff: WeightGradHandoff, match: str) -> None:
    before = _grads(model)
    rec = Recorder(model)
    with pytest.raises(SplitBackwardError, match=match):
        stage_backward_weight(model.parameters(), handoff)
    assert rec.events == [] and _unchanged(model, before)
    assert handoff.state is HandoffState.FAILED


def test_a_gradient_a_later_hook_modified_in_place_is_refused_before_w_changes_anything() -> None:
    # c's node received the gradient first; the hook on `a` then doubles that same
    # tensor in place. A fused backward computed c's weight gradient before the
    # change; W would read the doubled values (c's gradients 2x, silently).
    model = _TwoBranches()
    model.hook = lambda g: g.mul_(2)
    x = torch.randn(3, 4, requires_grad=True)
    _, handoff = stage_backward_input([model(x)], [torch.ones(3, 4)], [x], model.parameters())
    _w_refused(model, handoff, "arrived at AddmmBackward0 in B.*modified in place")


def test_an_output_gradient_the_caller_reuses_before_w_is_refused() -> None:
    model = _TwoBranches()
    x = torch.randn(3, 4, requires_grad=True)
    buffer = torch.ones(3, 4)
    _, handoff = stage_backward_input([model(x)], [buffer], [x], model.parameters())
    buffer.zero_()  # the next microbatch's gradient received into the same buffer
    _w_refused(model, handoff, "reused a gradient buffer")


def test_an_input_gradient_b_returned_modified_before_w_is_refused() -> None:
    # x + c(z): the sum hands the output gradient itself to x (B returns it as dx)
    # and to c's node (W reads it).
    torch.manual_seed(0)
    c = nn.Linear(4, 4)
    x, z = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    (dx, _), handoff = stage_backward_input([x + c(z)], [torch.ones(3, 4)], [x, z], c.parameters())
    dx.mul_(5)  # e.g. the previous stage's hook modifying what it receives
    _w_refused(c, handoff, "modified in place")


@pytest.mark.parametrize("changed", ["stage input", "weight"])
def test_a_saved_tensor_modified_between_b_and_w_is_named_as_such_not_as_freed(
    changed: str,
) -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    _, handoff = stage_backward_input([model(x)], [torch.ones(3, 4)], [x], model.parameters())
    with torch.no_grad():
        (x if changed == "stage input" else model[2].weight).mul_(2)
    before = _grads(model)
    with pytest.raises(SplitBackwardError, match="modified in place after B and before W") as info:
        stage_backward_weight(model.parameters(), handoff)
    assert "freed" not in str(info.value) and "limit of gradsafe" not in str(info.value)
    assert _unchanged(model, before)


class _Squared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.w * self.w)


@pytest.mark.parametrize("layer", [_Squared, lambda: nn.Linear(4, 4)], ids=["w*w", "Linear"])
def test_a_parameter_storage_freed_between_b_and_w_is_refused_before_w_reads_it(
    layer: Any,
) -> None:
    # FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes when
    # a forward reshards between B and W; W's weight-only node would read freed
    # memory (a crash on CPU, reused memory on a GPU).
    torch.manual_seed(0)
    model = nn.Sequential(layer(), nn.Tanh(), layer())
    x = torch.randn(3, 4, requires_grad=True)
    _, handoff = stage_backward_input([model(x)], [torch.ones(3, 4)], [x], model.parameters())
    weight = next(model.parameters())
    nbytes = weight.untyped_storage().nbytes()
    weight.untyped_storage().resize_(0)
    try:
        _w_refused(model, handoff, "storage has been freed since B.*reshard_after_forward")
    finally:
        weight.untyped_storage().resize_(nbytes)


def test_weight_only_subgraph_shared_by_two_microbatches() -> None:
    """W frees nothing itself, so a weight-only part shared across microbatches stays exact."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    holder = nn.Module()
    holder.w = w
    effective = torch.tanh(w) * 2  # computed once, used by both microbatches
    xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    want = torch.autograd.grad([(x @ effective).sum() for x in xs], [w], retain_graph=True)[0]
    rec = Recorder(holder)
    handoffs = [
        stage_backward_input([x @ effective], [torch.ones(3, 4)], [x], holder.parameters())[1]
        for x in xs
    ]
    for handoff in handoffs:
        stage_backward_weight(holder.parameters(), handoff, retain_graph=False)
    torch.testing.assert_close(w.grad, want, atol=1e-12, rtol=1e-12)
    assert sorted(rec.events) == sorted([("tensor", "w"), ("post", "w"), ("node", "w")] * 2)


def test_hook_exception_leaves_handoff_failed_and_never_double_counts() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    _, handoff = stage_backward_input([model(x)], [torch.ones(3, 4)], [x], model.parameters())
    rec = Recorder(model, raise_on="0.weight")
    with pytest.raises(ValueError, match="refuses"):
        stage_backward_weight(model.parameters(), handoff)
    assert handoff.state is HandoffState.FAILED
    after_failure = _grads(model)
    fired = list(rec.events)
    with pytest.raises(SplitBackwardError, match="already failed.*ValueError"):
        stage_backward_weight(model.parameters(), handoff)
    assert _unchanged(model, after_failure) and rec.events == fired


def test_w_with_torch_after_b_with_gradsafe_names_the_cause() -> None:
    """B inside ``with gradsafe.patch()``, W after the block: torch's W meets the opaque hand-off."""
    from torch.distributed.pipelining import _backward as torch_backward

    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    with gradsafe.patch("pipelining"):
        _, handoff = torch_backward.stage_backward_input(
            [model(x)], [torch.ones(3, 4)], [x], model.parameters()
        )
    assert isinstance(handoff, WeightGradHandoff)
    with pytest.raises(SplitBackwardError, match="released between B and W"):
        torch_backward.stage_backward_weight(model.parameters(), handoff)
    with pytest.raises(RuntimeError, match="opaque"):
        list(handoff)


def test_none_only_gradient_fires_hooks_like_a_fused_backward() -> None:
    """A parameter whose only incoming gradient is None: AccumulateGrad still runs, hooks fire."""

    class NoWeightGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[override]
            return x * 2

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return g * 2, None

    def run(split: bool) -> list[tuple[str, str]]:
        model = nn.Module()
        model.w = nn.Parameter(torch.randn(4))
        rec = Recorder(model)
        x = torch.randn(3, 4, requires_grad=True)
        out = torch.tanh(NoWeightGrad.apply(x, model.w))
        if split:
            _, handoff = stage_backward_input([out], [torch.ones(3, 4)], [x], model.parameters())
            assert rec.events == []
            stage_backward_weight(model.parameters(), handoff)
        else:
            out.backward(torch.ones(3, 4))
        assert model.w.grad is None
        return rec.events

    assert run(split=True) == run(split=False)


def test_in_place_weight_use_on_a_non_leaf_input_is_refused() -> None:
    w = nn.Parameter(torch.randn(4))
    holder = nn.Module()
    holder.w = w
    base = torch.randn(3, 4, requires_grad=True)
    x = base * 1  # a non-leaf stage input (the previous stage's graph behind it)
    x.mul_(w)  # inside the stage: x's grad_fn is now the in-place node
    out = torch.tanh(x)
    with pytest.raises(
        SplitBackwardError, match=r"input_values\[0\] was modified in place.*MulBackward0"
    ):
        stage_backward_input([out], [torch.ones(3, 4)], [x], holder.parameters())
    assert w.grad is None and base.grad is None
    # Cloning first, as the message says, is exact.
    x = (base * 1).clone()
    y = x.clone()
    y.mul_(w)
    want = torch.autograd.grad(torch.tanh(y).sum(), [x, w], retain_graph=True)
    (dx,), handoff = stage_backward_input(
        [torch.tanh(y)], [torch.ones(3, 4)], [x], holder.parameters()
    )
    stage_backward_weight(holder.parameters(), handoff)
    torch.testing.assert_close(dx, want[0])
    torch.testing.assert_close(w.grad, want[1])


class _MainGradMatmul(torch.autograd.Function):
    """Megatron-style: ``dW`` is added to ``w.main_grad``, autograd gets None for ``w``."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h, w)
        ctx.weight = w
        return h @ w

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        h, w = ctx.saved_tensors
        ctx.weight.main_grad += h.t() @ g
        return g @ w.t(), None


@pytest.mark.usefixtures("fp64")
def test_refused_b_changes_nothing_with_main_grad() -> None:
    """A refused B changes nothing, ``main_grad`` included, so redoing the microbatch counts it once.

    The donated-buffer refusal must come before B's engine call: refusing from inside it would
    leave every node that already ran applied, including a Megatron-style custom Function's
    ``main_grad += dW``, while the message says no parameter gradient changed.
    """
    from gradsafe.pipelining import SplitBackwardError

    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    block = torch.compile(lambda a: torch.tanh(lin(a)) * 2, backend="aot_eager", fullgraph=True)
    w = nn.Parameter(torch.randn(4, 4))
    w.main_grad = torch.zeros(4, 4)  # type: ignore[attr-defined]
    params = [w, *lin.parameters()]

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(3, 4, requires_grad=True)
        return x, _MainGradMatmul.apply(block(x), w).pow(2).sum()

    x, loss = forward()
    loss.backward()  # a fused warm-up step compiles the backward with donated buffers
    for p in params:
        p.grad = None
    w.main_grad.zero_()  # type: ignore[attr-defined]
    x, loss = forward()
    with pytest.raises(SplitBackwardError, match="donated_buffer"):
        stage_backward_input(loss, None, [x], params)
    assert x.grad is None and all(p.grad is None for p in params)
    assert w.main_grad.abs().sum() == 0, "the refused B already added dW to main_grad"  # type: ignore[attr-defined]
