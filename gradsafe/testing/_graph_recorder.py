"""Record aten ops into a graph and replay them into the same memory (CPU stand-in for a CUDA graph).

A real CUDA graph capture *records* kernels without running them, and replay
runs them against the captured addresses and shapes. :class:`GraphRecording`
reproduces that on the CPU:

* capture runs each aten op eagerly (the captured code needs real values to
  continue, e.g. to build the autograd graph) and records it with the memory
  and the shapes it read and wrote;
* writes the capture made to memory that existed before the capture are
  undone when it ends, so the capture leaves no trace outside the memory it
  allocated (a whole training step captured once is not also applied once);
* replay re-runs the ops and writes each result into the captured memory, so
  every Python reference to a captured tensor (a static output, a static
  gradient, a ``.detach()`` of one) sees the new values, as on a GPU;
* what a real capture refuses (reading a device value on the host, ops whose
  output shape depends on device values) raises the error a GPU raises; which
  calls those are is one table, :mod:`gradsafe.testing._capture_verdicts`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    is_traceable_wrapper_subclass,
)

from gradsafe.testing._capture_verdicts import (
    Capture,
    Verdict,
    host_read_refused,
    torch_function_verdict,
)

__all__ = [
    "INVALIDATED",
    "NOT_PERMITTED",
    "CaptureRefusal",
    "GraphRecording",
    "HostReadRefusalMode",
    "RecordingMode",
    "capture_error",
]

# CUDA errors surface as torch.AcceleratorError (a RuntimeError) where torch
# has it; the emulator raises the same class so `except`/`pytest.raises`
# written against a GPU run match.
_CUDA_ERROR: Final[type[RuntimeError]] = getattr(torch, "AcceleratorError", RuntimeError)

NOT_PERMITTED: Final = "CUDA error: operation not permitted when stream is capturing"
INVALIDATED: Final = "CUDA error: operation failed due to a previous error during capture"


def capture_error(message: str) -> RuntimeError:
    """The exception class a GPU raises for a CUDA error, carrying ``message``."""
    return _CUDA_ERROR(message)


class CaptureRefusal:
    """Why the running capture is invalid, if it is: the first refused operation."""

    def __init__(self) -> None:
        self.first: str | None = None

    def refuse(self, what: str, fix: str, cuda_message: str = NOT_PERMITTED) -> RuntimeError:
        """The error for a refused operation; the capture is invalid from now on, as on a GPU."""
        detail = f"{cuda_message} (emulated capture: {what}. {fix})"
        if self.first is None:
            self.first = detail
        return capture_error(detail)


_HOST_READ_FIX: Final = (
    "Read device values on the host only outside the captured region (after replay())."
)


def _refused(row: Verdict, what: str, refusal: CaptureRefusal) -> RuntimeError:
    """The error a GPU raises for a refused row: torch's own check's (the capture stays
    valid), else CUDA's (the capture is invalid from then on)."""
    if row.torch_error is not None:
        return RuntimeError(f"{row.torch_error} (emulated capture: {what}. {_HOST_READ_FIX})")
    return refusal.refuse(what, _HOST_READ_FIX)


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """Tensors the op writes in place (``self`` of ``add_``, ``out=``, lists of ``_foreach_*_``)."""
    schema = getattr(func, "_schema", None)  # higher-order operators have none
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                yield t


def _storage_key(t: torch.Tensor) -> int | None:
    if t.layout is not torch.strided or t.untyped_storage().nbytes() == 0:
        return None
    return t.untyped_storage().data_ptr()


@dataclasses.dataclass(frozen=True)
class _Frozen:
    """A tensor as the captured kernel saw it: its memory, and the shape at that moment.

    A GPU kernel's arguments (address, sizes, strides) are fixed at capture, so
    replay rebuilds each one from here instead of reading the tensor's current
    metadata (in-place metadata ops such as ``unsqueeze_`` must not compound).
    """

    memory: torch.Tensor  # ``.data`` alias: same storage, own version counter
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.layout is not torch.strided or is_traceable_wrapper_subclass(x):
            return x.data
        return _Frozen(x.data, tuple(x.shape), tuple(x.stride()), int(x.storage_offset()))

    def thaw(self) -> torch.Tensor:
        return self.memory.as_strided(self.size, self.stride, self.offset)


def _thaw(x: Any) -> Any:
    return x.thaw() if isinstance(x, _Frozen) else x


@dataclasses.dataclass
class _RecordedOp:
    """One aten call: the op, its flattened arguments, and the fresh memory it produced."""

    func: Callable[..., Any]
    args: list[Any]
    spec: pytree.TreeSpec
    # Outputs that own fresh memory, by index into the flattened outputs: replay
    # copies the re-run results into them. Views and in-place results alias an
    # input and are updated by re-running the op itself.
    fresh: dict[int, _Frozen]


@dataclasses.dataclass(frozen=True)
class _Layout:
    data_ptr: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> _Layout:
        ptr = t.untyped_storage().data_ptr() if t.layout is torch.strided else 0
        return _Layout(ptr, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)

    def describe(self) -> str:
        return f"shape {list(self.size)}, stride {list(self.stride)}, offset {self.offset}, {self.dtype}"


