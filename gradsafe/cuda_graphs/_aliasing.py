"""Sample arguments that share memory: refused before torch graphs anything.

Upstream captures one static buffer per tensor of its input surface (the
flattened sample arguments, then a module's parameters) and computes the
captured backward's gradient for each slot with ``torch.autograd.grad``. Two
slots holding one tensor (``sample_args=(h, h)``) are one buffer: each slot
gets the whole gradient of that tensor, and autograd adds the slots, so the
tensor passed there (and every weight behind it) gets its gradient twice; a
later call with two different tensors there copies both into the one buffer
and runs on the second. Slots sharing memory in part (overlapping views) mix
the same way. Distinct sample tensors make distinct buffers, and a callable
graphed from them is exact when later called with one tensor twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from gradsafe.cuda_graphs._structure import arg_tree_leaves

__all__ = ["refuse_shared_sample_args"]


def refuse_shared_sample_args(
    callables: Sequence[object], sample_args: Sequence[tuple[object, ...]]
) -> None:
    """Raise ``ValueError`` where two tensors of one callable's input surface share memory."""
    for index, (callable_, args) in enumerate(zip(callables, sample_args)):
        flat = arg_tree_leaves(*args)
        label = "sample_args[{}]" if len(flat) == len(args) else "flattened sample argument {}"
        named = [(label.format(i), t) for i, t in enumerate(flat)]
        if isinstance(callable_, torch.nn.Module):
            named += [(f"parameter {name!r}", p) for name, p in callable_.named_parameters()]
        tensors = [(name, t) for name, t in named if isinstance(t, torch.Tensor)]
        for (name_a, a), (name_b, b) in itertools.combinations(tensors, 2):
            if _share_memory(a, b):
                which = f" of callable {index}" if len(callables) > 1 else ""
                raise ValueError(
                    f"make_graphed_callables: {name_a} and {name_b}{which} share memory (one "
                    "tensor passed twice, or overlapping views). The graph would capture them as "
                    "one static buffer and give each slot that tensor's whole gradient, so a "
                    "tensor passed there that requires grad (and every weight behind it) would "
                    "get its gradient twice, and a later call with two different tensors there "
                    "would run on the second of them, silently. Pass a "
                    "separate sample tensor for each, e.g. sample_args=(h, "
                    "h.detach().clone().requires_grad_(h.requires_grad)); the graphed callable "
                    "may still be called with one tensor in both places. Nothing was run or "
                    "captured."
                )


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether some byte of ``a``'s elements is a byte of ``b``'s."""
    if a.layout is not torch.strided or b.layout is not torch.strided:
        return a is b
    if a is b:
        return a.numel() > 0
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    try:
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return False
    except (RuntimeError, NotImplementedError, TypeError):  # subclasses without one storage
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _byte_span(a), _byte_span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    if a.is_contiguous() and b.is_contiguous():  # each covers its whole span
        return True
    # Interleaved strided views (x[:, 0] and x[:, 1]): compare the bytes themselves.
    return bool(torch.isin(_bytes(a), _bytes(b)).any())


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes from ``t``'s first element to past its last, from its storage's start."""
    size = t.element_size()
    lo = hi = int(t.storage_offset())
    for extent, stride in zip(t.shape, t.stride()):
        reach = (int(extent) - 1) * int(stride)
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo * size, (hi + 1) * size


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte position ``t``'s elements cover in its storage (on the CPU)."""
    offsets = torch.tensor([t.storage_offset()], dtype=torch.int64)
    for extent, stride in zip(t.shape, t.stride()):
        offsets = (offsets[:, None] + torch.arange(extent) * stride).flatten()
    size = t.element_size()
    return (offsets[:, None] * size + torch.arange(size)).flatten()
