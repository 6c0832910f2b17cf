"""What gradsafe's make_graphed_callables copies, and what it costs, per optimizer step.

Part 1 (any machine, counted under ``gradsafe.testing.emulate_cuda_graphs``
unless a GPU is present): clones and bytes cloned per optimizer step for
upstream (``ownership="never"``), ``"auto"`` and ``"always"``, with gradient
accumulation over 1, 4 and 16 microbatches, for ``zero_grad(set_to_none=True)``
(torch's default) and ``set_to_none=False``. Counted with a dispatch mode over
the steady-state steps (graph replays dispatch no ops, so only real copies
count), and expressed in parameter-sized copies: ``bytes cloned / parameter bytes``.

Part 2 (GPU only): step time of a 12-layer transformer block stack, graphed
per layer, for the three policies, measured side by side in this process.

Run: ``PYTHONPATH=. python benchmarks/cuda_graphs_ownership.py``
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.testing import emulate_cuda_graphs

POLICIES = ("never", "auto", "always")
MICROBATCHES = (1, 4, 16)


class CopyCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.clones = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.clone.default:
            self.clones += 1
            self.bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def _layers(device: torch.device, n: int, width: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(width, width).to(device) for _ in range(n)]


def count_copies(
    device: torch.device, policy: str, microbatches: int, set_to_none: bool
) -> tuple[float, float, int, int]:
    """(clones per step, param-sized copies per step, #params, param bytes) over 2 steady steps."""
    width, batch = 64, 8
    layers = _layers(device, 4, width)
    params = [p for layer in layers for p in layer.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    samples = tuple((torch.randn(batch, width, device=device),) for _ in layers)
    # The first layer's sample input does not require grad; later layers' do (chained).
    samples = (samples[0],) + tuple((s[0].requires_grad_(),) for s in samples[1:])
    graphed = make_graphed_callables(tuple(layers), samples, ownership=policy)
    opt = torch.optim.SGD(params, lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=set_to_none)
        for _ in range(microbatches):
            h = torch.randn(batch, width, device=device)
            for layer in graphed:
                h = layer(h)
            h.pow(2).mean().backward()
        opt.step()

    step()  # first step: .grad is None for everyone, whatever set_to_none says
    steps = 2
    with CopyCounter() as counter:
        for _ in range(steps):
            step()
    return counter.clones / steps, counter.bytes / steps / param_bytes, len(params), param_bytes


def copy_table(device: torch.device) -> None:
    print("\n# copies per optimizer step (steady state, 4 chained Linear(64,64) layers, 8 params)")
    print("set_to_none | microbatches | policy | clones/step | bytes cloned / parameter bytes, per step")
    for set_to_none in (True, False):
        for mb in MICROBATCHES:
            for policy in POLICIES:
                clones, copies, _, _ = count_copies(device, policy, mb, set_to_none)
                print(f"{set_to_none!s:>11} | {mb:>12} | {policy:>6} | {clones:>11.1f} | {copies:>8.2f}")


def step_times(
    device: torch.device,
    d_model: int = 1024,
    n_layers: int = 12,
    seq: int = 512,
    batch: int = 8,
    microbatches: int = 4,
    repeats: int = 20,
) -> None:
    print(
        f"\n# step time, {n_layers} x TransformerEncoderLayer(d_model={d_model}), seq {seq}, "
        f"batch {batch}, {microbatches} microbatches, fp32, on {device}"
    )
    results: dict[str, list[float]] = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        layers = [
            torch.nn.TransformerEncoderLayer(d_model, 16, 4 * d_model, dropout=0.0, batch_first=True)
            .to(device)
            for _ in range(n_layers)
        ]
        params = [p for layer in layers for p in layer.parameters()]
        samples = tuple(
            (torch.randn(batch, seq, d_model, device=device, requires_grad=i > 0),)
            for i in range(n_layers)
        )
        graphed = make_graphed_callables(tuple(layers), samples, ownership=policy)
        opt = torch.optim.SGD(params, lr=1e-4)
        xs = [torch.randn(batch, seq, d_model, device=device) for _ in range(microbatches)]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            for x in xs:
                h = x
                for layer in graphed:
                    h = layer(h)
                h.float().pow(2).mean().backward()
            opt.step()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results[policy] = times
    base = statistics.median(results["never"])
    for policy in POLICIES:
        med = statistics.median(results[policy])
        print(f"{policy:>6}: median {med * 1e3:8.2f} ms/step  ratio vs upstream {med / base:.4f}")


def main() -> None:
    gpu = torch.cuda.is_available()
    print(f"torch {torch.__version__}, {platform.machine()}, {platform.processor() or 'cpu'}, "
          f"{'GPU ' + torch.cuda.get_device_name() if gpu else 'no GPU: copies counted under emulate_cuda_graphs'}")
    with contextlib.nullcontext() if gpu else emulate_cuda_graphs():
        copy_table(torch.device("cuda" if gpu else "cpu"))
    if gpu:
        step_times(torch.device("cuda"))
    else:
        print("\n# step time: not measured (no GPU on this machine)")


if __name__ == "__main__":
    main()
