"""Doctor row for ``cuda_graphs``: H3, the seed report's two-microbatch accumulation.

Runs on a real GPU when one is present, otherwise under
:func:`gradsafe.testing.emulate_cuda_graphs` (same static-memory semantics).
"""

from __future__ import annotations

import contextlib

import torch

from gradsafe.doctor import Outcome, patched_check
from gradsafe.testing import emulate_cuda_graphs

_EXPECTED = [14.0, 27.0, 40.0, 53.0]  # g1 + g2
_ALIASED = [22.0, 44.0, 66.0, 88.0]  # g2 + g2: .grad stole the static buffer


class _ScaleByWeight(torch.nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(1.0, 5.0, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _seed_repro() -> Outcome:
    real_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if real_gpu else "cpu")
    where = "CUDA" if real_gpu else "emulated CUDA graphs"
    with contextlib.nullcontext() if real_gpu else emulate_cuda_graphs():
        model = _ScaleByWeight(device)
        graphed = torch.cuda.make_graphed_callables(
            model, (torch.ones(2, 4, device=device),), num_warmup_iters=1
        )
        x1 = torch.tensor([[1.0, 2, 3, 4], [2, 3, 4, 5]], device=device)
        x2 = torch.tensor([[10.0, 20, 30, 40], [1, 2, 3, 4]], device=device)
        assert isinstance(graphed, torch.nn.Module)
        graphed(x1).sum().backward()
        graphed(x2).sum().backward()
        torch.cuda.synchronize()
        assert model.weight.grad is not None
        got = model.weight.grad.tolist()
    note = " (g2+g2: .grad aliased the static buffer)" if got == _ALIASED else ""
    return Outcome(got == _EXPECTED, f"2-microbatch grad {got}{note}, {where}")


CHECKS = (
    patched_check(
        "H3 make_graphed_callables static grad alias", "cuda_graphs", "cuda_graphs", _seed_repro
    ),
)
