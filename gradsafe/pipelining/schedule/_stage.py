"""Stage call sites gradsafe's W needs changed (the patch registry installs them; see _patch.py).

torch's stage metadata inference (``PipelineStage._forward_metadata_inference``,
where the installed torch has it) runs a DDP-wrapped stage's forward outside
``no_sync``, so DDP's reducer is left prepared for a backward. torch's own W
fires no hooks and never notices (its DDP stages are never reduced at all);
gradsafe's W fires each AccumulateGrad hook as a fused backward does, so the
first W of the first step all-reduces a partial gradient and DDP fails at the
next forward ("rebuilt parameter indices size is not same as original model
parameters size"). Running the inference forward under ``no_sync``, as the
stage's real forwards are, leaves one prepared backward per step: the last.

A last stage keeps each microbatch's output for ``step()`` to merge and, after
B, detaches it in place so that it holds no graph; a view cannot be detached
in place, so torch keeps it, and the microbatch's whole graph behind it, until
the next step clears the list. torch's W frees the saved tensors of the nodes
its engine pass runs; gradsafe's W frees none (a graph goes when it is
dropped), so there the activations stayed until the next step. The stage is
made to keep a detached alias of such a view for the merge instead: the same
values and storage without a graph, like its other outputs after B. The
schedule computes the loss from the output ``forward_one_chunk`` returns,
which is untouched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gradsafe.pipelining._torch import is_view

__all__ = ["inference_without_ddp_prepare", "merge_without_view_graphs"]


def inference_without_ddp_prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_forward_metadata_inference`` so a DDP stage's inference forward runs in ``no_sync``."""

    @functools.wraps(original)
    def _forward_metadata_inference(self: Any, *args: Any, **kwargs: Any) -> Any:
        submod = self.submod
        quiet = (
            submod.no_sync()
            if isinstance(submod, DistributedDataParallel)
            else contextlib.nullcontext()
        )
        with quiet:
            return original(self, *args, **kwargs)

    return _forward_metadata_inference


def merge_without_view_graphs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``forward_one_chunk`` so a last stage keeps its view outputs for the merge detached."""

    @functools.wraps(original)
    def forward_one_chunk(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        kept = self.output_chunks
        # As torch detaches after B: a last stage that is not also the first
        # (that one runs a full backward), its top-level outputs only, and only
        # in a step with a backward (a forward-only step returns its graph).
        if self.has_backward and self.is_last and not self.is_first and kept and kept[-1] is output:
            kept[-1] = _without_view_graphs(output)
        return output

    return forward_one_chunk


def _detached_if_view(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.grad_fn is not None and is_view(value):
        return value.detach()
    return value


def _without_view_graphs(output: Any) -> Any:
    """``output`` with its top-level view tensors detached (the ones torch cannot detach in place)."""
    if type(output) in (tuple, list):
        return type(output)(_detached_if_view(v) for v in output)
    return _detached_if_view(output)
