"""One gloo rank: a delayed weight gradient under FSDP2 (``fully_shard``); argv: RANK INIT_METHOD OUT."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard

from gradsafe.wgrad import WeightGradStore
from gradsafe.wgrad._hazards import repro_linear
from tests._rank_worker import run_rank


class _Delayed(torch.nn.Module):
    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return repro_linear(x, self.weight, fuse=False, store=self.store)


def body() -> dict[str, Any]:
    torch.manual_seed(0)
    store = WeightGradStore()
    model = torch.nn.Sequential(_Delayed(store), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(5, 4)).sum().backward()
    pending = store.seal()
    try:
        pending.run()
    except RuntimeError as exc:
        return {"error": str(exc), "grad_is_none": model[0].weight.grad is None}
    return {"error": None, "grad_is_none": model[0].weight.grad is None}


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], body)
