"""Sample arguments with autograd history: graphed as the leaves the graphed callable sees.

Upstream captures its backward as ``torch.autograd.grad(outputs, inputs=surface)``
over the sample arguments themselves. A sample tensor that is not a leaf
(``hs.clone()``, ``2 * hs``) keeps its history, and autograd's gradient for a
slot sums every path from the outputs to that tensor, including paths through
another sample tensor's history: with ``sample_args=(hs, hs.clone())`` the
first slot's captured gradient also holds the second slot's, so every call's
first input (and every weight behind it) gets that term again, silently, on a
GPU as anywhere (it is autograd's arithmetic, captured once and replayed). A
history that reaches a module parameter adds to that parameter's slot the same
way; one that is freed on the way raises at warm-up instead. A graphed
callable's backward must give each input its own partial derivative, as the
eager callable's does; detaching the samples captures exactly that.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from gradsafe.cuda_graphs._structure import tree_map

__all__ = ["without_sample_history"]

_Args = TypeVar("_Args")


def without_sample_history(sample_args: _Args) -> _Args:
    """``sample_args`` with each non-leaf tensor that requires grad replaced by a detached leaf.

    The leaf shares the sample's memory and version counter, so a graphed
    callable later called with the sample itself still reads it in place, and
    in-place changes to it are still seen.
    """

    def leaf(value: object) -> object:
        if isinstance(value, torch.Tensor) and value.requires_grad and not value.is_leaf:
            return value.detach().requires_grad_()
        return value

    return tree_map(leaf, sample_args)  # type: ignore[no-any-return]
