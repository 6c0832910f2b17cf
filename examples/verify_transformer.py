"""A small transformer for ``gradsafe verify``: tied embeddings, selective activation checkpointing.

    python -m gradsafe verify examples.verify_transformer:v_shaped_rank
    python -m gradsafe verify examples.verify_transformer:twelve_blocks --time

``v_shaped_rank`` is what one rank of a V-shaped schedule (ZBV, DualPipeV) holds:
the first stage (token embedding, blocks) and the last (blocks, head), the head
tied to the embedding, every other block's MLP checkpointed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 64


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 4, checkpoint_mlp: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.checkpoint_mlp = checkpoint_mlp
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        if self.checkpoint_mlp:  # selective AC: only the MLP is recomputed
            return x + checkpoint(self.mlp, h, use_reentrant=False)
        return x + self.mlp(h)


class First(nn.Module):
    def __init__(self, d: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.Sequential(*(Block(d, checkpoint_mlp=i % 2 == 1) for i in range(blocks)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(tokens))


class Last(nn.Module):
    def __init__(self, d: int, blocks: int, embed: nn.Embedding) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d, checkpoint_mlp=i % 2 == 1) for i in range(blocks)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = embed.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


def _stages(d: int, blocks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    first = First(d, blocks // 2)
    return [first, Last(d, blocks - blocks // 2, first.embed)]


def _tokens(count: int, batch: int = 2, seq: int = 16) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=generator),) for _ in range(count)]


def _cross_entropy(logits: torch.Tensor, microbatch: int) -> torch.Tensor:
    targets = torch.arange(logits.shape[0] * logits.shape[1], device=logits.device).remainder(VOCAB)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets)


def v_shaped_rank():  # type: ignore[no-untyped-def]
    """(stages, microbatches, loss_fn): 4 blocks, d=32, 4 microbatches."""
    return _stages(32, 4), _tokens(4), _cross_entropy


def twelve_blocks():  # type: ignore[no-untyped-def]
    """(stages, microbatches, loss_fn): 12 blocks, d=128, 4 microbatches."""
    return _stages(128, 12), _tokens(4), _cross_entropy
