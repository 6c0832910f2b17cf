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
from gradsafe.pipelining.schedule import _inference_hazards as _hazards
from gradsafe.pipelining.schedule import _stage

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


def _step(
    schedule: str, backward: bool = True
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
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
        f"{i}.{n}": p.grad.clone()
        for i, m in enumerate(modules)
        for n, p in m.named_parameters()
        if p.grad is not None
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


@pytest.mark.parametrize(
    ("has_backward", "is_first", "detached"),
    [(True, False, True), (False, False, False), (True, True, False)],
    ids=["last stage", "no backward (eval)", "first and last (full backward)"],
)
def test_only_a_split_last_stage_keeps_its_view_outputs_detached(
    has_backward: bool, is_first: bool, detached: bool
) -> None:
    """Without a backward (``eval()``) the merged outputs keep their graph, and a stage that is
    also the first runs a full backward that torch does not detach after: both as unpatched.
    (torch's multi-stage runtime cannot run ``eval()`` on one rank, so a stand-in stage.)"""

    class Stage:
        is_last = True

        def __init__(self) -> None:
            self.has_backward, self.is_first = has_backward, is_first
            self.output_chunks: list[object] = []

        def forward_one_chunk(self, x: torch.Tensor) -> object:
            out = (x * 2).flatten(), x * 3, 4  # a view, a non-view, not a tensor
            self.output_chunks.append(out)
            return out

    forward = _stage.merge_without_view_graphs(Stage.forward_one_chunk)
    stage = Stage()
    x = torch.randn(2, 3, requires_grad=True)
    returned = forward(stage, x)
    kept = stage.output_chunks[-1]
    assert returned[0].grad_fn is not None  # the schedule's loss is computed from this
    assert (kept[0].grad_fn is None) is detached
    assert kept[1] is returned[1] and kept[2] == 4
    torch.testing.assert_close(kept[0], returned[0], rtol=0, atol=0)
