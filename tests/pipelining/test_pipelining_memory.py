"""Memory conditions: gradsafe's B and W never hold more live storage than torch's split.

Counted with :class:`gradsafe.testing.LiveStorage` (bytes of storages created from
the forward on and still alive, read after every operator), never timed. One last
stage, driven as torch's stage drives it: B per microbatch (the output detached
after B), W per microbatch, in a zero-bubble order (every B, then every W) and a
1F1B-like one (B and W per microbatch). Compared at every point: the peak during
each B and W, and what is alive after it.

Stages: Linear + tanh layers (weight- and activation-dominated), pre-norm MLP
blocks, and transformer blocks (LayerNorm, attention, MLP) under a head tied to
an embedding another stage owns (the parameter is in this stage's weights too),
with and without an activation-checkpointed MLP. On a checkpointed stage the split compared
is ``CheckpointedWeights.IN_B`` (B computes the checkpointed ops' weight gradients, allowed
for as kept bytes); the default ``IN_W`` keeps B's recomputed tensors for W and holds at most
what the stage without checkpointing holds, and ``RECOMPUTE_IN_W`` no more than torch's split
between B and W (both in test_pipelining_balance.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import _backward as torch_split
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import (
    CheckpointedWeights,
    checkpointed_weights,
    stage_backward_input,
    stage_backward_weight,
)
from gradsafe.testing import LiveStorage

# gradsafe's helper nodes allocate a few scalars (anchors): bytes, not gradients.
_SLACK = 4096
_VOCAB, _DIM, _TOKENS = 64, 32, 16


class _Block(nn.Module):
    """Pre-norm transformer block; its MLP optionally checkpointed (selective AC)."""

    def __init__(self, checkpoint_mlp: bool) -> None:
        super().__init__()
        self.checkpoint_mlp = checkpoint_mlp
        self.norm1, self.norm2 = nn.LayerNorm(_DIM), nn.LayerNorm(_DIM)
        self.qkv, self.proj = nn.Linear(_DIM, 3 * _DIM), nn.Linear(_DIM, _DIM)
        self.mlp = nn.Sequential(nn.Linear(_DIM, 4 * _DIM), nn.GELU(), nn.Linear(4 * _DIM, _DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 4, d // 4).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + (
            checkpoint(self.mlp, h, use_reentrant=False) if self.checkpoint_mlp else self.mlp(h)
        )


class _LastStage(nn.Module):
    """Two blocks, a final norm and a head whose weight is the first stage's embedding."""

    def __init__(self, checkpoint_mlp: bool) -> None:
        super().__init__()
        embedding = nn.Embedding(_VOCAB, _DIM)  # the first stage's
        self.blocks = nn.Sequential(_Block(False), _Block(checkpoint_mlp))
        self.norm = nn.LayerNorm(_DIM)
        self.head = nn.Linear(_DIM, _VOCAB, bias=False)
        self.head.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class _MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _linear(layers: int, dim: int) -> nn.Module:
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _none(model: nn.Module, point: str, kept: int) -> int:
    return 0


def _first_weight_gradient(model: nn.Module, point: str, kept: int) -> int:
    """During W, the head's weight gradient (W's first call: the top of the graph).

    gradsafe frees a node's saved tensors by dropping the node, which frees
    nothing until the nodes above it are gone, so W calls intermediates from the
    top and the head's gradient is made while every activation is alive; torch's
    W frees each parameter group's saved tensors through the engine, in
    parameter order, and reaches the head last.
    """
    head = model.head.weight  # type: ignore[union-attr]
    return head.numel() * head.element_size() if point.startswith("peak during W") else 0


def _kept_by_b(model: nn.Module, point: str, kept: int) -> int:
    """The weight gradients B kept for W, and the head's as above.

    A checkpointed region recomputes once, in B, so B computes its weight
    gradients and keeps them for W; torch's split keeps the gradient at the
    region's ops instead and recomputes the region again in W. For an MLP
    d -> 4d -> d that is 8d^2 + 5d against 5Td for T tokens: more below
    T = 1.6d (this stage: 32 tokens, d=32), less above (the next stage).
    """
    return kept + _first_weight_gradient(model, point, kept)


