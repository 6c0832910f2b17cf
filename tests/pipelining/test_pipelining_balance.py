"""W carries the weight GEMMs of checkpointed and selective-AC stages (issue 29).

FLOPs and bytes are counted (benchmarks/_balance.py), never timed.
The balance figures are docs/pipelining.md's table ("Checkpointed stages").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import _benchmarks
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from gradsafe.pipelining import (
    CheckpointedWeights,
    SplitBackwardError,
    checkpointed_weights,
    stage_backward_input,
    stage_backward_weight,
)

# benchmarks/ is not a package and not on sys.path under plain `pytest`: load by path.
_balance = _benchmarks.load("_balance")
Balance, Mlp, measure, save_matmuls = (
    _balance.Balance,
    _balance.Mlp,
    _balance.measure,
    _balance.save_matmuls,
)

D = 128
TOKENS = (D // 4, D, 4 * D)
IN_W, IN_B = CheckpointedWeights.IN_W, CheckpointedWeights.IN_B
RECOMPUTE = CheckpointedWeights.RECOMPUTE_IN_W
# What a checkpointed stage holds between B and W, at most, over the stage without
# checkpointing, where B frees what only the input gradients needed (the GELU inputs);
# selective AC keeps the matmul outputs its policy saved until the checkpoint drops them.
_HELD_OVER_PLAIN = {"full": 1.0, "selective": 1.09}


@functools.cache
def _measured(split: object, checkpointing: str, tokens: int) -> Balance:
    return measure(split, checkpointing, tokens, D)  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_w_runs_the_weight_gemms_of_a_checkpointed_stage_by_default(
    checkpointing: str, tokens: int
) -> None:
    plain = _measured(IN_W, "none", tokens)
    split = _measured(IN_W, checkpointing, tokens)
    fused = _measured("fused", checkpointing, tokens)
    assert abs(split.w_share - plain.w_share) <= 0.05
    assert split.w_share == pytest.approx(0.5)
    # Each region recomputes once per microbatch: B and W together do a fused backward's work.
    assert split.b + split.w <= 1.02 * fused.b
    assert split.w_recomputed == 0
    assert split.b_recomputed == fused.b_recomputed
    # Between B and W: no more than the stage without checkpointing holds (selective AC: the
    # matmul outputs its policy saved, which B leaves to the checkpoint, up to 1.09x of it).
    assert split.held <= _HELD_OVER_PLAIN[checkpointing] * plain.held


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_memory_between_b_and_w_stays_under_the_uncheckpointed_stage_up_to_8d_tokens(
    checkpointing: str,
) -> None:
    tokens = 8 * D
    plain = measure(IN_W, "none", tokens, D)
    split = measure(IN_W, checkpointing, tokens, D)
    assert split.held <= _HELD_OVER_PLAIN[checkpointing] * plain.held


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_in_b_policy_computes_the_weight_gradients_in_b(checkpointing: str, tokens: int) -> None:
    split = _measured(IN_B, checkpointing, tokens)
    fused = _measured("fused", checkpointing, tokens)
    assert split.w == 0
    assert split.b == fused.b


@pytest.mark.parametrize("tokens", TOKENS)
def test_recompute_in_w_holds_no_more_than_torchs_split_and_recomputes_once_more(
    tokens: int,
) -> None:
    split = _measured(RECOMPUTE, "full", tokens)
    torchs = _measured("torch", "full", tokens)
    fused = _measured("fused", "full", tokens)
    assert split.held <= torchs.held
    assert split.w_share == pytest.approx(0.5)
    # One recomputation in B, one in W (torch's W recomputes once per call it makes).
    assert split.b_recomputed == split.w_recomputed == fused.b_recomputed
    assert split.b + split.w == fused.b + fused.b_recomputed
    assert split.b + split.w < torchs.b + torchs.w


@pytest.mark.parametrize("tokens", TOKENS)
def test_recompute_in_w_leaves_selective_regions_weight_gradients_to_b(tokens: int) -> None:
    # SAC's cache serves one recomputation: a second, in W, would fail (as torch's split does).
    split = _measured(RECOMPUTE, "selective", tokens)
    assert split.w == 0
    assert split.held == _measured(IN_B, "selective", tokens).held


# docs/pipelining.md's table: (B, W) in forwards' matmul FLOPs, W share, forwards recomputed.
_TABLE = {
    ("none", IN_W): (1, 1, 0.5, 0),
    ("none", "torch"): (1, 1, 0.5, 0),
    ("full", IN_W): (1.5, 1, 0.5, 0.5),
    ("full", RECOMPUTE): (1.5, 1.5, 0.5, 1),
    ("full", IN_B): (2.5, 0, 0, 0.5),
    ("full", "torch"): (1.5, 2.5, 0.5, 2),
    ("full", "fused"): (2.5, 0, 0, 0.5),
    ("selective", IN_W): (1, 1, 0.5, 0),
    ("selective", RECOMPUTE): (2, 0, 0, 0),
    ("selective", IN_B): (2, 0, 0, 0),
}


@pytest.mark.parametrize(("checkpointing", "split"), list(_TABLE))
@pytest.mark.parametrize("tokens", TOKENS)
def test_flops_in_b_and_w_follow_the_documented_table(
    checkpointing: str, split: object, tokens: int
) -> None:
    r = _measured(split, checkpointing, tokens)
    assert r.forward == 32 * tokens * D * D  # 2 blocks of d->4d->d matmuls
    assert (r.b / r.forward, r.w / r.forward, r.w_share, r.recomputes) == _TABLE[
        checkpointing, split
    ]


def test_torchs_split_crashes_on_selective_checkpointing() -> None:
    # 2.13 and newer: "Trying to backward an extra time"; 2.11's checkpoint
    # recomputes in W and finds different tensors.
    with pytest.raises(RuntimeError, match="backward an extra time|Recomputed values"):
        measure("torch", "selective", D // 4, D)


# docs/pipelining.md's memory formulas for this stage (2 blocks, float64), in elements.
_HELD = {
    # B frees the saved tensors W never unpacks (each GELU's input): as full AC under IN_W.
    ("none", IN_W): lambda t, d: 23 * t * d + 4 * t,
    ("none", IN_B): lambda t, d: 23 * t * d + 4 * t,
    ("none", "torch"): lambda t, d: 31 * t * d + 4 * t,
    ("full", IN_W): lambda t, d: 23 * t * d + 4 * t,
    ("selective", IN_W): lambda t, d: 25 * t * d + 4 * t,
    ("full", RECOMPUTE): lambda t, d: 13 * t * d,
    ("full", "torch"): lambda t, d: 13 * t * d,
    ("full", IN_B): lambda t, d: 16 * d * d + 14 * d + t * d,
    ("selective", IN_B): lambda t, d: 16 * d * d + 14 * d + t * d,
}


@pytest.mark.parametrize(("checkpointing", "policy"), list(_HELD))
@pytest.mark.parametrize("tokens", TOKENS)
def test_memory_between_b_and_w_follows_the_documented_formula(
    checkpointing: str, policy: object, tokens: int
) -> None:
    held = _measured(policy, checkpointing, tokens).held
    assert held == pytest.approx(8 * _HELD[checkpointing, policy](tokens, D), rel=0.01)


class _Stage(nn.Module):
    """Two checkpointed blocks with dropout; ``tie`` also uses the first weight outside them."""

    def __init__(
        self,
        d: int,
        *,
        tie: bool = False,
        twice: bool = False,
        nested: bool = False,
        **checkpoint_kwargs: Any,
    ):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)
        self.tie, self.twice, self.nested = tie, twice, nested
        self.kwargs = checkpoint_kwargs
        self.preserve = True

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.tanh(self.a(x)), 0.3, training=True)
        if self.twice:  # one parameter used twice in one region
            h = h + torch.tanh(self.a(x))
        inner = functools.partial(checkpoint, use_reentrant=False) if self.nested else None
        if inner is not None:
            return inner(self.b, h)
        return self.b(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {"use_reentrant": False, "preserve_rng_state": self.preserve, **self.kwargs}
        y = checkpoint(self._region, x, **kwargs)
        y = checkpoint(self._region, y, **kwargs)
        if self.tie:
            y = y + (x @ self.a.weight.T)[:, : x.shape[1]]
        return y


ORDERS = {
    "B0 B1 W0 W1": ["B0", "B1", "W0", "W1"],
    "B0 W0 B1 W1": ["B0", "W0", "B1", "W1"],
    "B0 B1 W1 W0": ["B0", "B1", "W1", "W0"],
}


def _run_split(stage: _Stage, xs: list[torch.Tensor], gs: list[torch.Tensor], order: list[str]):
    torch.manual_seed(1)
    outs = [stage(x) for x in xs]
    handoffs: dict[int, object] = {}
    dxs: dict[int, torch.Tensor] = {}
    for step in order:
        i = int(step[1])
        if step[0] == "B":
            (dxs[i],), handoffs[i] = stage_backward_input(
                outs[i], gs[i], [xs[i]], stage.parameters()
            )
        else:
            stage_backward_weight(stage.parameters(), handoffs.pop(i))  # type: ignore[arg-type]
    return [dxs[0], dxs[1]], [p.grad.clone() for p in stage.parameters()]  # type: ignore[union-attr]


def _run_fused(stage: _Stage, xs: list[torch.Tensor], gs: list[torch.Tensor], b_order: list[int]):
    torch.manual_seed(1)
    outs = [stage(x) for x in xs]
    for i in b_order:  # one backward per microbatch: each region recomputes once
        outs[i].backward(gs[i])
    dxs = [x.grad for x in xs]
    for x in xs:
        x.grad = None
    return dxs, [p.grad.clone() for p in stage.parameters()]  # type: ignore[union-attr]


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def _compare(
    make: Callable[[], _Stage],
    order: list[str],
    policy: CheckpointedWeights,
    preserve: bool = True,
) -> None:
    torch.manual_seed(0)
    stage = make().double()
    stage.preserve = preserve
    xs = [torch.randn(6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    gs = [torch.randn(6, 8, dtype=torch.float64) for _ in range(2)]
    b_order = [int(s[1]) for s in order if s[0] == "B"]
    ref_dx, ref_grads = _run_fused(stage, xs, gs, b_order)
    stage.zero_grad(set_to_none=True)
    with checkpointed_weights(policy):
        dx, grads = _run_split(stage, xs, gs, order)
    assert _max_rel(dx + grads, ref_dx + ref_grads) <= 1e-12


@pytest.mark.parametrize("policy", list(CheckpointedWeights), ids=lambda p: p.name)
@pytest.mark.parametrize("order", ORDERS.values(), ids=list(ORDERS))
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"tie": True},
        {"twice": True},
        {"nested": True},
        {"early_stop": False},
        {"determinism_check": "none"},
        {"context_fn": functools.partial(create_selective_checkpoint_contexts, save_matmuls)},
    ],
    ids=[
        "plain",
        "tied-outside",
        "used-twice",
        "nested",
        "no-early-stop",
        "no-determinism-check",
        "selective",
    ],
)
def test_checkpointed_split_is_exact_in_every_schedule_order(
    order: list[str], variant: dict, policy: CheckpointedWeights
) -> None:
    _compare(lambda: _Stage(8, **variant), order, policy)


@pytest.mark.parametrize("policy", list(CheckpointedWeights), ids=lambda p: p.name)
@pytest.mark.parametrize("order", ORDERS.values(), ids=list(ORDERS))
def test_dropout_without_preserved_rng_state_is_exact_as_regions_recompute_in_b(
    order: list[str], policy: CheckpointedWeights
) -> None:
    # preserve_rng_state=False: the masks depend on when a region recomputes;
    # each recomputes once, in B, in a fused backward's order (RECOMPUTE_IN_W
    # leaves such regions' weight gradients to B).
    _compare(lambda: _Stage(8), order, policy, preserve=False)


@pytest.mark.parametrize("policy", list(CheckpointedWeights), ids=lambda p: p.name)
@pytest.mark.parametrize("order", ORDERS.values(), ids=list(ORDERS))
def test_a_region_nested_in_one_without_preserved_rng_state_is_exact(
    order: list[str], policy: CheckpointedWeights
) -> None:
    # The inner region restores the RNG state, the outer one (whose dropout
    # makes the inner's input) does not: recomputing the inner again in W
    # recomputes the outer too, with other masks, so RECOMPUTE_IN_W must leave
    # the inner's weight gradients to B.
    _compare(lambda: _Stage(8, nested=True), order, policy, preserve=False)


def test_parameter_hooks_fire_once_in_w_on_a_checkpointed_stage() -> None:
    stage = _Stage(8).double()
    calls = []
    stage.a.weight.register_hook(lambda g: calls.append("tensor"))
    stage.a.weight.register_post_accumulate_grad_hook(lambda p: calls.append("post"))
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    y = stage(x)
    _, handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
    assert calls == []
    assert stage.a.weight.grad is None
    stage_backward_weight(stage.parameters(), handoff)
    assert calls == ["tensor", "post"]


def test_offloaded_saved_tensors_fall_back_to_weight_gradients_in_b_exactly() -> None:
    # save_on_cpu's hooks are not checkpoint's: their unpack is not told to
    # run twice, so B computes those weight gradients (today's behaviour).
    torch.manual_seed(0)
    lin = nn.Linear(8, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 8, dtype=torch.float64)
    with torch.autograd.graph.save_on_cpu():
        y = nn.functional.gelu(lin(x))
    (ref_dx,) = torch.autograd.grad(y, [x], g, retain_graph=True)
    ref = torch.autograd.grad(y, list(lin.parameters()), g, retain_graph=True)
    (dx,), handoff = stage_backward_input(y, g, [x], lin.parameters())
    assert handoff.num_kept == 2  # weight and bias gradients computed in B
    stage_backward_weight(lin.parameters(), handoff)
    assert torch.equal(dx, ref_dx)
    assert all(torch.equal(p.grad, r) for p, r in zip(lin.parameters(), ref))  # type: ignore[arg-type]


def test_in_b_policy_is_chosen_with_a_context_manager_and_read_by_b() -> None:
    stage = Mlp(16, 1, "full").double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y = stage(x)
    with checkpointed_weights(IN_B):
        _, handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
    assert handoff.num_kept == len(list(stage.parameters()))
    stage_backward_weight(stage.parameters(), handoff)
    y = stage(x)
    _, handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
    assert handoff.num_kept == 0
    stage_backward_weight(stage.parameters(), handoff)


def test_checkpointed_weights_refuses_what_is_not_a_policy() -> None:
    with pytest.raises(TypeError, match="CheckpointedWeights.IN_W"):
        with checkpointed_weights("in_b"):  # type: ignore[arg-type]
            pass


def test_w_refuses_a_checkpointed_stage_whose_saved_tensors_another_backward_freed() -> None:
    stage = Mlp(16, 1, "full").double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y = stage(x)
    other = y.view_as(y)  # a second way into the graph, kept past B's detach
    _, handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
    other.sum().backward()  # frees the saved tensors, checkpoint holders included
    with pytest.raises(SplitBackwardError, match="were freed"):
        stage_backward_weight(stage.parameters(), handoff)


@pytest.mark.parametrize("policy", list(CheckpointedWeights), ids=lambda p: p.name)
def test_w_refuses_a_checkpointed_stage_whose_input_changed_in_place_after_b(
    policy: CheckpointedWeights,
) -> None:
    # A receive buffer reused before W: the region's first Linear saved the
    # stage input, which its recomputation gives W as a view of that input.
    stage = Mlp(16, 1, "full").double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y = stage(x)
    with checkpointed_weights(policy):
        _, handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
    with torch.no_grad():
        x.copy_(torch.randn(4, 16, dtype=torch.float64))
    if policy is CheckpointedWeights.IN_B:  # nothing left to read: W delivers B's gradients
        stage_backward_weight(stage.parameters(), handoff)
        return
    with pytest.raises(SplitBackwardError, match="modified in place after B"):
        stage_backward_weight(stage.parameters(), handoff)
    assert all(p.grad is None for p in stage.parameters())


def _exact_b_elsewhere(run_b: Callable[[Callable[[], Any]], Any]) -> None:
    torch.manual_seed(0)
    stage = Mlp(16, 2, "full").double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 16, dtype=torch.float64)
    y = stage(x)
    y.backward(g, retain_graph=True)
    want = [p.grad.clone() for p in stage.parameters()]  # type: ignore[union-attr]
    stage.zero_grad(set_to_none=True)
    y = stage(x)
    handoff = run_b(lambda: stage_backward_input(y, g, [x], stage.parameters())[1])
    stage_backward_weight(stage.parameters(), handoff)
    for p, w in zip(stage.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-12)


def test_b_under_inference_mode_keeps_w_exact_on_a_checkpointed_stage() -> None:
    def run_b(b: Callable[[], Any]) -> Any:
        with torch.inference_mode():
            return b()

    _exact_b_elsewhere(run_b)


def test_b_on_another_thread_keeps_w_exact_on_a_checkpointed_stage() -> None:
    import threading

    def run_b(b: Callable[[], Any]) -> Any:
        out: list[Any] = []
        thread = threading.Thread(target=lambda: out.append(b()))
        thread.start()
        thread.join(60)
        return out[0]

    _exact_b_elsewhere(run_b)


def test_a_post_hook_on_a_checkpointed_op_keeps_its_weight_gradients_in_b() -> None:
    # A node post hook sees the input and weight gradients together: only B
    # computing both gives it what a fused backward does (W could not call the
    # node without refusing it), so that op falls back to IN_B, exactly.
    def run(split: bool) -> tuple[list[torch.Tensor], list[int]]:
        torch.manual_seed(0)
        stage = Mlp(8, 1, "full").double()
        x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        y = stage(x)
        node = y.grad_fn.next_functions[1][0]  # type: ignore[union-attr]
        assert node is not None and node.name() == "AddmmBackward0"
        seen: list[int] = []
        node.register_hook(lambda gi, go: seen.append(sum(g is not None for g in gi)))
        if split:
            _, handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
            assert handoff.num_kept > 0
            stage_backward_weight(stage.parameters(), handoff)
        else:
            y.backward(torch.ones_like(y))
        return [p.grad for p in stage.parameters()], seen  # type: ignore[misc]

    (want, fused_seen), (got, split_seen) = run(False), run(True)
    assert split_seen == fused_seen
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_choosing_recompute_in_w_warns_that_stateful_regions_are_not_detected() -> None:
    with pytest.warns(UserWarning, match="updates state it reads"):
        with checkpointed_weights(RECOMPUTE):
            pass


class _Frozen(nn.Module):
    """A checkpointed block reading a trainable weight and a frozen one."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.frozen = nn.Parameter(torch.randn(d, d), requires_grad=False)

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(torch.tanh(self.fc1(x)) @ self.frozen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._region, x, use_reentrant=False)


