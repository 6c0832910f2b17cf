"""Every use of private torch internals by the wgrad policy, in one place.

- ``torch._C._current_graph_task_id()``: the running backward's graph task
  (present on every supported torch), so one backward carries one dummy
  gradient per flagged parameter into its AccumulateGrad.
- ``Tensor._version``: the autograd version counter (present on every
  supported torch; what a saved tensor's unpack compares), so W can tell that
  a tensor a delayed closure reads was modified in place since B.
"""

from __future__ import annotations

import torch

__all__ = ["autograd_version", "current_graph_task"]


def current_graph_task() -> int:
    """The id of the autograd graph task running on this thread: -1 outside a backward, new per backward call."""
    return int(torch._C._current_graph_task_id())


def autograd_version(t: torch.Tensor) -> int:
    """How many in-place modifications autograd has counted on ``t``'s memory (shared by its views)."""
    return int(t._version)
