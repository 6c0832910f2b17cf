"""H3, the seed report's two-microbatch accumulation through a graphed module: written once here.

The doctor, tests/cuda_graphs and benchmarks use :func:`seed_grads` and
:class:`ScaleByWeight`. The reproduction runs on a real GPU when one is
present, otherwise under :func:`gradsafe.testing.emulate_cuda_graphs` (same
static-memory semantics).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradsafe.checks import Outcome, patched_check
from gradsafe.cuda_graphs._autograd import TorchDispatchMode

__all__ = [
    "ALIASED",
    "CHECKS",
    "CopyCounter",
    "EXPECTED",
    "SEED_X1",
    "SEED_X2",
    "ScaleByWeight",
    "seed_grads",
]

#: Two microbatches accumulated: g1 + g2.
EXPECTED = [14.0, 27.0, 40.0, 53.0]
#: What upstream gives: g2 + g2, because ``.grad`` kept the static buffer.
ALIASED = [22.0, 44.0, 66.0, 88.0]
SEED_X1 = [[1.0, 2, 3, 4], [2, 3, 4, 5]]
SEED_X2 = [[10.0, 20, 30, 40], [1, 2, 3, 4]]


class ScaleByWeight(torch.nn.Module):
    """``x * weight`` with ``weight = [1, 2, ..., width]``: the seed report's module."""

    def __init__(self, device: torch.device | str, width: int = 4) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(1.0, width + 1, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def seed_grads(make_graphed: Callable[..., Any], device: torch.device | str) -> list[float]:
    """Graph :class:`ScaleByWeight` with ``make_graphed``, run two microbatches, return ``weight.grad``."""
    model = ScaleByWeight(device)
    graphed = make_graphed(model, (torch.ones(2, 4, device=device),), num_warmup_iters=1)
    graphed(torch.tensor(SEED_X1, device=device)).sum().backward()
    graphed(torch.tensor(SEED_X2, device=device)).sum().backward()
    grad = model.weight.grad
    if grad is None:
        raise RuntimeError("the graphed backward gave the weight no gradient at all")
    return grad.tolist()


class CopyCounter(TorchDispatchMode):
    """Counts ``aten.clone`` calls and bytes while active: the copies an ownership policy makes.

    Graph replays dispatch no ops, so only real clones count. ``shapes`` splits
    the bytes into parameter-shaped (``param_shaped_bytes``) and the rest.
    """

    def __init__(self, shapes: Sequence[torch.Size] = ()) -> None:
        super().__init__()
        self.shapes = set(shapes)
        self.clones = 0
        self.bytes = 0
        self.param_shaped_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.clone.default:
            nbytes = args[0].numel() * args[0].element_size()
            self.clones += 1
            self.bytes += nbytes
            if args[0].shape in self.shapes:
                self.param_shaped_bytes += nbytes
        return func(*args, **(kwargs or {}))


def _seed_repro() -> Outcome:
    from gradsafe.testing import emulate_cuda_graphs

    real_gpu = torch.cuda.is_available()
    with contextlib.nullcontext() if real_gpu else emulate_cuda_graphs():
        # Looked up at call time: under gradsafe.patch it is gradsafe's function.
        got = seed_grads(torch.cuda.make_graphed_callables, "cuda" if real_gpu else "cpu")
    note = " (g2+g2: .grad aliased the static buffer)" if got == ALIASED else ""
    where = "CUDA" if real_gpu else "emulated CUDA graphs"
    return Outcome(got == EXPECTED, f"2-microbatch grad {got}{note}, {where}")


CHECKS = (
    patched_check(
        "H3 make_graphed_callables static grad alias", "cuda_graphs", "cuda_graphs", _seed_repro
    ),
)
