"""Record aten ops into a graph and replay them into the same tensors (CPU stand-in for a CUDA graph).

A real CUDA graph replays kernels against fixed addresses: every tensor made
during capture keeps its memory, and replay rewrites that memory in place.
:class:`GraphRecording` reproduces exactly that on the CPU: capture runs each
aten op eagerly and records it with the very tensors it read and wrote; replay
re-runs the ops and writes each result into the captured output tensor, so any
Python reference to a captured tensor (a static output, a static gradient, a
``.detach()`` of one) sees the new values, as on a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["GraphRecording", "RecordingMode"]

_SYNCING_OPS = frozenset({torch.ops.aten._local_scalar_dense.default})


def _storage_key(t: torch.Tensor) -> int | None:
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


@dataclasses.dataclass
class _RecordedOp:
    """One aten call: the op, its (flattened) arguments, and what it produced.

    ``args`` hold the tensors the op read during capture; after
    :meth:`GraphRecording.seal` they are replaced by ``.data`` aliases (same
    memory, own version counter), because a GPU replay writes memory without
    bumping autograd version counters.
    """

    func: Callable[..., Any]
    args: list[Any]
    spec: pytree.TreeSpec
    outputs: list[Any]
    # Indices into the flattened outputs that own fresh memory and so must be
    # rewritten in place on replay; views and in-place results alias an input
    # and are updated by re-running the op itself.
    fresh: list[int]


class GraphRecording:
    """The ops of one capture, replayable into the captured tensors."""

    def __init__(self) -> None:
        self._ops: list[_RecordedOp] = []
        self._sealed = False

    def record(self, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
        flat_args, spec = pytree.tree_flatten((args, kwargs))
        input_storages = {
            key
            for a in flat_args
            if isinstance(a, torch.Tensor) and (key := _storage_key(a)) is not None
        }
        flat_out = pytree.tree_leaves(out)
        fresh = [
            i
            for i, o in enumerate(flat_out)
            if isinstance(o, torch.Tensor)
            and (key := _storage_key(o)) is not None
            and key not in input_storages
        ]
        self._ops.append(_RecordedOp(func, flat_args, spec, flat_out, fresh))

    def seal(self) -> None:
        """End of capture: swap every recorded tensor for a ``.data`` alias."""

        def alias(x: Any) -> Any:
            return x.data if isinstance(x, torch.Tensor) else x

        for op in self._ops:
            op.args = [alias(a) for a in op.args]
            op.outputs = [alias(o) for o in op.outputs]
        self._sealed = True

    def replay(self) -> None:
        if not self._sealed:
            raise RuntimeError("emulated CUDAGraph: replay() before capture_end()")
        # A real replay dispatches no aten ops, so user dispatch modes (op
        # counters, profilers) must not see the re-executed ops either.
        with _disable_current_modes(), torch.no_grad():
            for op in self._ops:
                args, kwargs = pytree.tree_unflatten(op.args, op.spec)
                result = pytree.tree_leaves(op.func(*args, **kwargs))
                for i in op.fresh:
                    op.outputs[i].copy_(result[i])

    @property
    def num_ops(self) -> int:
        return len(self._ops)


class RecordingMode(TorchDispatchMode):
    """Runs every op eagerly and records it into ``recording``.

    Ops that would make the host wait for the device (``.item()``, ``bool(t)``)
    raise, as they do during a real stream capture.
    """

    def __init__(self, recording: GraphRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _SYNCING_OPS:
            raise RuntimeError(
                f"emulated CUDA graph capture: {func} reads a device value on the host, which is "
                "not permitted while a stream is capturing (as on a GPU). Move .item()/bool(tensor) "
                "out of the captured region."
            )
        out = func(*args, **kwargs)
        self.recording.record(func, args, kwargs, out)
        return out
