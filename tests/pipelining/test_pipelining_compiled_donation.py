"""Compiled blocks with torch's defaults (``donated_buffer`` on) under a split backward.

And under a zero-bubble schedule, whose metadata inference runs the blocks' first backward
before the first microbatch: gradsafe keeps that graph so the backward compiles without
donation, and a fused schedule keeps torch's donation.

AOTAutograd compiles a block's backward lazily, on its first run, and drops the
buffer donation when that run keeps the graph (as B's does). A split is refused
only where the installed torch would really refuse: a backward already compiled
with donation, e.g. by a fused warm-up step, or loaded so from AOTAutograd's
on-disk cache by a later process. Every test compiles into a cache directory of
its own (TORCHINDUCTOR_CACHE_DIR), so no earlier run's entries decide it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from gradsafe.pipelining import (
    SplitBackwardError,
    stage_backward_input,
    stage_backward_weight,
)

pytestmark = pytest.mark.usefixtures("fp64")


@pytest.fixture(autouse=True)
def _own_compile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # inductor reads the variable at each use; dynamo's in-memory state is reset per test.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))


_BACKENDS = [
    "aot_eager",
    pytest.param(
        "inductor",
        marks=pytest.mark.skipif(
            shutil.which("g++") is None and shutil.which("c++") is None,
            reason="inductor on CPU needs a C++ compiler",
        ),
    ),
]


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w.T) * 2


def _stage(block, w1: nn.Parameter, w2: nn.Parameter, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    # Two sites of one compiled block (its backward node class is shared), one
    # weight also used outside it.
    return block(block(x, w1), w2) + x @ w1.T


def _fused_eager(
    w1: nn.Parameter, w2: nn.Parameter, x: torch.Tensor, g: torch.Tensor
) -> list[torch.Tensor]:
    return list(torch.autograd.grad(_stage(_block, w1, w2, x), [x, w1, w2], g))


def _split(
    block, w1: nn.Parameter, w2: nn.Parameter, x: torch.Tensor, g: torch.Tensor
) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    for t in (x, w1, w2):
        t.grad = None
    (dx,), handoff = stage_backward_input([_stage(block, w1, w2, x)], [g], [x], [w1, w2])
    stage_backward_weight([w1, w2], handoff)
    assert dx is not None and w1.grad is not None and w2.grad is not None
    return [dx, w1.grad, w2.grad]


@pytest.mark.parametrize("backend", _BACKENDS)
def test_block_first_run_by_a_split_is_exact_with_torch_defaults(backend: str) -> None:
    torch._dynamo.reset()
    assert torch._functorch.config.donated_buffer  # torch's default, not patched here
    torch.manual_seed(0)
    w1, w2 = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    block = torch.compile(_block, backend=backend, fullgraph=True)
    for step in range(2):  # the first split compiles the backward, the second reuses it
        g = torch.randn(3, 4)
        want = _fused_eager(w1, w2, x, g)
        got = _split(block, w1, w2, x, g)
        for name, a, b in zip(("x", "w1", "w2"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"step {step}: {name}")
    # The backward compiled without donation: a fused backward after it works too.
    g = torch.randn(3, 4)
    for t in (x, w1, w2):
        t.grad = None
    _stage(block, w1, w2, x).backward(g)
    torch.testing.assert_close(w2.grad, _fused_eager(w1, w2, x, g)[2], rtol=1e-9, atol=1e-12)


def _torch_refuses_a_kept_graph(block, w1: nn.Parameter, w2: nn.Parameter, x: torch.Tensor) -> bool:  # type: ignore[no-untyped-def]
    try:
        torch.autograd.grad(_stage(block, w1, w2, x).sum(), [x, w1, w2], retain_graph=True)
    except RuntimeError as exc:
        assert "donated" in str(exc)
        return True
    return False


@pytest.mark.parametrize("backend", _BACKENDS)
def test_block_warmed_up_by_a_fused_backward_is_refused_at_b_exactly_when_torch_refuses(
    backend: str,
) -> None:
    """aot_eager's warm-up compiles the backward donating its buffers; inductor's (on CPU, here)
    donates none: refused in the first case, exact in the second, decided from torch's state."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    w1, w2 = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    block = torch.compile(_block, backend=backend, fullgraph=True)
    _stage(block, w1, w2, x).sum().backward()  # compiles the backward without keeping the graph
    refuses = _torch_refuses_a_kept_graph(block, w1, w2, x)
    if backend == "aot_eager":
        assert refuses  # the case the refusal exists for must still exist
    for t in (x, w1, w2):
        t.grad = None
    g = torch.randn(3, 4)
    if not refuses:
        got = _split(block, w1, w2, x, g)
        for a, b in zip(got, _fused_eager(w1, w2, x, g)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        return
    out = _stage(block, w1, w2, x)
    with pytest.raises(SplitBackwardError, match=r"donated_buffer = False") as info:
        stage_backward_input([out], [g], [x], [w1, w2])
    assert "already compiled" in str(info.value)
    assert x.grad is None and w1.grad is None and w2.grad is None


_PROCESS = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from gradsafe.pipelining import SplitBackwardError, stage_backward_input, stage_backward_weight

    torch.set_default_dtype(torch.float64)

    def block(x, w):
        return torch.tanh(x @ w.T) * 2

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    if sys.argv[1] == "warm-up":
        compiled(x, w).sum().backward()  # fused: compiles the backward donating its buffers
        w.grad = x.grad = None
    try:
        (dx,), handoff = stage_backward_input([compiled(x, w).sum()], None, [x], [w])
    except SplitBackwardError as exc:
        print("REFUSED", x.grad is None and w.grad is None, exc)
        sys.exit(0)
    stage_backward_weight([w], handoff)
    want = torch.autograd.grad(block(x, w).sum(), [x, w])
    torch.testing.assert_close(dx, want[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-9, atol=1e-12)
    print("EXACT")
    """
)


def _process(cache: Path, first: str, **env: str) -> str:
    """One process compiling the block into ``cache``: its report (REFUSED ... or EXACT)."""
    result = subprocess.run(
        [sys.executable, "-c", _PROCESS, first],
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor on CPU needs a C++ compiler",
)
def test_donation_from_inductors_on_disk_cache_is_refused_naming_the_cache(tmp_path: Path) -> None:
    """A process whose fused warm-up compiled the backward donating leaves that backward in
    AOTAutograd's on-disk cache: a later process whose split runs the block first loads it and is
    refused too, with a message naming the cache (no warm-up ran there), and is exact without
    that cache."""
    cache = tmp_path / "inductor-cache"
    warmed = _process(cache, "warm-up")  # refused on CPU with 2.13 and 2.15, as docs say
    assert warmed.startswith("REFUSED True") and "already compiled" in warmed, warmed
    later = _process(cache, "split")
    assert later.startswith("REFUSED True"), later
    assert "on-disk cache" in later and "TORCHINDUCTOR_AUTOGRAD_CACHE=0" in later, later
    assert "already compiled" not in later, later
    assert _process(cache, "split", TORCHINDUCTOR_AUTOGRAD_CACHE="0") == "EXACT"


class _Block(nn.Module):
    """torchtitan's way: one block class, each instance compiled in place (they share its code)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * 2  # tanh's output: a saved buffer the backward donates


def _blocks(compiled: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [_Block(), _Block()]
    for block in blocks:
        if compiled:
            block.compile(backend="aot_eager", fullgraph=True)
    return blocks


def _pipeline_grads(schedule: str, blocks: list[nn.Module]) -> list[torch.Tensor]:
    from torch.distributed.pipelining import PipelineStage, schedules

    from gradsafe.pipelining.schedule._inference_hazards import one_rank_world

    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, 8, generator=gen)
    with one_rank_world():
        stages = [PipelineStage(b, i, 2, torch.device("cpu")) for i, b in enumerate(blocks)]
        runner = getattr(schedules, schedule)(
            stages, n_microbatches=4, loss_fn=nn.functional.mse_loss
        )
        try:
            runner.step(x, target=target)
        except RuntimeError as exc:  # torch 2.11 sends between local stages over gloo
            if "state_ >= CONNECTED" in str(exc) or "Pair is not connected" in str(exc):
                pytest.skip("this torch cannot run two stages on one gloo rank")
            raise
        if schedule != "ScheduleInterleaved1F1B":
            # A step after the one that ran the inference: its first B reads the donation
            # record the inference left.
            for block in blocks:
                block.zero_grad(set_to_none=True)
            runner.step(x, target=target)
    return [p.grad for b in blocks for p in b.parameters()]  # type: ignore[misc]


def _accumulated_grads() -> list[torch.Tensor]:
    blocks = _blocks(compiled=False)
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, 8, generator=gen)
    for xs, goal in zip(x.chunk(4), target.chunk(4)):
        (nn.functional.mse_loss(blocks[1](blocks[0](xs)), goal) / 4).backward()
    return [p.grad for b in blocks for p in b.parameters()]  # type: ignore[misc]


@pytest.mark.distributed
# DualPipeV on one rank runs fused backwards but for its first stage's last microbatch (whose
# input needs no gradient): nothing there for the donation to refuse. test_torchtitan.py runs it
# on two ranks.
@pytest.mark.parametrize("schedule", ["ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"])
def test_compiled_blocks_first_run_by_the_metadata_inference_split_exactly_with_donation_on(
    schedule: str,
) -> None:
    """torch's metadata inference backwards through every non-first stage before the first
    microbatch: without gradsafe keeping that graph, the blocks' shared backward was compiled
    donating its buffers there and the first B was refused (torchtitan with --compile.enable)."""
    torch._dynamo.reset()
    assert torch._functorch.config.donated_buffer  # torch's default, not patched here
    import gradsafe

    with gradsafe.patch("pipelining"):
        got = _pipeline_grads(schedule, _blocks(compiled=True))
    for a, b in zip(got, _accumulated_grads()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.distributed
def test_a_fused_schedules_compiled_blocks_keep_torchs_buffer_donation() -> None:
    """Only a schedule that splits keeps the inference's graph: a fused one's blocks compile
    their backward donating, as without gradsafe."""
    torch._dynamo.reset()
    import gradsafe

    blocks = _blocks(compiled=True)
    with gradsafe.patch("pipelining"):
        got = _pipeline_grads("ScheduleInterleaved1F1B", blocks)
    for a, b in zip(got, _accumulated_grads()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="donated"):
        torch.autograd.grad(blocks[0](x).sum(), list(blocks[0].parameters()), retain_graph=True)


def test_a_split_after_another_instances_fused_backward_is_refused_saying_what_happened() -> None:
    """Instances of one class compiled in place share one compiled backward: a fused backward
    through one (a reference model, a warm-up) donates for all. The refusal says so, and what to
    do, instead of blaming a warm-up step of this block."""
    torch._dynamo.reset()
    reference, stage = _blocks(compiled=True)
    x = torch.randn(3, 8, requires_grad=True)
    reference(x).sum().backward()  # compiles the shared backward, freeing the graph: donates
    with pytest.raises(SplitBackwardError) as info:
        stage_backward_input([stage(x).sum()], None, [x], list(stage.parameters()))
    text = str(info.value)
    assert "another instance of its class" in text, text
    assert "first step under gradsafe.patch()" in text, text
    assert "donated_buffer = False" in text, text
    assert all(p.grad is None for p in stage.parameters())


@pytest.mark.distributed
def test_blocks_another_instance_donated_for_before_the_patch_recompile_split_and_are_exact() -> (
    None
):
    """Another instance's fused backward, before the patch, compiled the class's shared backward
    donating; under the patch the schedule's regions compile anew (the patch changes what
    AOTAutograd compiles with), split, without donation: exact, where the inference met the
    donated backward and was refused before the compiled split."""
    torch._dynamo.reset()
    import gradsafe

    blocks = _blocks(compiled=True)
    other = _blocks(compiled=True)[0]
    other(torch.randn(3, 8)).sum().backward()  # compiles the shared backward donating
    with gradsafe.patch("pipelining"):
        got = _pipeline_grads("ScheduleZBVZeroBubble", blocks)
    for a, b in zip(got, _accumulated_grads()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
