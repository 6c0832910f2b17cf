"""``assert_split_exact``: :func:`gradsafe.verify.verify` as an assertion for users' test suites."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradsafe.verify._api import ORDERS, verify
from gradsafe.verify._report import VerifyReport

__all__ = ["assert_split_exact"]


def assert_split_exact(
    module: nn.Module | Sequence[nn.Module],
    microbatches: Sequence[Any],
    loss_fn: Callable[[Any, int], torch.Tensor] | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    orders: Sequence[str] = tuple(ORDERS),
) -> VerifyReport:
    """Assert that gradsafe's split backward equals a fused backward on ``module`` (see ``verify``).

    Raises:
        AssertionError: gradsafe's split differs from fused, crashes, or refuses
            the model; the message is the report's table (which parameters,
            which hooks, which order, the refusal's reason).

    Returns:
        The report, for further checks (e.g. ``report.upstream``).
    """
    report = verify(module, microbatches, loss_fn, dtype=dtype, orders=orders)
    if not report.ok:
        raise AssertionError(f"gradsafe's split backward is not exact on this model:\n{report}")
    return report
