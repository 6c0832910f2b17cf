"""A stage call site gradsafe's W needs changed (the patch registry installs it; see _patch.py).

torch's stage metadata inference (``PipelineStage._forward_metadata_inference``,
where the installed torch has it) runs a DDP-wrapped stage's forward outside
``no_sync``, so DDP's reducer is left prepared for a backward. torch's own W
fires no hooks and never notices (its DDP stages are never reduced at all);
gradsafe's W fires each AccumulateGrad hook as a fused backward does, so the
first W of the first step all-reduces a partial gradient and DDP fails at the
next forward ("rebuilt parameter indices size is not same as original model
parameters size"). Running the inference forward under ``no_sync``, as the
stage's real forwards are, leaves one prepared backward per step: the last.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

__all__ = ["inference_without_ddp_prepare"]


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
