"""Factories for ``gradsafe verify`` (the command line tests name them as MODULE:FACTORY)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining._hazards import ParamOnlyOutput, ReusedLinear


def _batches(count: int = 4) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(3, 4, generator=generator),) for _ in range(count)]


def param_only_output() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    return ParamOnlyOutput(), _batches()


def reused_with_loss() -> tuple[nn.Module, list[Any], Any]:
    torch.manual_seed(0)
    return ReusedLinear(), _batches(), lambda out, k: out.pow(2).sum()


class ReentrantOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda a: torch.tanh(self.lin(a)), x, use_reentrant=True)


def reentrant_on_input() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    return ReentrantOnInput(), _batches()


def not_a_tuple() -> nn.Module:
    return nn.Linear(4, 4)
