"""``gradsafe.verify.verify`` on models where torch's split is wrong, crashes or skips hooks."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining._hazards import (
    ParamOnlyOutput,
    ReusedAroundOther,
    ReusedLinear,
    compare_with_fused,
)
from gradsafe.testing import assert_split_exact
from gradsafe.verify import VerifyReport, _api, verify
from gradsafe.verify._run import Split


def _batches(count: int = 4, dim: int = 4) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(3, dim, generator=generator),) for _ in range(count)]


@pytest.mark.parametrize(
    ("build", "hazard", "params"),
    [
        (ReusedLinear, "H1 nested shared weight", ("lin.weight",)),
        (ParamOnlyOutput, "H1 parameter-only output", ("prefix",)),
        (ReusedAroundOther, "H1 overlapping groups", ("outer.bias", "outer.weight")),
    ],
)
def test_report_names_each_h1_variant_its_parameters_and_torchs_verdict(
    build: Any, hazard: str, params: tuple[str, ...]
) -> None:
    torch.manual_seed(0)
    report = verify(build(), _batches())
    assert report.ok, str(report)
    assert report.hazards[hazard] == params
    # torch's split, judged by the doctor's reproduction of the same hazard on this torch.
    with torch.random.fork_rng():
        try:
            upstream_right = compare_with_fused(build).correct
        except RuntimeError:  # torch's split crashes on it
            upstream_right = False
    verdicts = {r.verdict for r in report.upstream.values()}
    if upstream_right:
        assert verdicts == {"right"}, str(report)
    else:
        assert "right" not in verdicts, str(report)
    for result in report.upstream.values():
        if result.verdict == "WRONG":
            assert set(result.params) & set(params), str(report)
        if result.verdict == "crash":
            assert result.message and result.where.startswith(("B of", "W of")), str(report)


def _hooked() -> tuple[nn.Module, list[str]]:
    torch.manual_seed(0)
    module = ReusedAroundOther()
    fired: list[str] = []
    for name, param in module.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    module.inner.weight.register_hook(
        lambda g: g * 2
    )  # changes the gradient: must run exactly once
    module.inner.register_full_backward_hook(lambda m, gi, go: fired.append("inner module"))
    return module, fired


def test_post_accumulate_hooks_are_counted_and_named_as_a_hazard() -> None:
    module, fired = _hooked()
    report = verify(module, _batches(), orders=("w-after-b",))
    assert report.ok, str(report)
    assert report.hazards["H1 hooks in W"] == ("inner.weight", "outer.bias", "outer.weight")
    counts = {h.label: h for h in report.hooks}
    label = next(
        k for k in counts if k.startswith("post-accumulate hook") and k.endswith("on outer.weight")
    )
    assert counts[label].fused == 4  # once per microbatch
    assert counts[label].calls["gradsafe"]["w-after-b"] == 4
    module_hook = next(k for k in counts if k.startswith("module backward hook on inner:"))
    assert (
        counts[module_hook].fused == 4 and counts[module_hook].calls["gradsafe"]["w-after-b"] == 4
    )
    assert report.upstream["w-after-b"].verdict != "right", str(report)
    # The hooks ran on the copies: fused and gradsafe, 4 microbatches, 3 parameters and the module.
    assert fired.count("outer.weight") >= 8 and fired.count("inner module") >= 8


def test_caller_module_grads_hooks_and_rng_are_left_as_they_were() -> None:
    module, _ = _hooked()
    module.float()  # verify's copies run in float64: the caller's module must stay float32
    for p in module.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    hooks = {
        n: (dict(p._backward_hooks or {}), dict(p._post_accumulate_grad_hooks or {}))
        for n, p in module.named_parameters()
    }
    module_hooks = dict(module.inner._backward_hooks)
    rng = torch.get_rng_state()
    verify(module, _batches(), dtype=torch.float64)
    assert torch.equal(torch.get_rng_state(), rng)
    assert dict(module.inner._backward_hooks) == module_hooks
    for name, p in module.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name])
        assert torch.equal(p.grad, torch.full_like(p, 7.0))
        assert dict(p._backward_hooks or {}) == hooks[name][0]
        assert dict(p._post_accumulate_grad_hooks or {}) == hooks[name][1]


_GRADSAFE_SPLIT = _api._gradsafe_split


def _dropping_split() -> Split:
    """gradsafe's split whose W then drops ``lin.weight``'s gradient: the check must see it."""
    real = _GRADSAFE_SPLIT()

    def weight(weights: Any, handoff: Any) -> Any:
        params = list(weights)
        result = real.backward_weight(params, handoff)
        params[0].grad = None
        return result

    return Split(real.backward_input, weight, real.backward)


def test_a_split_that_drops_a_gradient_makes_the_report_not_ok(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_api, "_gradsafe_split", _dropping_split)
    torch.manual_seed(0)
    report = verify(ReusedLinear(), _batches())
    assert not report.ok
    assert all(
        r.verdict == "WRONG" and r.params == ("lin.weight",) for r in report.gradsafe.values()
    )
    row = next(r for r in report.grads if r.name == "lin.weight")
    assert row.errors["gradsafe"]["w-after-b"] == "None pattern"
    assert "lin.weight" in str(report) and "NOT OK" in str(report)
    with pytest.raises(AssertionError, match="lin.weight"):
        assert_split_exact(ReusedLinear(), _batches())


class _ReentrantOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda a: torch.tanh(self.lin(a)), x, use_reentrant=True)


def test_reentrant_checkpoint_on_the_input_side_is_reported_refused() -> None:
    report = verify(_ReentrantOnInput(), _batches())
    assert not report.ok
    assert report.refused is not None and "use_reentrant=False" in report.refused
    assert {r.verdict for r in report.gradsafe.values()} == {"refused"}
    assert "gradsafe refuses this model" in str(report)


class _Counted(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


class _CheckpointedCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Counted.apply(x, self.w)
        return checkpoint(self.mlp, h, use_reentrant=False)


def test_recomputations_and_custom_backwards_are_counted_as_fused() -> None:
    torch.manual_seed(0)
    report = verify(_CheckpointedCustom(), _batches())
    assert report.ok, str(report)
    counts = {h.label: h for h in report.hooks}
    assert counts["forward of mlp recomputed in backward"].fused == 4
    custom = next(
        h
        for label, h in counts.items()
        if label.startswith("custom Function") and "_Counted" in label
    )
    assert custom.fused == 4
    assert set(custom.calls["gradsafe"].values()) == {4}


def test_stages_in_sequence_with_a_shared_parameter_and_a_loss() -> None:
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight  # tied across two stages of one rank (V shape)
    report = verify(
        [nn.Sequential(first, nn.Tanh()), last],
        _batches(6),
        lambda out, k: out.pow(2).sum() * (k + 1),
    )
    assert report.ok, str(report)
    names = [r.name for r in report.grads]
    assert "0.0.weight" in names and "1.weight" in names and "stage 1 input 0" in names


def test_json_is_stable_and_serialisable() -> None:
    torch.manual_seed(0)
    data = verify(ParamOnlyOutput(), _batches(2), orders=("w-reversed",)).to_json()
    json.dumps(data)
    assert data["format"] == "gradsafe.verify/3"
    assert data["ok"] is True and data["checks"] == ["w-reversed"]
    assert set(data) >= {"gradsafe", "upstream", "grads", "hooks", "hazards", "refused", "dtype"}
    assert data["hazards"]["H1 parameter-only output"] == ["prefix"]


def test_the_single_process_report_fills_its_mode_fields_and_leaves_the_schedules_empty() -> None:
    torch.manual_seed(0)
    report = verify(ParamOnlyOutput(), _batches(2), orders=("w-reversed", "w-after-b"))
    assert isinstance(report, VerifyReport) and report.mode == "single-process"
    assert report.checks == report.orders == ("w-reversed", "w-after-b")
    assert list(report.gradsafe) == list(report.upstream) == ["w-reversed", "w-after-b"]
    data = report.to_json()
    assert data["mode"] == "single-process" and data["refused_only"] is False
    assert data["schedule"] is None and data["ranks"] is None
    assert isinstance(data["hooks"], list) and isinstance(data["hazards"], dict)
    assert set(data["not_seen"]) == {"H6", "H7", "how to check"}
    assert data["timing"] is None and data["memory"] is None and data["work"] is None


def test_lower_precision_uses_its_own_tolerance() -> None:
    torch.manual_seed(0)
    report = verify(ReusedAroundOther(), _batches(), dtype=torch.float32)
    assert report.ok, str(report)
    assert report.dtype == "float32" and report.tolerance > 1e-9


def test_b_refuses_a_reentrant_checkpoint_on_the_input_side_and_changes_nothing() -> None:
    from gradsafe.pipelining import SplitBackwardError, stage_backward_input

    module = _ReentrantOnInput()
    x = torch.randn(3, 4, requires_grad=True)
    out = module(x)
    with pytest.raises(
        SplitBackwardError, match="use_reentrant=True is on this stage's input side"
    ):
        stage_backward_input([out], [torch.randn(3, 4)], [x], module.parameters())
    assert x.grad is None and all(p.grad is None for p in module.parameters())


def test_hazard_scan_tells_nested_from_overlapping_uses() -> None:
    torch.manual_seed(0)
    assert verify(ReusedLinear(bias=True), _batches(1), orders=("w-after-b",)).hazards == {
        "H1 nested shared weight": ("lin.bias", "lin.weight")
    }


class _ComplexRope(nn.Module):
    """A rotary embedding with a complex cache, as torchtitan's ComplexRoPE keeps one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        angles = torch.arange(3.0)[:, None] * torch.arange(1.0, 3.0)[None, :]
        self.register_buffer("cache", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cache.is_complex():
            raise TypeError(f"the rotary cache lost its imaginary part: {self.cache.dtype}")
        h = torch.view_as_complex(self.lin(x).reshape(3, 2, 2).contiguous())
        return torch.view_as_real(h * self.cache).flatten(1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_complex_buffers_keep_their_imaginary_part_in_the_copies(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = _ComplexRope()
    before = module.cache.clone()
    report = verify(module, _batches(2), dtype=dtype, orders=("w-after-b",))
    assert report.ok, str(report)
    assert module.cache.dtype == before.dtype and torch.equal(module.cache, before)


class _SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.lin = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids)) * x


def _densifying_split() -> Split:
    """gradsafe's split whose W then turns the sparse embedding gradient dense."""
    real = _GRADSAFE_SPLIT()

    def weight(weights: Any, handoff: Any) -> Any:
        params = list(weights)
        result = real.backward_weight(params, handoff)
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        return result

    return Split(real.backward_input, weight, real.backward)


def test_sparse_gradients_are_compared_and_a_dense_one_in_their_place_is_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 10, (3,), generator=generator), torch.randn(3, 4, generator=generator))
        for _ in range(4)
    ]
    torch.manual_seed(0)
    report = verify(_SparseEmbedding(), batches)
    assert report.ok, str(report)
    monkeypatch.setattr(_api, "_gradsafe_split", _densifying_split)
    report = verify(_SparseEmbedding(), batches)
    assert not report.ok
    assert all(r.params == ("emb.weight",) for r in report.gradsafe.values()), str(report)


def test_recompute_in_w_re_running_each_region_in_w_too_is_not_reported_as_a_gradsafe_bug() -> None:
    """``CheckpointedWeights.RECOMPUTE_IN_W`` re-runs each plain region's forward in W as well as
    in B, by design: verify counts up to twice the fused recomputations as the policy chosen, not
    as a difference (it was exit 1, "a gradsafe bug", with every gradient equal)."""
    from gradsafe.pipelining import CheckpointedWeights, checkpointed_weights

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.mlp, x, use_reentrant=False)

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="RECOMPUTE_IN_W"):
        with checkpointed_weights(CheckpointedWeights.RECOMPUTE_IN_W):
            report = verify(Checkpointed(), _batches(), orders=("w-after-b",))
    assert report.ok, str(report)
    rows = {row.label: row for row in report.hooks}
    recomputed = rows["forward of mlp recomputed in backward"]
    assert recomputed.calls["gradsafe"]["w-after-b"] == 2 * recomputed.fused  # the policy's re-run
    torch.manual_seed(0)
    assert verify(Checkpointed(), _batches(), orders=("w-after-b",)).ok  # IN_W: once, as fused
