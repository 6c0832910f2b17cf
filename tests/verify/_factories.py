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


class _TiedStage(nn.Module):
    """H1's overlapping groups plus the outer weight used again as a head."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.outer(torch.tanh(self.inner(self.outer(x)))))
        return h + torch.tanh(h @ self.outer.weight.t())


def four_stages() -> tuple[list[nn.Module], list[Any], Any]:
    """Four stages for two ranks, the first and last sharing a weight (one rank holds both in a V)."""
    torch.manual_seed(0)
    stages: list[nn.Module] = [_TiedStage() for _ in range(4)]
    stages[3].inner.weight = stages[0].inner.weight
    return stages, _batches(4), lambda out, k: out.pow(2).mean() * (k + 1)


class _PrefixStage(nn.Module):
    """Sends on a parameter-only output (a learned prefix) beside its activation."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.last = last
        self.lin = nn.Linear(4, 4)
        self.prefix = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> Any:
        h = torch.tanh(self.lin(x)) + extra
        if self.last:
            return h * torch.tanh(self.prefix)
        return h, torch.tanh(self.prefix)


def four_prefix_stages() -> tuple[list[nn.Module], list[Any]]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(3, 4, generator=generator), torch.randn(3, 4, generator=generator))
        for _ in range(4)
    ]
    return [_PrefixStage(last=i == 3) for i in range(4)], batches


def eight_prefix_stages() -> tuple[list[nn.Module], list[Any]]:
    """``four_prefix_stages`` for four ranks."""
    stages, batches = four_prefix_stages()
    torch.manual_seed(1)
    return [_PrefixStage(last=i == 7) for i in range(8)], batches


def _sgd_step(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.add_(p.grad, alpha=-0.1)
    p.grad = None


def stepped_in_backward() -> tuple[list[nn.Module], list[Any]]:
    """Four stages whose parameters take an SGD step in backward (optimizer in backward)."""
    torch.manual_seed(0)
    stages: list[nn.Module] = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)]
    for stage in stages:
        for p in stage.parameters():
            p.register_post_accumulate_grad_hook(_sgd_step)
    return stages, _batches()


def doubled_by_hooks() -> tuple[list[nn.Module], list[Any]]:
    """Four stages whose weights' gradients a tensor hook doubles (the hook is the factory's)."""
    torch.manual_seed(0)
    stages: list[nn.Module] = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)]
    for stage in stages:
        stage[0].weight.register_hook(lambda g: 2 * g)
    return stages, _batches()


_VOCAB, _DIM, _TOKENS = 11, 6, 5


class _Embed(nn.Module):
    def __init__(self, table: nn.Parameter) -> None:
        super().__init__()
        self.table = table
        self.mix = nn.Linear(_DIM, _DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.table[ids]))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(_DIM, _DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class _TiedHead(nn.Module):
    def __init__(self, table: nn.Parameter) -> None:
        super().__init__()
        self.table = table

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.table.t()


def tied_v() -> tuple[list[nn.Module], list[Any], Any]:
    """H7: four stages whose first embeds with the table the last uses as its head (rank 0 of a V holds both)."""
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(_VOCAB, _DIM))
    stages: list[nn.Module] = [_Embed(table), _Block(), _Block(), _TiedHead(table)]
    generator = torch.Generator().manual_seed(1)
    ids = [(torch.randint(0, _VOCAB, (2, _TOKENS), generator=generator),) for _ in range(4)]
    targets = [torch.randint(0, _VOCAB, (2, _TOKENS), generator=generator) for _ in range(4)]

    def loss(logits: torch.Tensor, k: int) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), targets[k].reshape(-1))

    return stages, ids, loss


def tied_v_one_rank() -> tuple[list[nn.Module], list[Any], Any]:
    """H7 at its simplest: the two stages of one rank of a V, the embedding tied to the head."""
    stages, ids, loss = tied_v()
    return [stages[0], stages[3]], ids, loss


class _HeadSkipped(_Block):
    """A last stage whose head its forward skips: the loss applies it (torchtitan's ``_skip_lm_head``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(_DIM, _VOCAB, bias=False)


def backward_in_loss() -> tuple[list[nn.Module], list[Any], Any]:
    """H6: four stages whose loss runs a backward inside itself (a chunked loss applying the head)."""
    from gradsafe.pipelining.schedule._inference_hazards import ChunkedHeadLoss

    torch.manual_seed(0)
    stages: list[nn.Module] = [_Block(), _Block(), _Block(), _HeadSkipped()]
    generator = torch.Generator().manual_seed(1)
    xs = [(torch.randn(2, 4, _DIM, generator=generator),) for _ in range(4)]
    targets = [torch.randn(2, 4, _VOCAB, generator=generator) for _ in range(4)]
    chunked = ChunkedHeadLoss(stages[3].head)

    def loss(hidden: torch.Tensor, k: int) -> torch.Tensor:
        return chunked(hidden, targets[k])

    return stages, xs, loss


class _DrawsFromPython(nn.Module):
    """Scales its output by a draw from Python's ``random``, which verify does not seed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        return self.lin(x) * (1 + random.random())


def python_random_forward() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    return _DrawsFromPython(), _batches()


def raises_in_factory() -> tuple[nn.Module, list[Any]]:
    raise KeyError("no such checkpoint: step-7")


def hooked_first_stage() -> tuple[list[nn.Module], list[Any]]:
    """Two stages; a post-accumulate hook on the first only (which a schedule runs fused)."""
    torch.manual_seed(0)
    stages: list[nn.Module] = [nn.Linear(4, 4), nn.Linear(4, 4)]
    stages[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    return stages, _batches()


def printing() -> tuple[nn.Module, list[Any]]:
    """A factory that prints, as one loading a checkpoint might."""
    print("loading weights ...")
    return param_only_output()


class _ReturnsNothing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> None:
        self.lin(x)  # the result is dropped: nothing reaches a gradient


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).detach() * 2


def returns_none() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    return _ReturnsNothing(), _batches()


def detached_output() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    return _Detached(), _batches()


def detached_first_of_two() -> tuple[list[nn.Module], list[Any]]:
    """Two stages, the first of which detaches its output: its parameters get no gradient."""
    torch.manual_seed(0)
    return [_Detached(), nn.Linear(4, 4)], _batches()


def compiled_mlp_stages() -> tuple[list[nn.Module], list[Any], Any]:
    """Four MLP stages, each ``torch.compile``'d (aot_eager), for a zero-bubble schedule on 2 ranks."""
    torch.manual_seed(0)
    stages: list[nn.Module] = [
        torch.compile(  # type: ignore[misc]
            nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)), backend="aot_eager"
        )
        for _ in range(4)
    ]
    return stages, _batches(4), lambda out, k: out.pow(2).mean()
