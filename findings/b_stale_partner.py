"""H7 registry: a stage reused in a rebuilt schedule whose other stage no longer holds the shared weight.

Schedule A over [s0, s1] (s0 embeds with `table`, s1's head is tied to it) is
built, so SHARED records table -> {s0, s1}. The user then rebuilds with a new
last stage whose head is untied (its own weight), reusing s0, while A (and so
s1) is still alive (kept for evaluation, say). B.step re-registers B's stages,
but in B `table` is held by one stage only, so register() leaves A's record in
place: s0's scale_grads waits for s1, which B never runs, and `table`'s
gradient is never divided (n_microbatches x too large).

Run: PYTHONPATH=. python findings/b_stale_partner.py
"""

import torch
from torch import nn

import gradsafe
from gradsafe.pipelining._one_rank import one_rank_world

V, D, T, M = 11, 6, 5, 4
F64 = torch.float64


class Emb(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, ids):
        return torch.tanh(self.table[ids])


class Head(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return h @ self.weight.t()


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def main():
    from torch.distributed.pipelining import PipelineStage, schedules

    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(V, D, dtype=F64))
    own = nn.Parameter(torch.randn(V, D, dtype=F64))
    emb, tied, untied = Emb(table), Head(table), Head(own)
    g = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(0, V, (M, T), generator=g), torch.randint(0, V, (M, T), generator=g)
    # reference: untied model, mean loss over microbatches
    ls = [loss_fn(untied(emb(i)), t) for i, t in zip(ids, tgt)]
    (torch.stack(ls).sum() / M).backward()
    want = table.grad.clone()
    table.grad = None
    own.grad = None
    cpu = torch.device("cpu")
    with gradsafe.patch("pipelining"), one_rank_world():
        s0, s1 = PipelineStage(emb, 0, 2, cpu), PipelineStage(tied, 1, 2, cpu)
        a = schedules.ScheduleInterleaved1F1B([s0, s1], n_microbatches=M, loss_fn=loss_fn)
        s1b = PipelineStage(untied, 1, 2, cpu)
        b = schedules.ScheduleInterleaved1F1B([s0, s1b], n_microbatches=M, loss_fn=loss_fn)
        b.step(ids.reshape(-1, T), target=tgt.reshape(-1, T))
        del a
    err = float((table.grad - want).abs().max())
    ratio = float(table.grad.norm() / want.norm())
    print(
        f"torch {torch.__version__}: table grad max abs err {err:.3g}, ratio to fused {ratio:.3g}"
    )


if __name__ == "__main__":
    main()
