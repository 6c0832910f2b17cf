"""A last stage whose output is a view: its microbatch graphs die with their W, not at the next step.

torch's stage detaches a last stage's outputs in place after B, so the outputs it
keeps for ``step()`` to merge hold no graph; a view cannot be detached in place,
so torch skips it and keeps the view, with the whole microbatch graph behind it,
until the next step clears the list. gradsafe's W never frees saved tensors (a
graph is freed when dropped), so the patch keeps a detached alias of such a view
for the merge instead: same values, same storage, no graph, as torch's other
outputs. The schedule computes the loss from the output it is returned, untouched.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import gradsafe
from gradsafe.pipelining import _hazards

_MICROBATCHES = 4


class _ViewHead(nn.Module):
    """Linear + tanh + Linear, output flattened (a view), as a tokens-first head might."""

    def __init__(self, probes: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.probes = probes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))  # saved by tanh's and b's nodes
        self.probes.append(weakref.ref(h))
        return self.b(h).flatten(0, 1)


def _step(schedule: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """One step of two stages on this rank; gradients, the merged output, activations alive."""
    from torch.distributed.pipelining import PipelineStage, schedules

    torch.manual_seed(0)
    probes: list[weakref.ref[torch.Tensor]] = []
    modules = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), _ViewHead(probes)]
    stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    runner = getattr(schedules, schedule)(
        stages,
        n_microbatches=_MICROBATCHES,
        loss_fn=lambda y, t: (y - t.flatten(0, 1)).square().mean(),
    )
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(8, 3, 8, generator=gen), torch.randn(8, 3, 8, generator=gen)
    out = runner.step(x, target=t)
    gc.collect()
    alive = sum(ref() is not None for ref in probes)
    grads = {
        f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules) for n, p in m.named_parameters()
    }
    return grads, out, alive


def test_view_output_graphs_die_with_their_w_not_at_the_next_step() -> None:
    with _hazards.one_rank_world():
        try:
            fused, fused_out, _ = _step("ScheduleInterleaved1F1B")  # torch's, no split
        except RuntimeError as exc:
            if _hazards._SELF_SEND in str(exc):
                pytest.skip("this torch cannot run two stages on one gloo rank")
            raise
        with gradsafe.patch("pipelining"):
            grads, out, alive = _step("ScheduleZBVZeroBubble")
    assert alive == 0, f"{alive} of {_MICROBATCHES} microbatch activations alive after step()"
    assert out.grad_fn is None
    torch.testing.assert_close(out, fused_out, rtol=0, atol=0)
    for name, grad in fused.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
