"""Graphed zero-bubble stages (``make_graphed_split_callables``): capture orders, copies per step, step time.

Part 1 (any machine, no process group): the capture order
:class:`gradsafe.cuda_graphs.CaptureOrder` derives for ``ScheduleZBVZeroBubble``
and ``ScheduleInterleavedZeroBubble`` on 2 and 4 ranks (2 stages per rank,
2 microbatches per rank), i.e. the order in which each rank's forward, B and
W graphs are captured and must be replayed.

Part 2 (any machine; under ``gradsafe.testing.emulate_cuda_graphs`` unless a
GPU is present): what the entry point copies out of static buffers per
optimizer step, for every rank of ZBV on 2 ranks, with each chunk a stack of
3 ``Linear(64, 64)`` layers: parameter gradients (AccumulateGrad would keep
the buffer as ``.grad`` when ``.grad`` is None) and input gradients (kept by
``torch.autograd.grad``'s caller, or as a leaf's ``.grad``). Counted with a
dispatch mode over two steady-state steps (replays dispatch no ops, so only
real copies count); gradients are checked against the eager split backward.

Part 3 (GPU only): step time of 12 transformer blocks (2 chunks of 6) on
ZBV rank 0's order, graphed vs gradsafe's eager split backward.

Run: ``PYTHONPATH=. python benchmarks/cuda_graphs_split_stages.py``
"""

from __future__ import annotations

import contextlib
import copy
import platform
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.pipelining import schedules

from gradsafe.cuda_graphs._hazards import CopyCounter
from gradsafe.cuda_graphs.capture_order import CaptureOrder, EntryKind
from gradsafe.cuda_graphs.split_stages import make_graphed_split_callables
from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import emulate_cuda_graphs

SCHEDULES = (schedules.ScheduleZBVZeroBubble, schedules.ScheduleInterleavedZeroBubble)
RANKS = (2, 4)


def print_orders() -> None:
    for schedule_cls in SCHEDULES:
        for ranks in RANKS:
            microbatches = 2 * ranks
            print(f"\n== {schedule_cls.__name__}, {ranks} ranks, {microbatches} microbatches")
            for rank in range(ranks):
                order = CaptureOrder.from_schedule_class(
                    schedule_cls, rank=rank, ranks=ranks, microbatches=microbatches
                )
                chunks = ", ".join(f"c{i}=stage {s}" for i, s in enumerate(order.stage_indices))
                print(f"rank {rank} ({chunks}): {len(order)} graphs")
                print(f"  {order}")


def _stack(width: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        *(torch.nn.Linear(width, width, dtype=torch.float64) for _ in range(layers))
    )


def _step(
    order: CaptureOrder,
    forward: Callable[[int, torch.Tensor], Any],
    dgrad: Callable[[int, int, Any, torch.Tensor], torch.Tensor],
    wgrad: Callable[[int, int], None],
    xs: dict[tuple[int, int], torch.Tensor],
    gs: dict[tuple[int, int], torch.Tensor],
) -> dict[tuple[int, int], torch.Tensor]:
    held: dict[tuple[int, int], Any] = {}
    dx = {}
    for e in order:
        key = (e.chunk, e.microbatch)
        if e.kind is EntryKind.FORWARD:
            x = xs[key].detach().requires_grad_()  # a fresh leaf, no copy
            held[key] = (x, forward(e.chunk, x))
        elif e.kind is EntryKind.DGRAD:
            x, out = held.pop(key)
            dx[key] = dgrad(e.chunk, e.microbatch, (x, out), gs[key])
        else:
            wgrad(e.chunk, e.microbatch)
    return dx


