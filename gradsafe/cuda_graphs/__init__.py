"""CUDA-graph capabilities: owned gradients from graphed callables (H3) and checked capture orders (H5).

* :func:`make_graphed_callables` (in :mod:`~gradsafe.cuda_graphs._graphed`):
  ``torch.cuda.make_graphed_callables`` whose backward never hands a
  CUDA-graph static buffer to autograd;
* :func:`make_graphed_split_callables` (:mod:`~gradsafe.cuda_graphs.split_stages`):
  graphed B and W stages for split-backward pipeline schedules;
* :class:`CaptureOrder` (:mod:`~gradsafe.cuda_graphs.capture_order`): a
  capture order checked against the schedule that replays it.
"""

from __future__ import annotations

from gradsafe.cuda_graphs._graphed import make_graphed_callables
from gradsafe.cuda_graphs._ownership import Ownership
from gradsafe.cuda_graphs._structure import UnsupportedTorchError
from gradsafe.cuda_graphs._te import UnsupportedTransformerEngineError
from gradsafe.cuda_graphs.capture_order import (
    CaptureEntry,
    CaptureOrder,
    CaptureOrderError,
    EntryKind,
    Rule,
    TEOrder,
)
from gradsafe.cuda_graphs.split_stages import (
    GraphedSplitStages,
    ReplayOrderError,
    SplitStageState,
    make_graphed_split_callables,
)

__all__ = [
    "CaptureEntry",
    "CaptureOrder",
    "CaptureOrderError",
    "EntryKind",
    "GraphedSplitStages",
    "Ownership",
    "ReplayOrderError",
    "Rule",
    "SplitStageState",
    "TEOrder",
    "UnsupportedTorchError",
    "UnsupportedTransformerEngineError",
    "make_graphed_callables",
    "make_graphed_split_callables",
]
