"""Memory a split backward holds: gradsafe vs torch's split vs one fused backward, side by side.

Run: PYTHONPATH=. python benchmarks/pipelining_memory.py [--device cuda]
         (every configuration below, .grad None and held, 2 microbatches)
     PYTHONPATH=. python benchmarks/pipelining_memory.py --layers 8 --dim 4096 --batch 64 [--microbatches 2]
     PYTHONPATH=. python benchmarks/pipelining_memory.py --zbv   (a real 2-rank ScheduleZBVZeroBubble step)
     PYTHONPATH=. python benchmarks/pipelining_memory.py --dp    (FSDP2 and DDP stages on 2 ranks)

1. One last pipeline stage (``layers`` x Linear(dim)+tanh, then an MSE loss),
driven the way torch's stage drives it: B for each microbatch (the stage
output is detached in place after B, as ``stage.py`` does on the last stage),
then W for each, while the losses stay referenced (the schedule keeps them in
``_internal_losses`` and returns them from ``step()``). Bytes are those of
every tensor storage created from the first forward on (activations, saved
tensors, recorded gradients, parameter gradients) that is still alive,
counted by :class:`gradsafe.testing.LiveStorage`: after each B and W, the
peak during each (after any operator), and the peak of the whole step.
Parameters, inputs and gradients held before the step are not counted. By
default two configurations: activation-dominated (8 x Linear(1024),
microbatch 512) and weight-dominated (8 x Linear(2048), microbatch 64), each
with ``.grad`` None (the first microbatch of a step) and already holding a
gradient (every later one); then the last stage of
``examples/verify_transformer.py:twelve_blocks`` (6 blocks of LayerNorm,
attention and MLP, d=128, a head tied to the first stage's embedding,
cross-entropy), without and with every other MLP activation-checkpointed
(2x16 tokens per microbatch as there; with checkpointing also 2x128).

2. ``--zbv``: one ``ScheduleZBVZeroBubble`` step on 2 gloo ranks (4 stages of
``layers / 4`` x Linear+tanh), the same counting on each rank: the most held
right after any B, right after the last W, after ``step()`` (losses kept), and
peak. "fused" runs each microbatch's whole backward in B and nothing in W.

3. ``--dp``: a middle stage wrapped over 2 gloo ranks with FSDP2 (sharded,
``reshard_after_forward`` False or True) or DDP, 3 microbatches, B and W called
as ``stage.py`` calls them ("fused": its full backward in B's place), then the
stage's gradient reduction: every point, from
``tests/pipelining/_memory_dp_worker.py`` (the run
``tests/pipelining/test_pipelining_memory_dp.py`` asserts on), rank 0 (both
ranks get the same data and hold the same).

``--device cuda`` runs part 1 on the GPU and reads CUDA's caching allocator
instead (``torch.cuda.memory_allocated`` / ``max_memory_allocated`` beyond
what was allocated before the forward, so the peaks include transients inside
an operator): a dispatch mode misses the CUDA backward, which the autograd
engine runs on its device thread.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import _backward as torch_split

from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import LiveStorage

MiB = 1 << 20
DEVICE = torch.device("cpu")  # --device


class CudaAllocated:
    """:class:`LiveStorage`'s readings from CUDA's caching allocator: bytes allocated since entry."""

    def __enter__(self) -> CudaAllocated:
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self._peak = 0
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def live(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - self.base

    @property
    def peak_since_mark(self) -> int:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - self.base
        self._peak = max(self._peak, peak)
        return peak

    @property
    def peak(self) -> int:
        return max(self._peak, self.peak_since_mark)

    def mark(self) -> int:
        self._peak = max(self._peak, self.peak_since_mark)
        torch.cuda.reset_peak_memory_stats()
        return self.live()


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run(
    impl: str,
    model: nn.Module,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    loss_fn: LossFn,
    held: bool,
) -> dict[str, float]:
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) if held else None
    existing = [*params, *xs, *ys, *(p.grad for p in params if p.grad is not None)]
    points: dict[str, float] = {}
    meter = CudaAllocated() if DEVICE.type == "cuda" else LiveStorage(existing)
    with meter as mode:
        losses, outs, handoffs = [], [], []
        for x, y in zip(xs, ys):
            out = model(x)
            loss = loss_fn(out, y)
            losses.append(loss)
            outs.append(out)
        mode.mark()
        for i, (x, loss, out) in enumerate(zip(xs, losses, outs)):
            if impl == "fused":
                loss.backward()
            else:
                split = (
                    stage_backward_input if impl == "gradsafe" else torch_split.stage_backward_input
                )
                _, handoff = split([loss], None, [x], params)
                handoffs.append(handoff)
            out.detach_()  # stage.py, last stage, after B
            points[f"peak during B{i}"] = mode.peak_since_mark
            points[f"after B{i}"] = mode.mark()
        for i, handoff in enumerate(handoffs):
            weight = (
                stage_backward_weight if impl == "gradsafe" else torch_split.stage_backward_weight
            )
            weight(params, handoff)
            handoffs[i] = None  # the schedule pops its backward_state entry at W
            points[f"peak during W{i}"] = mode.peak_since_mark
            points[f"after W{i}"] = mode.mark()
        del outs
        gc.collect()
        points["after step (losses kept)"] = mode.live()
        points["peak of the step"] = mode.peak
    return {k: v / MiB for k, v in points.items()}


def _zbv_rank(rank: int, port: int, impl: str, args: Any, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble
    from torch.distributed.pipelining import stage as stage_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    b, w = {
        "gradsafe": (stage_backward_input, stage_backward_weight),
        "torch": (torch_split.stage_backward_input, torch_split.stage_backward_weight),
        "fused": (_fused_b, lambda weights, handoff, retain_graph=False: ()),
    }[impl]
    torch.manual_seed(0)
    per_stage = max(1, args.layers // 4)
    stages_all = [
        nn.Sequential(
            *(m for _ in range(per_stage) for m in (nn.Linear(args.dim, args.dim), nn.Tanh()))
        )
        for _ in range(4)
    ]
    indices = [rank, 3 - rank]
    stages = [PipelineStage(stages_all[i], i, 4, torch.device("cpu")) for i in indices]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=args.microbatches, loss_fn=_mse)
    x = torch.randn(args.batch * args.microbatches, args.dim)
    y = torch.randn(args.batch * args.microbatches, args.dim)
    existing = [p for i in indices for p in stages_all[i].parameters()] + [x, y]
    points = {"after any B (max)": 0.0, "after the last W": 0.0}
    with LiveStorage(existing) as mode:

        def b_recorded(*a: Any) -> Any:
            result = b(*a)
            points["after any B (max)"] = max(points["after any B (max)"], mode.live())
            return result

        def w_recorded(*a: Any, **k: Any) -> Any:
            result = w(*a, **k)
            points["after the last W"] = mode.live()
            return result

        stage_module.stage_backward_input = b_recorded  # type: ignore[assignment]
        stage_module.stage_backward_weight = w_recorded  # type: ignore[assignment]
        losses: list[torch.Tensor] = []
        schedule.step(x, target=y, losses=losses) if rank == 0 else schedule.step()
        gc.collect()
        points["after step (losses kept)"] = mode.live()
        points["peak"] = mode.peak
    queue.put((rank, {k: v / MiB for k, v in points.items()}))
    dist.destroy_process_group()


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def _fused_b(outputs: Any, grads: Any, inputs: Any, weights: Any) -> Any:
    torch.autograd.backward(outputs, grads)
    dinputs = tuple(t.grad if isinstance(t, torch.Tensor) else None for t in inputs)
    return dinputs, None


def zbv(args: Any) -> None:
    import socket

    import torch.multiprocessing as mp

    print(
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, fp32; "
        f"ScheduleZBVZeroBubble, 2 gloo ranks, 4 stages of {max(1, args.layers // 4)} x "
        f"(Linear({args.dim}) + tanh), {args.microbatches} microbatches of {args.batch}, MiB per rank"
    )
    ctx = mp.get_context("spawn")
    results: dict[str, dict[int, dict[str, float]]] = {}
    for impl in ("fused", "torch", "gradsafe"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        queue = ctx.Queue()
        procs = [ctx.Process(target=_zbv_rank, args=(r, port, impl, args, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        got = dict(queue.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
        results[impl] = got
    for rank in range(2):
        print(f"rank {rank} (stages {rank} and {3 - rank})")
        print(
            f"{'point':<26}"
            + "".join(f"{impl:>12}" for impl in results)
            + f"{'gradsafe/torch':>16}"
        )
        for name in results["gradsafe"][rank]:
            row = f"{name:<26}" + "".join(f"{results[i][rank][name]:12.1f}" for i in results)
            if results["torch"][rank][name] > 0:
                row += f"{results['gradsafe'][rank][name] / results['torch'][rank][name]:15.2f}x"
            print(row)


def dp() -> None:
    import socket
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    worker = Path(__file__).resolve().parents[1] / "tests" / "pipelining" / "_memory_dp_worker.py"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(worker.parents[2]), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as out:
        procs = [
            subprocess.Popen([sys.executable, str(worker), str(r), port, out], env=env)
            for r in range(2)
        ]
        for proc in procs:
            proc.wait(timeout=600)
        result = torch.load(Path(out) / "rank0.pt", weights_only=False)
    if "crash" in result:
        raise SystemExit(result["crash"])
    print(
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, fp32; a middle "
        "stage over 2 gloo ranks, 3 microbatches, KiB of live storage on rank 0, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    points = result["points"]
    for case in dict.fromkeys(c[:3] for c in points):
        wrapper, stage, order = case
        columns = {impl: points[c] for c in points if c[:3] == case for impl in c[3:]}
        if wrapper == "fsdp resharded":
            # torch's split is wrong here; what it holds where it is right: the stage unresharded
            columns["torch, unresharded"] = points[("fsdp", stage, order, "torch")]
        baseline = "torch" if "torch" in columns else "torch, unresharded"
        print(f"\n{' / '.join(case)}")
        print(
            f"{'point':<28}"
            + "".join(f"{impl:>20}" for impl in columns)
            + f"{'gradsafe / ' + baseline:>30}"
        )
        for name in columns["gradsafe"]:
            print(
                f"{name:<28}"
                + "".join(f"{col[name] / 1024:20.1f}" for col in columns.values())
                + f"{columns['gradsafe'][name] / max(columns[baseline][name], 1):29.2f}x"
            )


class TransformerStage(nn.Module):
    """A last stage as in examples/verify_transformer.py: blocks (LayerNorm, attention, MLP),
    a final norm, and a head whose weight is the first stage's token embedding."""

    def __init__(self, dim: int, blocks: int, checkpoint_every_other: bool) -> None:
        super().__init__()
        from examples.verify_transformer import VOCAB, Block

        embedding = nn.Embedding(VOCAB, dim)  # the first stage's
        self.blocks = nn.Sequential(
            *(
                Block(dim, checkpoint_mlp=checkpoint_every_other and i % 2 == 1)
                for i in range(blocks)
            )
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


def _mse_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def linear_stage(layers: int, dim: int, batch: int, microbatches: int, held: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())))
    model.to(DEVICE)
    xs = [torch.randn(batch, dim, device=DEVICE, requires_grad=True) for _ in range(microbatches)]
    ys = [torch.randn(batch, dim, device=DEVICE) for _ in range(microbatches)]
    title = f"{layers} x (Linear({dim}) + tanh), microbatch {batch}"
    single_stage(title, model, xs, ys, _mse_loss, microbatches, held)


