"""What the tests of a failing W share: a small Linear stage, a hook's own error, the notes."""

from __future__ import annotations

import torch
from torch import nn


class HookError(Exception):
    """Raised by a test's hook: W must let it through with its type."""


def linear_stage() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """Three Linear layers with Tanh between, an input that requires grad, an output gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    return model, x, torch.randn(3, 4)


def notes(exc: BaseException) -> str:
    """The exception's notes (gradsafe's context; Python 3.11+), joined."""
    return " ".join(getattr(exc, "__notes__", []))