_STEPS: dict[str, Callable[[nn.Module], object]] = {
    "optimizer": lambda m: torch.optim.SGD(m.parameters(), lr=0.1).step(),
    "foreach-adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.1, foreach=True).step(),
    "clamp": lambda m: [p.clamp_(-0.01, 0.01) for p in m.parameters()],
    "ema-first-weight": lambda m: m[0].fc1.weight.mul_(0.5),
    "frozen-weight": lambda m: m[0].frozen.mul_(0.5),
}


@pytest.mark.parametrize("policy", list(CheckpointedWeights), ids=lambda p: p.name)
@pytest.mark.parametrize("step", _STEPS.values(), ids=list(_STEPS))
@pytest.mark.parametrize("blocks", [1, 2])
def test_w_refuses_a_checkpointed_stage_whose_parameter_changed_in_place_after_b(
    policy: CheckpointedWeights, step: Callable[[nn.Module], object], blocks: int
) -> None:
    # An optimizer, EMA or clamp step run before the last W: exact or refused.
    # RECOMPUTE_IN_W recomputes the regions in W with the new values, so it
    # must refuse; IN_W refuses where W reads B's recomputed views of them.
    torch.manual_seed(0)
    stage = nn.Sequential(*(_Frozen(16) for _ in range(blocks))).double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y = stage(x)
    y.backward(torch.ones_like(y), retain_graph=True)
    want = [p.grad for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    y = stage(x)
    with checkpointed_weights(policy):
        _, handoff = stage_backward_input(y, torch.ones_like(y), [x], stage.parameters())
    grads = [p.grad for p in stage.parameters()]
    for p in stage.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    with torch.no_grad():
        step(stage)
    stage.zero_grad(set_to_none=True)
    try:
        grads = list(stage_backward_weight(stage.parameters(), handoff))
    except SplitBackwardError as exc:
        assert "modified in place after B" in str(exc) and "W has run" in str(exc)
        assert all(p.grad is None for p in stage.parameters())
        return
    assert policy is not CheckpointedWeights.RECOMPUTE_IN_W, "W recomputed with the new values"
    for got, ref in zip(grads, want):
        assert (got is None and ref is None) or torch.equal(got, ref)  # type: ignore[arg-type]
