"""The pipelining patch's drop-in promise (issue 12: "drop-in gaps a user meets")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsafe


def test_b_patched_then_w_unpatched_names_the_cause() -> None:
    # B runs inside gradsafe.patch("pipelining"), the patch is released, and
    # torch's own W receives gradsafe's hand-off. The reverse order raises a
    # SplitBackwardError naming the cause; this order gave
    # "TypeError: 'WeightGradHandoff' object is not iterable".
    import torch.distributed.pipelining._backward as backward

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    with gradsafe.patch("pipelining") as handle:
        if "pipelining" not in handle.names:
            pytest.skip(f"pipelining patch skipped here: {gradsafe.status()['pipelining'].skipped}")
        _, handoff = backward.stage_backward_input(
            [out], [torch.ones(3, 4)], [x], model.parameters()
        )
    with pytest.raises(RuntimeError, match=r"gradsafe\.patch"):
        backward.stage_backward_weight(model.parameters(), handoff)
    assert all(p.grad is None for p in model.parameters())