def transformer_stage(checkpointed: bool, seq: int, microbatches: int, held: bool) -> None:
    from examples.verify_transformer import VOCAB

    dim, blocks, batch = 128, 6, 2  # the last stage of verify_transformer:twelve_blocks
    torch.manual_seed(0)
    model = TransformerStage(dim, blocks, checkpointed).to(DEVICE)
    xs = [
        torch.randn(batch, seq, dim, device=DEVICE, requires_grad=True) for _ in range(microbatches)
    ]
    ys = [torch.randint(0, VOCAB, (batch, seq), device=DEVICE) for _ in range(microbatches)]
    title = (
        f"transformer last stage: {blocks} blocks d={dim}, head tied to the embedding, "
        f"{'every other MLP checkpointed, ' if checkpointed else ''}microbatch {batch}x{seq} tokens"
    )
    single_stage(title, model, xs, ys, _cross_entropy, microbatches, held)


def single_stage(
    title: str,
    model: nn.Module,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    loss_fn: LossFn,
    microbatches: int,
    held: bool,
) -> None:
    print(
        f"\n{title}, {microbatches} microbatches, "
        f".grad {'held' if held else 'None'} before the step; MiB"
    )
    results: dict[str, dict[str, float]] = {}
    for impl in ("fused", "torch", "gradsafe"):
        try:
            results[impl] = run(impl, model, xs, ys, loss_fn, held)
        except RuntimeError as exc:
            print(f"{impl}: crashed: {str(exc).splitlines()[0][:100]}")
        for x in xs:
            x.grad = None
    # The fused backward has no W: its rows for W are left empty.
    names = max((list(r) for r in results.values()), key=len)
    print(f"{'point':<26}" + "".join(f"{impl:>10}" for impl in results) + f"{'gradsafe/torch':>16}")
    for name in names:
        row = f"{name:<26}" + "".join(
            f"{results[i][name]:10.1f}" if name in results[i] else f"{'':>10}" for i in results
        )
        if "torch" in results and "gradsafe" in results and results["torch"][name] > 0:
            row += f"{results['gradsafe'][name] / results['torch'][name]:15.2f}x"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zbv", action="store_true", help="a 2-rank ZBV step instead of one stage")
    parser.add_argument("--dp", action="store_true", help="FSDP2 and DDP stages on 2 ranks")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, help="one configuration (default: both below)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument(
        "--device", default="cpu", help="cuda: part 1 on the GPU, read from CUDA's allocator"
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.dp:
        if DEVICE.type != "cpu":
            parser.error("--dp runs on CPU (2 gloo ranks) only")
        dp()
        return
    if args.zbv:
        if DEVICE.type != "cpu":
            parser.error("--zbv runs on CPU (2 gloo ranks) only")
        args.dim, args.batch = args.dim or 2048, args.batch or 512
        zbv(args)
        return
    if DEVICE.type == "cuda":
        where = f"{torch.cuda.get_device_name()}; MiB allocated by CUDA's caching allocator"
    else:
        where = f"{os.cpu_count()} CPUs; MiB of live storages"
    print(
        f"torch {torch.__version__}, {platform.machine()}, {where}, fp32, created from the "
        f"forward on, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    configs = (
        [(args.dim or 2048, args.batch or 512)]
        if args.dim or args.batch
        else [(1024, 512), (2048, 64)]  # activation-dominated, weight-dominated
    )
    for dim, batch in configs:
        for held in (False, True):
            linear_stage(args.layers, dim, batch, args.microbatches, held)
    if not (args.dim or args.batch):
        # 2x16 tokens as in twelve_blocks; 2x128 (more than 1.6 d) as well with checkpointing,
        # where the MLP weight gradients B keeps are smaller than what torch's split records.
        for checkpointed, seq in ((False, 16), (True, 16), (True, 128)):
            for held in (False, True):
                transformer_stage(checkpointed, seq, args.microbatches, held)


if __name__ == "__main__":
    main()
