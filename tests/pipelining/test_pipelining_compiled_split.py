"""A torch.compile'd region's backward under the patch: input gradients in B, weight GEMMs in W.

A stage of two MLP blocks (LayerNorm, Linear d->4d, GELU, Linear 4d->d, fp64)
compiled per block (wrapped or in place), with activation checkpointing inside
the compiled region or around it, and with dynamic shapes, against the same
stage eager: W's matmul FLOPs equal the eager split's W, B+W the compiled fused
backward's, gradients match a fused backward, nothing compiles again for a
second microbatch, and what B keeps for W is no more than the eager split keeps.
Where the split cannot be built the region's backward runs whole in B, exact,
with one warning.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._functorch.config
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradsafe
from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import LiveStorage, MatmulFlops

D = 16

_HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None
_BACKENDS = [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(not _HAS_CXX, reason="inductor needs C++")),
]


class _Block(nn.Module):
    def __init__(self, checkpoint_inside: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)
        self.checkpoint_inside = checkpoint_inside

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_inside:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class _Stage(nn.Module):
    def __init__(self, blocks: list[Callable[..., Any]], around: bool) -> None:
        super().__init__()
        self.blocks = blocks
        self.around = around

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.around else block(x)
        return x


def _stages(layout: str, backend: str) -> tuple[nn.ModuleList, _Stage, _Stage]:
    """(the parameters, the eager stage, the compiled stage over the same parameters)."""
    torch.manual_seed(0)
    # torch's own fused backward fails a checkpoint around two sites of one
    # compiled graph (pytorch#166926): one block there.
    count = 1 if layout == "checkpoint_around" else 2
    blocks = nn.ModuleList(_Block(layout == "checkpoint_inside") for _ in range(count)).double()
    eager = _Stage(list(blocks), around=layout == "checkpoint_around")
    if layout == "in_place":
        twins = copy.deepcopy(blocks)  # Module.compile changes the module itself
        for twin, block in zip(twins.modules(), blocks.modules()):
            twin._parameters = block._parameters  # the same Parameters
        for twin in twins:
            twin.compile(backend=backend)
        compiled = list(twins)
    else:
        dynamic = layout == "dynamic"
        compiled = [torch.compile(b, backend=backend, dynamic=dynamic) for b in blocks]
    return blocks, eager, _Stage(compiled, around=layout == "checkpoint_around")


def _split(
    stage: nn.Module, params: list[nn.Parameter], x: torch.Tensor, g: torch.Tensor
) -> tuple[list[torch.Tensor], MatmulFlops, int]:
    """B then W with FLOPs per phase and bytes alive between them; returns the gradients."""
    for t in (x, *params):
        t.grad = None
    # The forward under the same modes as a checkpoint's recomputation in B:
    # dynamo would otherwise pick another graph for it.
    with LiveStorage([*params, x, g]) as live, MatmulFlops() as flops:
        flops.phase = "forward"
        y = stage(x)
        flops.phase = "B"
        (dx,), handoff = stage_backward_input([y], [g], [x], params)
        del y
        held = live.live() - dx.untyped_storage().nbytes()
        flops.phase = "W"
        stage_backward_weight(params, handoff)
    return [dx, *(p.grad for p in params)], flops, held  # type: ignore[list-item]


def _fused(
    stage: nn.Module, params: list[nn.Parameter], x: torch.Tensor, g: torch.Tensor
) -> tuple[list[torch.Tensor], int]:
    with MatmulFlops() as flops:
        y = stage(x)
        flops.phase = "backward"
        grads = torch.autograd.grad(y, [x, *params], g)
    return list(grads), flops.counts["backward"]


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((u - v).abs().max() / v.abs().max()).item() for u, v in zip(a, b))


def _compiles() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]


@pytest.fixture
def patched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with gradsafe.patch("pipelining"):
        yield
    torch._dynamo.reset()


_LAYOUTS = ["wrapped", "in_place", "checkpoint_inside", "checkpoint_around", "dynamic"]


@pytest.mark.usefixtures("patched")
@pytest.mark.parametrize("layout", _LAYOUTS)
@pytest.mark.parametrize("backend", _BACKENDS)
def test_compiled_stage_splits_its_weight_gemms_into_w_exactly(backend: str, layout: str) -> None:
    torch._dynamo.reset()
    blocks, eager, compiled = _stages(layout, backend)
    params = list(blocks.parameters())
    torch.manual_seed(1)
    # 0.25·d, d and 4·d tokens where the shape matters; d elsewhere (compiling is slow on CPU).
    sizes = (D // 4, D, 4 * D) if layout in ("wrapped", "dynamic") else (D,)
    for tokens in sizes:
        x = torch.randn(tokens, D, dtype=torch.float64, requires_grad=True)
        g = torch.randn(tokens, D, dtype=torch.float64)
        reference, _ = _fused(eager, params, x, g)
        _, eager_flops, eager_held = _split(eager, params, x, g)
        fused, fused_total = _fused(compiled, params, x, g)
        grads, flops, held = _split(compiled, params, x, g)
        before = _compiles()
        again, again_flops, _ = _split(compiled, params, x, g)  # the next microbatch
        assert _compiles() == before, "a second microbatch compiled again"
        assert _max_rel(grads, reference) <= 1e-12
        assert _max_rel(grads, fused) <= 1e-12
        assert _max_rel(again, grads) == 0
        assert flops.counts["W"] >= 0.98 * eager_flops.counts["W"] > 0, tokens
        assert flops.counts["B"] + flops.counts["W"] <= 1.02 * fused_total, tokens
        assert dict(again_flops.counts) == dict(flops.counts)
        assert held <= 1.05 * eager_held, (tokens, held, eager_held)


def test_region_compiled_before_the_patch_runs_whole_in_b_exactly_and_says_so(
    fp64: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with torch._functorch.config.patch(donated_buffer=False):
        _region_compiled_before_the_patch(tmp_path, monkeypatch)


def _region_compiled_before_the_patch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    # (Compiled donating its buffers it is refused before it runs: see
    # test_pipelining_compiled_donation.py.)
    blocks, eager, compiled = _stages("wrapped", "aot_eager")
    params = list(blocks.parameters())
    x = torch.randn(D, D, requires_grad=True)
    g = torch.randn(D, D)
    compiled(x).sum().backward()  # compiled without the split
    reference, _ = _fused(eager, params, x, g)
    counts = []
    with gradsafe.patch("pipelining"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for t in (x, *params):
                t.grad = None
            y = compiled(x)  # outside a dispatch mode: dynamo's compiled code is reused
            with MatmulFlops() as flops:
                flops.phase = "B"
                (dx,), handoff = stage_backward_input([y], [g], [x], params)
                flops.phase = "W"
                stage_backward_weight(params, handoff)
            counts.append(dict(flops.counts))
    assert _max_rel([dx, *(p.grad for p in params)], reference) <= 1e-12  # type: ignore[misc]
    assert counts[0] == counts[1] and counts[0].get("W", 0) == 0 and counts[0]["B"] > 0
    messages = [
        str(w.message) for w in caught if "compiled without gradsafe's split" in str(w.message)
    ]
    assert len(messages) == 1, messages  # one region (both blocks share its graph), one warning
    torch._dynamo.reset()


def test_a_drifted_aot_stage2_leaves_compiled_regions_whole_in_b_exactly_naming_why(
    fp64: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: object
) -> None:
    # A torch whose aot_stage2_compile takes other parameters: the split is not installed (the
    # doctor's probe names the difference), compiled regions run whole in B, exact, one warning
    # per region saying why, and zero-bubble schedules keep torch's refusal of compiled stages.
    # (fresh_registry: the patch plans afresh, on the drifted torch.)
    import torch._functorch.aot_autograd as aot

    from gradsafe.pipelining import _torch

    original = aot.aot_stage2_compile

    def drifted(state: Any, capture: Any, partition: Any, fw: Any, *rest: Any) -> Any:
        return original(state, capture, partition, fw, *rest)

    monkeypatch.setattr(aot, "aot_stage2_compile", drifted)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    why = _torch.compiled_split_unsupported()
    assert why is not None and "aot_stage2_compile takes" in why, why
    torch._dynamo.reset()
    blocks, eager, compiled = _stages("wrapped", "aot_eager")
    params = list(blocks.parameters())
    x, g = torch.randn(D, D, requires_grad=True), torch.randn(D, D)
    reference, _ = _fused(eager, params, x, g)
    module, check = _torch.COMPILE_CHECK
    with (
        torch._functorch.config.patch(donated_buffer=False),
        gradsafe.patch("pipelining"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        assert aot.aot_stage2_compile is drifted
        assert not gradsafe.is_object_patched(module, check)
        y = compiled(x)
        with MatmulFlops() as flops:
            flops.phase = "B"
            (dx,), handoff = stage_backward_input([y], [g], [x], params)
            flops.phase = "W"
            stage_backward_weight(params, handoff)
    assert _max_rel([dx, *(p.grad for p in params)], reference) <= 1e-12  # type: ignore[misc]
    assert flops.counts.get("W", 0) == 0 and flops.counts["B"] > 0
    messages = [str(w.message) for w in caught if "not what the split wraps" in str(w.message)]
    assert len(messages) == 1 and "aot_stage2_compile takes" in messages[0], messages
    torch._dynamo.reset()


def test_the_patch_keeps_aotautograds_cache_from_loading_or_storing_a_backward() -> None:
    import torch._functorch.aot_autograd as aot

    # config.patch, not monkeypatch: undoing a setattr deletes the config entry.
    with torch._functorch.config.patch(enable_autograd_cache=True):
        assert aot.should_use_local_autograd_cache()
        with gradsafe.patch("pipelining"):
            assert not aot.should_use_local_autograd_cache()
            assert not aot.should_use_remote_autograd_cache()
        assert aot.should_use_local_autograd_cache()


@pytest.mark.usefixtures("patched")
def test_aot_function_with_only_a_forward_compiler_compiles_its_backward_with_it() -> None:
    # aot_function(f, fw_compiler) leaves bw_compiler None: AOTAutograd compiles the backward
    # with fw_compiler, and so must the split's wrapper (it called None, a TypeError).
    from torch._functorch.aot_autograd import aot_function

    compiled: list[int] = []

    def compiler(gm: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        compiled.append(len(gm.graph.nodes))
        return gm

    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(torch.tanh(x @ w).sum(), [x, w])
    got = torch.autograd.grad(
        aot_function(lambda a, b: torch.tanh(a @ b), compiler)(x, w).sum(), [x, w]
    )
    assert len(compiled) >= 2  # the forward and the backward, both by fw_compiler
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_a_parameter_reaching_the_region_through_a_view_is_exact(
    fp64: None,
) -> None:
    torch._dynamo.reset()
    w = nn.Parameter(torch.randn(D, D))

    def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    compiled = torch.compile(block, backend="aot_eager")
    x = torch.randn(4, D, requires_grad=True)
    g = torch.randn(4, D)
    reference = torch.autograd.grad(block(x, w.t()), [x, w], g)
    with gradsafe.patch("pipelining"):
        (dx,), handoff = stage_backward_input([compiled(x, w.t())], [g], [x], [w])
        stage_backward_weight([w], handoff)
    assert w.grad is not None
    assert _max_rel([dx, w.grad], list(reference)) <= 1e-12
    torch._dynamo.reset()


@pytest.mark.parametrize("schedule", ["ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"])
def test_zero_bubble_schedules_take_compiled_stages_under_the_patch_and_split_them(
    fp64: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, schedule: str
) -> None:
    """torch's own schedules (one gloo rank, its two stages local), stages holding
    OptimizedModules: torch refuses them; under the patch they run, each B of stage 1 leaves
    its compiled regions' weight graphs to the schedule's W, and the gradients are exact."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    from gradsafe.pipelining import _compiled

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = [_Block(False).double() for _ in range(2)]
    refs = copy.deepcopy(blocks)
    mods = [nn.Sequential(torch.compile(b, backend="aot_eager")) for b in blocks]
    x, target = torch.randn(8, D), torch.randn(8, D)

    def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((y - t) ** 2).sum()

    for xm, tm in zip(x.chunk(4), target.chunk(4)):
        loss_fn(refs[1](refs[0](xm)), tm).backward()
    runs: list[object] = []
    original = _compiled._WeightRun.__init__

    def counting(self: Any, *args: Any) -> None:
        runs.append(self)
        original(self, *args)

    monkeypatch.setattr(_compiled._WeightRun, "__init__", counting)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
        cls = getattr(schedules, schedule)
        if hasattr(schedules, "_check_torch_compile_compatibility"):
            with pytest.raises(RuntimeError, match="torch.compile"):
                cls(stages, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)
        with gradsafe.patch("pipelining"):
            stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
            try:
                cls(stages, n_microbatches=4, loss_fn=loss_fn, scale_grads=False).step(
                    x, target=target
                )
            except RuntimeError as exc:  # torch 2.11 sends between local stages over gloo
                if "state_ >= CONNECTED" in str(exc) or "Pair is not connected" in str(exc):
                    pytest.skip("this torch cannot run two stages on one gloo rank")
                raise
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    # Stage 1's B leaves its region's dW to W (4 microbatches); stage 0's input needs no
    # gradient, so torch runs its backward fused (stage_backward): dW at once, nothing recorded.
    assert len(runs) == 4
    for block, ref in zip(blocks, refs):
        for p, q in zip(block.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


def test_another_instance_warmed_up_before_the_patch_is_refused_naming_the_patch(
    fp64: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two instances of one block class share dynamo's compiled code: a fused backward through
    the first, before the patch, compiles the shared backward donating its buffers, and the
    second's split is refused before anything runs, naming what happened and the patch."""
    from gradsafe.pipelining import SplitBackwardError

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    first, second = _Block(False).double(), _Block(False).double()
    x = torch.randn(4, D, requires_grad=True)
    torch.compile(first, backend="aot_eager")(x).sum().backward()
    compiled = torch.compile(second, backend="aot_eager")
    with gradsafe.patch("pipelining"):
        y = compiled(x)
        with pytest.raises(SplitBackwardError, match="another instance") as info:
            stage_backward_input([y], [torch.ones_like(y)], [x], list(second.parameters()))
    assert "gradsafe.patch() before the block's first compile" in str(info.value)
    assert all(p.grad is None for p in second.parameters())
    torch._dynamo.reset()


def test_a_fused_warm_up_under_the_patch_leaves_the_split_exact(
    fp64: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With torch's defaults (donated_buffer on) a region compiled under the patch compiles its
    split graphs without donation, so a fused first backward does not stop a later split."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    with gradsafe.patch("pipelining"):
        blocks, eager, compiled = _stages("wrapped", "aot_eager")
        params = list(blocks.parameters())
        x, g = torch.randn(D, D, requires_grad=True), torch.randn(D, D)
        compiled(x).sum().backward()  # the fused warm-up compiles the backward
        reference, _ = _fused(eager, params, x, g)
        grads, flops, _ = _split(compiled, params, x, g)
    assert _max_rel(grads, reference) <= 1e-12
    assert flops.counts["W"] > 0
    torch._dynamo.reset()


# -- where the split declines: whole in B, exact, and the warning says why ---------------


class _ScaledByHistory(torch.autograd.Function):
    """A weight gradient scaled by a buffer its backward then updates in place (a delayed-
    scaling history): the weight GEMM must read the buffer before the write."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, stat: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, stat)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w, stat = ctx.saved_tensors
        gw = (x.t() @ g) * stat
        stat.mul_(0.5).add_(1.0)
        return g @ w.t(), gw, None


class _History(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("stat", torch.full((4, 4), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_ScaledByHistory.apply(x, self.w, self.stat))


def _declined(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "The split declined it" in str(w.message)]


@pytest.mark.usefixtures("patched")
def test_a_backward_writing_a_buffer_a_weight_gradient_reads_runs_whole_in_b_exactly(
    fp64: None,
) -> None:
    torch.manual_seed(0)
    base = _History()
    x, g = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    eager = copy.deepcopy(base)
    torch.autograd.backward(eager(x), g)
    fused, split = copy.deepcopy(base), copy.deepcopy(base)
    torch.autograd.backward(torch.compile(fused, backend="aot_eager")(x), g)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.compile(split, backend="aot_eager")(x)
        _, handoff = stage_backward_input([y], [g], [x], [split.w])
        stage_backward_weight([split.w], handoff)
    for model in (fused, split):  # the fused one under the patch too: it ran dI before dW
        assert _max_rel([model.w.grad], [eager.w.grad]) <= 1e-12  # type: ignore[list-item]
        torch.testing.assert_close(model.stat, eager.stat, rtol=0, atol=0)
    (message,) = _declined(caught)
    assert "writes a tensor in place" in message


@torch.library.custom_op("gradsafe_tests::draws", mutates_args=())
def _draws(g: torch.Tensor) -> torch.Tensor:
    """The same values, the global generator advanced (stochastic rounding's draw), untagged."""
    return g * (1.0 + 0.0 * torch.rand(()))


_draws.register_fake(lambda g: torch.empty_like(g))


class _DrawingWeightGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w.t(), _draws(x.t() @ g)


@pytest.mark.usefixtures("patched")
def test_a_custom_op_drawing_random_numbers_untagged_stays_in_b(fp64: None) -> None:
    # In W it would draw after the next microbatch's forward: that one's dropout mask would move.
    w = nn.Parameter(torch.randn(8, 8))
    f = torch.compile(
        lambda x: nn.functional.dropout(_DrawingWeightGradient.apply(x, w), 0.5),
        backend="aot_eager",
    )
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    gs = [torch.randn(4, 8) for _ in range(2)]

    def run(split: bool) -> torch.Tensor:
        torch.manual_seed(42)
        w.grad = None
        handoffs = []
        for x, g in zip(xs, gs):  # F0 B0 F1 B1 W0 W1
            if split:
                handoffs.append(stage_backward_input([f(x)], [g], [x], [w])[1])
            else:
                torch.autograd.backward(f(x), g)
        for handoff in handoffs:
            stage_backward_weight([w], handoff)
        return w.grad.clone()  # type: ignore[union-attr]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the declined region's warning: pinned below
        torch.testing.assert_close(run(True), run(False), rtol=0, atol=0)


@pytest.mark.usefixtures("patched")
@pytest.mark.parametrize("backend", _BACKENDS)
def test_a_convolution_compiles_and_is_exact_under_the_patch(fp64: None, backend: str) -> None:
    # convolution_backward returns its input, weight and bias gradients from one kernel: B
    # takes the tuple's items itself (inductor cannot hand a tuple across graphs).
    torch.manual_seed(0)
    conv = nn.Conv1d(8, 8, 3, padding=1)
    params = list(conv.parameters())
    x, g = torch.randn(1, 8, 6, requires_grad=True), torch.randn(1, 8, 6)
    reference, _ = _fused(conv, params, x, g)
    compiled = torch.compile(copy.deepcopy(conv), backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = list(compiled.parameters())
        (dx,), handoff = stage_backward_input([compiled(x)], [g], [x], mine)
        stage_backward_weight(mine, handoff)
    assert _max_rel([dx, *(p.grad for p in mine)], reference) <= 1e-12  # type: ignore[misc]
    assert all("kernels that compute its input gradients" in m for m in _declined(caught))


@pytest.mark.usefixtures("patched")
def test_a_region_without_parameters_runs_in_b_without_a_warning(fp64: None) -> None:
    f = torch.compile(lambda t: torch.tanh(t) * 2, backend="aot_eager")
    x, g = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (dx,), handoff = stage_backward_input([f(x)], [g], [x], [])
        stage_backward_weight([], handoff)
    torch.testing.assert_close(dx, g * 2 * (1 - torch.tanh(x) ** 2))
    assert not [w for w in caught if "compiled without gradsafe's split" in str(w.message)]
