"""Torch bugs a split backward reaches and a fused one does not: avoided, never a crash.

On torch 2.13 GroupNorm's weight-only backward (input gradient not requested) on a
channels_last input segfaults, and a split W asks built-in nodes for exactly that.
gradsafe probes the installed torch in a subprocess and computes such a node whole
in B. The stage runs in a subprocess too, so a segfault fails the test instead of
taking pytest down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_STAGE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from gradsafe.pipelining import stage_backward_input, stage_backward_weight

    torch.set_default_dtype(torch.float64)
    fmt, shape = {fmt!r}, {shape!r}
    torch.manual_seed(0)
    conv = nn.Conv{dims}d(4, 4, 1)
    gn = nn.GroupNorm(2, 4)
    params = [*conv.parameters(), *gn.parameters()]
    x = torch.randn(shape).to(memory_format=getattr(torch, fmt)).requires_grad_()
    g = torch.randn(shape)

    def stage(x):
        h = conv(x).contiguous(memory_format=getattr(torch, fmt))
        assert h.is_contiguous(memory_format=getattr(torch, fmt))
        return torch.tanh(gn(h))

    want = torch.autograd.grad(stage(x), [x, *params], g)
    (dx,), handoff = stage_backward_input([stage(x)], [g], [x], params)
    stage_backward_weight(params, handoff)
    for got, ref in zip([dx, *(p.grad for p in params)], want):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    print("exact")
    """
)


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        ("channels_last", (2, 4, 3, 3)),
        ("channels_last_3d", (2, 4, 3, 3, 3)),
        ("contiguous_format", (2, 4, 3, 3)),
    ],
)
def test_group_norm_stage_on_channels_last_input_is_exact_and_never_crashes(
    fmt: str, shape: tuple[int, ...]
) -> None:
    script = _STAGE.format(fmt=fmt, shape=shape, dims=len(shape) - 2)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert result.returncode == 0, (
        f"the split stage exited with {result.returncode} (negative: killed by a signal, e.g. "
        f"-11 a segfault):\n{result.stderr[-3000:]}"
    )
    assert result.stdout.strip().endswith("exact")