class _Stage(NamedTuple):
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    target: Callable[[torch.Tensor], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Bytes gradsafe may hold over torch's split at a point, each explained where defined.
    allowance: Callable[[nn.Module, str, int], int] = _none


def _tokens(x: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, _VOCAB, x.shape[:2])


_STAGES = {
    "Linear, weight-dominated": _Stage(lambda: _linear(4, 256), (4, 256), torch.randn_like, _mse),
    "Linear, activation-dominated": _Stage(
        lambda: _linear(4, 32), (512, 32), torch.randn_like, _mse
    ),
    "pre-norm MLP blocks": _Stage(
        lambda: nn.Sequential(*(_MLPBlock(64) for _ in range(4))), (32, 64), torch.randn_like, _mse
    ),
    "pre-norm MLP blocks, tokens > width": _Stage(
        lambda: nn.Sequential(*(_MLPBlock(64) for _ in range(2))), (256, 64), torch.randn_like, _mse
    ),
    "transformer, tied head": _Stage(
        lambda: _LastStage(checkpoint_mlp=False),
        (2, _TOKENS, _DIM),
        _tokens,
        _cross_entropy,
        _first_weight_gradient,
    ),
    "transformer, tied head, checkpointed MLP": _Stage(
        lambda: _LastStage(checkpoint_mlp=True),
        (2, _TOKENS, _DIM),
        _tokens,
        _cross_entropy,
        _kept_by_b,
    ),
    "transformer, tied head, checkpointed MLP, 128 tokens": _Stage(
        lambda: _LastStage(checkpoint_mlp=True), (2, 4 * _TOKENS, _DIM), _tokens, _cross_entropy
    ),
}
_ORDERS = ("every B, then every W", "B and W per microbatch")


def _points(
    impl: str, stage: _Stage, microbatches: int, grads_held: bool, order: str, middle: bool = False
) -> tuple[dict[str, int], dict[str, int], nn.Module]:
    """Bytes alive at every point, the bytes of weight gradients B kept for W then (gradsafe),
    and the stage. ``middle``: a middle stage (B from the outputs and their gradients, which
    the schedule keeps until W) instead of the last (B from the loss)."""
    torch.manual_seed(0)
    model = stage.build()
    params = list(model.parameters())
    xs = [torch.randn(*stage.input_shape, requires_grad=True) for _ in range(microbatches)]
    ys = [stage.target(x) for x in xs]
    out_grads = [torch.randn_like(x) for x in xs] if middle else []
    if grads_held:  # an earlier step's (or microbatch's) gradients
        for p in params:
            p.grad = torch.randn_like(p)
    b, w = (
        (stage_backward_input, stage_backward_weight)
        if impl == "gradsafe"
        else (torch_split.stage_backward_input, torch_split.stage_backward_weight)
    )
    existing = [*params, *xs, *ys, *out_grads, *(p.grad for p in params if p.grad is not None)]
    if order == _ORDERS[0]:
        steps = [("B", i) for i in range(microbatches)] + [("W", i) for i in range(microbatches)]
    else:
        steps = [(kind, i) for i in range(microbatches) for kind in "BW"]
    points: dict[str, int] = {}
    kept: dict[str, int] = {}
    with LiveStorage(existing) as live:
        losses, outs = [], []
        for x, y in zip(xs, ys):
            out = model(x)
            outs.append(out)
            if not middle:
                losses.append(stage.loss(out, y))
        live.mark()
        handoffs: list[Any] = [None] * microbatches
        for kind, i in steps:
            before = sum(getattr(h, "kept_bytes", 0) for h in handoffs if h is not None)
            if kind == "B" and middle:
                _, handoffs[i] = b([outs[i]], [out_grads[i]], [xs[i]], params)
            elif kind == "B":
                _, handoffs[i] = b([losses[i]], None, [xs[i]], params)
                outs[i].detach_()  # torch's stage does, on the last stage, after B
            else:
                w(params, handoffs[i])
                handoffs[i] = None  # the schedule drops its backward_state entry
            after = sum(getattr(h, "kept_bytes", 0) for h in handoffs if h is not None)
            points[f"peak during {kind}{i}"] = live.peak_since_mark
            kept[f"peak during {kind}{i}"] = max(before, after)
            points[f"after {kind}{i}"] = live.mark()
            kept[f"after {kind}{i}"] = after
    return points, kept, model


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("grads_held", [False, True], ids=["grad None", "grad held"])
@pytest.mark.parametrize("microbatches", [1, 2, 8])
@pytest.mark.parametrize("stage", sorted(_STAGES))
def test_split_holds_no_more_than_torchs_split_at_any_point(
    stage: str, microbatches: int, grads_held: bool, order: str
) -> None:
    """At every point, gradsafe holds at most what torch's split holds, plus the stage's
    allowance (none for Linear and MLP stages; see :func:`_first_weight_gradient` and
    :func:`_kept_by_b` for the transformer stages), with the checkpointed MLP's weight
    gradients computed in B (``IN_B``)."""
    theirs, _, _ = _points("torch", _STAGES[stage], microbatches, grads_held, order)
    with checkpointed_weights(CheckpointedWeights.IN_B):
        ours, kept, model = _points("gradsafe", _STAGES[stage], microbatches, grads_held, order)
    over = {
        name: (ours[name], theirs[name], allowed)
        for name in theirs
        if ours[name]
        > theirs[name] + (allowed := _STAGES[stage].allowance(model, name, kept[name])) + _SLACK
    }
    assert not over, f"bytes (gradsafe, torch's split, allowed) where gradsafe holds more: {over}"


@pytest.mark.parametrize("middle", [False, True], ids=["last stage", "middle stage"])
@pytest.mark.parametrize("grads_held", [False, True], ids=["grad None", "grad held"])
def test_w_peak_stays_under_torchs_split_with_more_tokens_than_width(
    grads_held: bool, middle: bool
) -> None:
    """Pre-norm GELU MLP blocks, 256 tokens of width 64, no allowance: W's first call (the top
    layer's weight gradient) once came on top of every activation B had run on, one weight
    gradient over torch's split, whose W starts from the bottom LayerNorm. B now frees what
    only the input gradients needed (the GELU inputs), as a fused backward would."""
    stage = _STAGES["pre-norm MLP blocks, tokens > width"]
    for order in _ORDERS:
        theirs, _, _ = _points("torch", stage, 2, grads_held, order, middle)
        ours, _, _ = _points("gradsafe", stage, 2, grads_held, order, middle)
        over = {k: (ours[k], theirs[k]) for k in theirs if ours[k] > theirs[k] + _SLACK}
        assert not over, (
            f"{order}: bytes (gradsafe, torch's split) where gradsafe holds more: {over}"
        )
        # Between B and W, less than torch's split: the GELU inputs are gone.
        assert ours["after B1"] < theirs["after B1"] or order != _ORDERS[0], (ours, theirs)


def test_b_frees_what_only_the_input_gradients_needed() -> None:
    """After B, a GELU's saved input is freed (W never calls that node), and unpacking it says
    so in torch's words; the Linear's saved input, which W needs, is kept."""
    block = _MLPBlock(8)
    x = torch.randn(4, 8, requires_grad=True)
    out = block(x)
    fc2 = out.grad_fn.next_functions[1][0]  # type: ignore[union-attr]
    gelu = fc2.next_functions[1][0]
    assert gelu.name() == "GeluBackward0" and fc2.name() == "AddmmBackward0", (gelu, fc2)
    _, handoff = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        gelu._saved_self  # noqa: B018
    assert fc2._saved_mat1 is not None
    stage_backward_weight(block.parameters(), handoff)
    assert all(p.grad is not None for p in block.parameters())


@pytest.mark.parametrize("checkpointed", [False, True])
def test_b_keeps_weight_gradients_only_for_checkpointed_regions(checkpointed: bool) -> None:
    """What B keeps for W with ``IN_B`` is exactly the checkpointed MLP's weight gradients
    (or nothing)."""
    with checkpointed_weights(CheckpointedWeights.IN_B):
        _, kept, model = _points(
            "gradsafe",
            _STAGES["transformer, tied head" + ", checkpointed MLP" * checkpointed],
            1,
            False,
            _ORDERS[0],
        )
    mlp = model.blocks[1].mlp  # type: ignore[index]
    expected = sum(p.numel() * p.element_size() for p in mlp.parameters()) * checkpointed
    assert kept["after B0"] == expected, kept


def test_w_with_gradients_held_adds_one_layer_at_a_time() -> None:
    """W's transient on a weight-dominated stage with ``.grad`` held is one layer's gradient
    (plus what that layer's call produces), not the stage's whole set of weight gradients."""
    points, _, model = _points(
        "gradsafe", _STAGES["Linear, weight-dominated"], 1, True, "B and W per microbatch"
    )
    layer = model[0]  # type: ignore[index]
    one_layer = sum(p.numel() * p.element_size() for p in layer.parameters())
    transient = points["peak during W0"] - points["after B0"]
    assert transient <= 2 * one_layer + _SLACK, (transient, one_layer)


def test_live_storage_counts_a_storage_at_its_present_size() -> None:
    """A storage resized in place (FSDP2 frees and re-gathers its unsharded parameters so,
    outside any operator) counts at its new size from the next reading on."""
    with LiveStorage() as live:
        t = torch.empty(256, dtype=torch.float32)
        assert live.live() == 1024
        t.untyped_storage().resize_(0)
        assert live.live() == 0
        t.untyped_storage().resize_(2048)
        # An operator after the resize: its reading sees the new size.
        one = torch.zeros(1, dtype=torch.float32)
        assert live.peak == live.live() == 2048 + 4
        del t, one
        assert live.live() == 0
