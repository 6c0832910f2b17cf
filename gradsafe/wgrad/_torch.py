"""Every use of private torch internals by the wgrad policy, in one place.

- ``torch._C._current_graph_task_id()``: the running backward's graph task
  (present on every supported torch), so one backward carries one dummy
  gradient per flagged parameter into its AccumulateGrad. Its behaviour is
  probed once per process (:func:`graph_task_ids_differ`); where it differs,
  :func:`current_graph_task` answers -1 ("unknown") and every call gets a
  dummy of its own (zeros: the same sums, one transient buffer more).
- ``Tensor._version``: the autograd version counter (present on every
  supported torch; what a saved tensor's unpack compares), so W can tell that
  a tensor a delayed closure reads was modified in place since B.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["autograd_version", "current_graph_task", "graph_task_ids_differ"]


def current_graph_task() -> int:
    """The id of the autograd graph task running on this thread: -1 outside a backward, new per
    backward call; -1 always where :func:`graph_task_ids_differ` found torch's ids unlike that."""
    if graph_task_ids_differ() is not None:
        return -1
    return int(torch._C._current_graph_task_id())


@functools.cache
def graph_task_ids_differ() -> str | None:
    """How ``torch._C._current_graph_task_id`` differs from what :func:`current_graph_task`
    promises (one id shared by one backward's hooks, another for the next backward, the
    caller's own again after both), if it does; checked once per process on tiny tensors,
    out of sight of the caller's dispatch modes. A probe that fails in any way is a difference."""
    getter = getattr(torch._C, "_current_graph_task_id", None)
    if getter is None:
        return "torch._C has no _current_graph_task_id"
    try:
        with _disable_current_modes(), torch.enable_grad(), torch.inference_mode(False):
            return _ids_differ(getter)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return f"probing it failed ({type(exc).__name__}: {exc})"


def _ids_differ(getter: Callable[[], int]) -> str | None:
    seen: list[int] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(int(getter()))
        return grad

    caller = int(getter())  # -1, or the task of a backward this probe runs inside
    for factor in (2.0, 3.0):
        x = torch.zeros(1, requires_grad=True)
        y = x * factor
        y.register_hook(hook)
        x.register_hook(hook)
        torch.autograd.backward(y.sum(), inputs=[x])
    after = int(getter())
    first, second = seen[:2], seen[2:]
    if (
        len(seen) == 4
        and first[0] == first[1] != -1
        and second[0] == second[1] != -1
        and first[0] != second[0]
        and caller not in (first[0], second[0])
        and after == caller
    ):
        return None
    return f"two backwards' hooks saw ids {seen}, the caller {caller} before and {after} after"


def autograd_version(t: torch.Tensor) -> int:
    """How many in-place modifications autograd has counted on ``t``'s memory (shared by its views)."""
    return int(t._version)
