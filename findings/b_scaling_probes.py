"""(b) SharedParameters attacks: real schedule steps on one gloo rank vs a fused backward of the mean loss (fp64).

Run: PYTHONPATH=. python findings/b_scaling_probes.py
"""

import gc
import sys

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
        self.mix = nn.Linear(D, D, dtype=F64)

    def forward(self, ids):
        return torch.tanh(self.mix(self.table[ids]))


class Mid(nn.Module):  # uses the table too (3rd holder)
    def __init__(self, table):
        super().__init__()
        self.table = table
        self.lin = nn.Linear(D, D, dtype=F64)

    def forward(self, h):
        return torch.tanh(self.lin(h) + h @ self.table.t() @ self.table * 0.1)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=F64)

    def forward(self, h):
        return torch.tanh(self.lin(h))


class Head(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, h):
        return h @ self.table.t()


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def model(three):
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(V, D, dtype=F64))
    return [Emb(table), Mid(table) if three else Plain(), Head(table)]


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (M, T), generator=g), torch.randint(0, V, (M, T), generator=g)


def grads(mods):
    out = {}
    for i, m in enumerate(mods):
        for k, p in m.named_parameters(remove_duplicate=False):
            out[f"{i}.{k}"] = torch.zeros_like(p) if p.grad is None else p.grad.clone()
    return out


def reference(three, steps=1):
    mods = model(three)
    ids, tgt = data()
    for _ in range(steps):
        ls = []
        for i, t in zip(ids, tgt):
            h = i
            for m in mods:
                h = m(h)
            ls.append(loss_fn(h, t))
        (torch.stack(ls).sum() / M).backward()
    return grads(mods)


def worst(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def stages_of(mods):
    from torch.distributed.pipelining import PipelineStage

    n = len(mods)
    return [PipelineStage(m, i, n, torch.device("cpu")) for i, m in enumerate(mods)]


def run_step(sched, three, rebuild=False, manual=False, twice=False):
    from torch.distributed.pipelining import schedules

    mods = model(three)
    ids, tgt = data()
    cls = getattr(schedules, sched)
    kw = {"scale_grads": False} if manual else {}
    st = stages_of(mods)
    r = cls(st, n_microbatches=M, loss_fn=loss_fn, **kw)
    if rebuild:
        del r
        st = stages_of(mods)
        gc.collect()
        r = cls(st, n_microbatches=M, loss_fn=loss_fn, **kw)
    for _ in range(2 if twice else 1):
        r.step(ids.reshape(-1, T), target=tgt.reshape(-1, T))
    if manual:
        for s in st:
            s.scale_grads(M)
    return grads(mods)


CASES = [
    ("3 stages share the table", dict(three=True)),
    ("schedule rebuilt over new stage objects", dict(three=False, rebuild=True)),
    ("scale_grads=False then user calls scale_grads per stage", dict(three=False, manual=True)),
]


def main():
    sched = sys.argv[1] if len(sys.argv) > 1 else "ScheduleInterleaved1F1B"
    print(torch.__version__, sched)
    for name, kw in CASES:
        ref = reference(kw["three"])
        try:
            with gradsafe.patch("pipelining"), one_rank_world():
                got = run_step(sched, **kw)
            print(f" {name}: max abs err {worst(got, ref):.3g}")
        except Exception as e:
            print(f" {name}: EXC {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