def count_copies(device: torch.device, rank: int, set_to_none: bool, via: str) -> str:
    order = CaptureOrder.from_schedule_class(
        schedules.ScheduleZBVZeroBubble, rank=rank, ranks=2, microbatches=4
    )
    width, batch, layers = 64, 8, 3
    torch.manual_seed(0)
    modules = [_stack(width, layers).to(device) for _ in order.chunks]
    eager = copy.deepcopy(modules)
    params = [p for m in modules for p in m.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    samples = [
        (torch.randn(batch, width, dtype=torch.float64, device=device, requires_grad=True),)
        for _ in modules
    ]
    stages = make_graphed_split_callables(modules, samples, order)
    keys = [(c, m) for c in order.chunks for m in order.microbatches(c)]

    def graphed_dgrad(chunk: int, mb: int, held: Any, g: torch.Tensor) -> torch.Tensor:
        x, out = held
        if via == "autograd.grad":
            return torch.autograd.grad(out, x, g)[0]
        out.backward(g)
        return x.grad  # type: ignore[return-value]

    handoffs: dict[tuple[int, int], Any] = {}

    def eager_dgrad(chunk: int, mb: int, held: Any, g: torch.Tensor) -> torch.Tensor:
        x, out = held
        (dx,), handoffs[(chunk, mb)] = stage_backward_input(
            [out], [g], [x], eager[chunk].parameters()
        )
        return dx  # type: ignore[return-value]

    def eager_wgrad(chunk: int, mb: int) -> None:
        stage_backward_weight(eager[chunk].parameters(), handoffs.pop((chunk, mb)))

    counter = CopyCounter()
    steps = 4
    for step in range(steps):
        xs = {k: torch.randn(batch, width, dtype=torch.float64, device=device) for k in keys}
        gs = {k: torch.randn(batch, width, dtype=torch.float64, device=device) for k in keys}
        for m in (*modules, *eager):
            m.zero_grad(set_to_none=set_to_none)
        with counter if step >= steps - 2 else contextlib.nullcontext():
            got = _step(
                order,
                lambda c, x: stages.callables[c](x),
                graphed_dgrad,
                lambda c, m: stages.backward_weight(c),
                xs,
                gs,
            )
        want = _step(order, lambda c, x: eager[c](x), eager_dgrad, eager_wgrad, xs, gs)
        for k in keys:
            if not torch.allclose(got[k], want[k], atol=1e-9, rtol=0):
                raise SystemExit(f"input gradient {k} differs from the eager split backward")
        for p, q in zip(params, (q for m in eager for q in m.parameters())):
            if not torch.allclose(p.grad, q.grad, atol=1e-9, rtol=0):  # type: ignore[arg-type]
                raise SystemExit("a parameter gradient differs from the eager split backward")
    # Every input gradient is delivered to a caller that keeps it (autograd.grad returns it;
    # Tensor.backward stores it as the fresh leaf's .grad), so each is copied once.
    n_inputs = len(keys)
    input_bytes = n_inputs * batch * width * 8
    param_copies = (counter.bytes / 2 - input_bytes) / param_bytes
    return (
        f"rank {rank} | zero_grad(set_to_none={set_to_none!s:5}) | dgrad via {via:15} | "
        f"{counter.clones / 2:4.0f} clones/step = {n_inputs} input gradients (one per chunk and "
        f"microbatch) + {param_copies:.2f} parameter-sized copies ({len(params)} parameters)"
    )


def _transformer_block(width: int) -> torch.nn.Module:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(width)
            self.qkv = torch.nn.Linear(width, 3 * width)
            self.proj = torch.nn.Linear(width, width)
            self.norm2 = torch.nn.LayerNorm(width)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 8, d // 8).unbind(2)
            a = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.norm2(x))

    return Block()


def step_time(device: torch.device, width: int = 1024, batch: int = 4, seq: int = 512) -> None:
    order = CaptureOrder.from_schedule_class(
        schedules.ScheduleZBVZeroBubble, rank=0, ranks=2, microbatches=4
    )
    torch.manual_seed(0)
    modules = [
        torch.nn.Sequential(*(_transformer_block(width) for _ in range(6))).to(device)
        for _ in order.chunks
    ]
    eager = copy.deepcopy(modules)
    keys = [(c, m) for c in order.chunks for m in order.microbatches(c)]
    xs = {k: torch.randn(batch, seq, width, device=device) for k in keys}
    gs = {k: torch.randn(batch, seq, width, device=device) for k in keys}
    samples = [
        (torch.randn(batch, seq, width, device=device, requires_grad=True),) for _ in modules
    ]
    stages = make_graphed_split_callables(modules, samples, order)
    handoffs: dict[tuple[int, int], Any] = {}

    def eager_dgrad(chunk: int, mb: int, held: Any, g: torch.Tensor) -> torch.Tensor:
        x, out = held
        (dx,), handoffs[(chunk, mb)] = stage_backward_input(
            [out], [g], [x], eager[chunk].parameters()
        )
        return dx  # type: ignore[return-value]

    def graphed() -> None:
        _step(
            order,
            lambda c, x: stages.callables[c](x),
            lambda c, m, h, g: torch.autograd.grad(h[1], h[0], g)[0],
            lambda c, m: stages.backward_weight(c),
            xs,
            gs,
        )

    def split() -> None:
        _step(
            order,
            lambda c, x: eager[c](x),
            eager_dgrad,
            lambda c, m: stage_backward_weight(eager[c].parameters(), handoffs.pop((c, m))),
            xs,
            gs,
        )

    def timed(fn: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    times: dict[str, list[float]] = {"graphed": [], "eager split": []}
    for i in range(13):
        for name, fn in (("graphed", graphed), ("eager split", split)):
            t = timed(fn)
            if i >= 3:
                times[name].append(t)
    g, e = statistics.median(times["graphed"]), statistics.median(times["eager split"])
    print(
        f"\n12 transformer blocks (d={width}, batch {batch}x{seq}, fp32), ZBV rank 0, 4 microbatches, "
        f"median of 10 steps: graphed {g:.2f} ms, eager split {e:.2f} ms, graphed/eager {g / e:.3f}x"
    )


@contextlib.contextmanager
def _graphs(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        yield
    else:
        with emulate_cuda_graphs():
            yield


def main() -> None:
    gpu = torch.cuda.is_available()
    print(
        f"torch {torch.__version__}, {platform.machine()}, {platform.processor() or 'cpu'}, "
        f"{'GPU ' + torch.cuda.get_device_name() if gpu else 'no GPU (CUDA graphs emulated on CPU)'}"
    )
    print_orders()
    device = torch.device("cuda" if gpu else "cpu")
    print(
        "\n== copies per optimizer step, ZBV 2 ranks, 4 microbatches, chunks of 3 Linear(64, 64), fp64"
    )
    with _graphs(device):
        for rank in (0, 1):
            for set_to_none in (True, False):
                for via in ("autograd.grad", "Tensor.backward"):
                    print(count_copies(device, rank, set_to_none, via))
    if gpu:
        step_time(device)
    else:
        print("\nstep time (part 3): needs a GPU; not measured")


if __name__ == "__main__":
    main()