class GraphRecording:
    """The ops of one capture, replayable into the captured memory."""

    def __init__(self) -> None:
        self._ops: list[_RecordedOp] = []
        self._sealed = False
        self.refusal = CaptureRefusal()
        # Storages the capture allocated (the graph's own memory) ...
        self._own: set[int] = set()
        # ... and, for every other storage it wrote, the bytes it held before.
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        # Every tensor object the capture touched, with its layout at capture end.
        self._touched: dict[int, torch.Tensor] = {}
        self._layouts: list[tuple[weakref.ref[torch.Tensor], _Layout]] = []
        self._rng_state = torch.get_rng_state()

    def before_write(self, t: torch.Tensor) -> None:
        """Save a pre-existing storage's bytes before the capture first writes it."""
        key = _storage_key(t)
        if key is None or key in self._own or key in self._saved:
            return
        storage = t.untyped_storage()
        with _disable_current_modes(), torch.no_grad():
            self._saved[key] = (storage, storage.clone())

    def record(
        self, func: Callable[..., Any], args: tuple, kwargs: dict, frozen_args: list[Any], out: Any
    ) -> None:
        flat_args = pytree.tree_leaves((args, kwargs))
        read = {
            key
            for a in flat_args
            if isinstance(a, torch.Tensor) and (key := _storage_key(a)) is not None
        }
        fresh: dict[int, _Frozen] = {}
        for i, o in enumerate(pytree.tree_leaves(out)):
            if not isinstance(o, torch.Tensor):
                continue
            self._touched.setdefault(id(o), o)
            key = _storage_key(o)
            if key is not None and key not in read:
                self._own.add(key)
                frozen = _Frozen.of(o)
                if isinstance(frozen, _Frozen):
                    fresh[i] = frozen
        for a in flat_args:
            if isinstance(a, torch.Tensor):
                self._touched.setdefault(id(a), a)
        _, spec = pytree.tree_flatten((args, kwargs))
        self._ops.append(_RecordedOp(func, frozen_args, spec, fresh))

    def seal(self) -> None:
        """End of capture: undo writes to memory the capture did not allocate, and the RNG draws."""
        with _disable_current_modes(), torch.no_grad():
            for storage, before in self._saved.values():
                storage.copy_(before)
        self._saved.clear()
        torch.set_rng_state(self._rng_state)
        self._layouts = [
            (weakref.ref(t), _Layout.of(t))
            for t in self._touched.values()
            if t.layout is torch.strided
        ]
        self._touched.clear()
        self._sealed = True

    def replay(self) -> None:
        if not self._sealed:
            raise RuntimeError("emulated CUDAGraph: replay() before capture_end()")
        self._check_layouts()
        # A real replay dispatches no aten ops, so user dispatch modes (op
        # counters, profilers) must not see the re-executed ops either.
        with _disable_current_modes(), torch.no_grad():
            for op in self._ops:
                args, kwargs = pytree.tree_unflatten([_thaw(a) for a in op.args], op.spec)
                result = pytree.tree_leaves(op.func(*args, **kwargs))
                for i, target in op.fresh.items():
                    got = result[i]
                    if tuple(got.shape) != target.size or got.dtype != target.memory.dtype:
                        raise RuntimeError(
                            f"emulated CUDAGraph.replay: {op.func} produced shape {list(got.shape)} "
                            f"({got.dtype}) where the capture produced {list(target.size)} "
                            f"({target.memory.dtype}); a CUDA graph always replays the captured shapes."
                        )
                    target.thaw().copy_(got)

    def _check_layouts(self) -> None:
        for ref, layout in self._layouts:
            t = ref()
            if t is None:
                continue
            now = _Layout.of(t)
            if now != layout:
                raise RuntimeError(
                    f"emulated CUDAGraph.replay: a tensor the graph reads or writes changed from "
                    f"{layout.describe()} to {now.describe()}"
                    f"{' and moved to other memory' if now.data_ptr != layout.data_ptr else ''} "
                    "since capture. A CUDA graph keeps using the captured memory and shape, so it "
                    "would ignore the change silently. Write new values into the captured tensor "
                    "in place (static.copy_(new)), or capture again."
                )

    @property
    def num_ops(self) -> int:
        return len(self._ops)


class RecordingMode(TorchDispatchMode):
    """Runs every op eagerly and records it into ``recording``; refuses what a capture refuses.

    ``in_capture`` says whether the current stream issues into this capture
    (the emulation of streams lives with the stand-ins); an op on a stream
    outside it runs for real and is not recorded, as on a GPU.
    """

    def __init__(self, recording: GraphRecording, in_capture: Callable[[], bool]) -> None:
        super().__init__()
        self.recording = recording
        self.in_capture = in_capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        row = host_read_refused(func, args, kwargs)
        if row is not None:
            raise _refused(row, f"{func}: {row.case} {row.why}", self.recording.refusal)
        if not self.in_capture():
            return func(*args, **kwargs)
        for t in _written_tensors(func, args, kwargs):
            self.recording.before_write(t)
        frozen_args = [_Frozen.of(a) for a in pytree.tree_leaves((args, kwargs))]
        out = func(*args, **kwargs)
        self.recording.record(func, args, kwargs, frozen_args, out)
        return out


class HostReadRefusalMode(TorchFunctionMode):
    """Applies the verdict table's Python-level rows: host copies that bypass aten dispatch
    (``tolist``, ``print``, ``cpu``, ``numpy``) and assignments decided by the Python value
    (``x[mask] = t`` with a one-element tensor ``t``) are refused, and calls whose CPU kernel
    reads the host where CUDA's does not (``one_hot(t, num_classes=k)``) run CUDA's algorithm
    instead.
    """

    def __init__(self, refusal: CaptureRefusal) -> None:
        super().__init__()
        self.refusal = refusal

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        row = torch_function_verdict(func, args, kwargs)
        if row is not None and row.emulated_capture is Capture.REFUSED:
            raise _refused(row, f"{row.case} {row.why}", self.refusal)
        if row is not None and row.cuda_algorithm is not None:
            return row.cuda_algorithm(args, kwargs)
        return func(*args, **kwargs)
