"""Every use of private torch internals by the wgrad policy, in one place.

- ``torch._C._current_graph_task_id()``: the running backward's graph task
  (present on every supported torch), so one backward carries one dummy
  gradient per flagged parameter into its AccumulateGrad.
"""

from __future__ import annotations

import torch

__all__ = ["current_graph_task"]


def current_graph_task() -> int:
    """The id of the autograd graph task running on this thread: -1 outside a backward, new per backward call."""
    return int(torch._C._current_graph_task_id())
