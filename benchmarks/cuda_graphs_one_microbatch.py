"""A graphed callable holds one microbatch at a time: what misuse gave before, and what the checks cost.

Part 1 (GPU if present, else ``gradsafe.testing.emulate_cuda_graphs``): the
max abs error against the same model run eagerly (fp64) for each misuse
order, with torch's ``make_graphed_callables`` (upstream, silent) and
gradsafe's (which now raises: the first words of the error are printed).

Part 2: the host work gradsafe's graphed forward and backward add per call
for these checks (no device operation): ``torch.autograd.graph.increment_version``
on the outputs, a CPU scalar token saved for backward, and the generation
compare; timed side by side, in this process, beside the host time of one
whole graphed call (forward + backward) of a ``Linear(64, 64)``.

Run: ``PYTHONPATH=. python benchmarks/cuda_graphs_one_microbatch.py``
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.cuda_graphs._ownership import Replays
from gradsafe.testing import emulate_cuda_graphs
from gradsafe.wgrad import WeightGradStore

F64 = torch.float64


def _misuse(device: torch.device, mgc: Callable[..., Any] | None, case: str) -> list[torch.Tensor]:
    """Gradients of ``head(body(x))`` over 2 microbatches run as ``case``; ``mgc=None``: eager."""
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    body = body.to(device, F64)
    head = torch.nn.Parameter(torch.randn(4, 3, device=device, dtype=F64))
    xs = [torch.randn(2, 4, device=device, dtype=F64) for _ in range(2)]
    run = body if mgc is None else mgc(body, (torch.randn(2, 4, device=device, dtype=F64),))
    params = [*body.parameters(), head]
    for p in params:  # .grad allocated: upstream's H3 aliasing plays no part here
        p.grad = torch.zeros_like(p)
    if case == "delayed W one behind":
        store = WeightGradStore()
        pending = []
        for x in xs:
            h = run(x)
            _DelayedMatmul.apply(h, head, store).pow(2).sum().backward()
            pending.append(store.seal())
            if len(pending) > 1:
                pending.pop(0).run()
        pending.pop().run()
        return [p.grad for p in params]  # type: ignore[misc]
    if case == "F0 B0 B0 (retain_graph)":
        loss = (run(xs[0]) @ head).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad for p in params]  # type: ignore[misc]
    clone = case == "F0 F1 B0 B1, head reads a clone"
    losses = [((run(x).clone() if clone else run(x)) @ head).pow(2).sum() for x in xs]
    for loss in losses:
        loss.backward()
    return [p.grad for p in params]  # type: ignore[misc]


class _DelayedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        ctx.store = store
        return h @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        h, w = ctx.saved_tensors
        ctx.store.record(w, lambda _: h.t() @ g, accumulate_into_main_grad=False, reads=(h, g))
        return g @ w.t(), None, None


CASES = (
    "F0 F1 B0 B1, head saves the output",
    "F0 F1 B0 B1, head reads a clone",
    "delayed W one behind",
    "F0 B0 B0 (retain_graph)",
)


def misuse_table(device: torch.device) -> None:
    print("\n# misuse orders, 2 microbatches, fp64: max abs error against eager")
    print("case | upstream | gradsafe")
    for case in CASES:
        expected = _misuse(device, None, case)
        upstream = _misuse(device, torch.cuda.graphs.make_graphed_callables, case)
        error = max((g - e).abs().max().item() for g, e in zip(upstream, expected))
        try:
            got = _misuse(device, make_graphed_callables, case)
            ours = f"{max((g - e).abs().max().item() for g, e in zip(got, expected)):.4g}"
        except RuntimeError as e:
            ours = "raises: " + " ".join(str(e).split()[:9]) + " ..."
        print(f"{case} | {error:.4g} | {ours}")


def _times(fn: Callable[[], object], reps: int, inner: int) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(inner):
            fn()
        cpus.append((time.thread_time() - c0) / inner * 1e6)
        walls.append((time.perf_counter() - w0) / inner * 1e6)
    return walls, cpus


class _Token(torch.autograd.Function):
    """A pass-through plus gradsafe's added work (``Replays.stamp`` and ``Replays.check``)."""

    replays = Replays()

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.detach()
        _Token.replays.stamp(ctx, (out,))
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Token.replays.check(ctx)
        return g


class _Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def cost_table(device: torch.device) -> None:
    x = torch.randn(8, 64, device=device, requires_grad=True)
    layer = torch.nn.Linear(64, 64).to(device)
    graphed = make_graphed_callables(
        layer, (torch.randn(8, 64, device=device, requires_grad=True),)
    )
    cases = {
        "pass-through Function": lambda: _Plain.apply(x).sum().backward(),
        "same + gradsafe's checks": lambda: _Token.apply(x).sum().backward(),
        "gradsafe graphed Linear(64,64)": lambda: graphed(x).sum().backward(),
    }
    results: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in cases}
    for _ in range(20):  # interleaved, so load on the machine hits every case alike
        for name, fn in cases.items():
            walls, cpus = _times(fn, 1, 200)
            results[name][0].extend(walls)
            results[name][1].extend(cpus)
    print("\n# host time per call, forward + backward, microseconds (20 interleaved runs of 200)")
    print("case | wall min | wall median | thread CPU min | thread CPU median")
    for name, (walls, cpus) in results.items():
        print(
            f"{name} | {min(walls):.1f} | {statistics.median(walls):.1f} | "
            f"{min(cpus):.1f} | {statistics.median(cpus):.1f}"
        )
    plain, token = results["pass-through Function"][1], results["same + gradsafe's checks"][1]
    added = statistics.median(token) - statistics.median(plain)
    whole = statistics.median(results["gradsafe graphed Linear(64,64)"][1])
    print(
        f"added by the checks (median thread CPU): {added:.1f} us = {added / whole:.1%} of a graphed call"
    )


def main() -> None:
    real_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if real_gpu else "cpu")
    where = torch.cuda.get_device_name() if real_gpu else "no GPU, graphs emulated"
    print(f"torch {torch.__version__}, {platform.machine()} {platform.processor()}, {where}")
    with contextlib.nullcontext() if real_gpu else emulate_cuda_graphs():
        misuse_table(device)
        cost_table(device)


if __name__ == "__main__":
    main()
