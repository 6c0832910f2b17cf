"""CPU stand-ins for the CUDA graph, stream and pool APIs, and the context manager that installs them.

Everything here runs on CPU tensors: capture records aten ops
(:mod:`gradsafe.testing._graph_recorder`), replay rewrites the captured tensors
in place. Streams and events are ordering no-ops because the CPU runs ops in
program order; what they still track is which streams a capture spans (CUDA's
fork/join rule: a side stream joins by waiting on a capturing stream, and must
be waited on again before the capture ends), and they refuse, during a
capture, the calls a real capture refuses (synchronising, querying), with the
error a GPU raises.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Final

import torch

from gradsafe.patching import REGISTRY, AttrTarget, Target
from gradsafe.testing._graph_recorder import (
    INVALIDATED,
    GraphRecording,
    HostReadRefusalMode,
    RecordingMode,
    capture_error,
)

__all__ = [
    "EmulatedCUDAGraph",
    "EmulatedEvent",
    "EmulatedStream",
    "emulate_cuda_graphs",
    "emulated_graph",
]

_pool_ids = itertools.count(1)
_stream_ids = itertools.count(1)


_SYNC_FIX: Final = (
    "Synchronise before capture_begin() or after capture_end(), never inside the capture."
)


def _refuse_while_capturing(what: str) -> None:
    graph = _STATE.capturing
    if graph is not None:
        raise graph.refuse(what, _SYNC_FIX)


def _new_pool_handle() -> tuple[int, int]:
    # Real handles are (id, 0)-style tuples; callers treat them as opaque tokens.
    return (0, next(_pool_ids))


class _CaptureStreams:
    """The streams one capture spans, and how far each one's work is ordered before the others'.

    CUDA's rules: a stream joins a capture by waiting on a stream (or an event
    recorded on a stream) in it; work on a stream outside the capture runs
    eagerly and is not part of the graph; the capture can only end once the
    origin stream has waited on every joined stream's last work.
    """

    def __init__(self, origin: EmulatedStream) -> None:
        self.origin = origin
        self.work: dict[EmulatedStream, int] = {origin: 0}  # ops issued, per member
        self.seen: dict[EmulatedStream, dict[EmulatedStream, int]] = {origin: {}}

    def issue(self, stream: EmulatedStream) -> bool:
        """Count an op on ``stream``; False if the stream is outside the capture."""
        if stream not in self.work:
            return False
        self.work[stream] += 1
        return True

    def snapshot(self, stream: EmulatedStream) -> dict[EmulatedStream, int] | None:
        """The work ordered before ``stream``'s tail, or None if it is outside the capture."""
        if stream not in self.work:
            return None
        return {**self.seen[stream], stream: self.work[stream]}

    def wait(self, waiter: EmulatedStream, snapshot: dict[EmulatedStream, int] | None) -> None:
        if snapshot is None:
            return
        self.work.setdefault(waiter, 0)
        seen = self.seen.setdefault(waiter, {})
        for stream, count in snapshot.items():
            if stream is not waiter and seen.get(stream, 0) < count:
                seen[stream] = count

    def unjoined(self) -> list[EmulatedStream]:
        joined = self.seen[self.origin]
        return [s for s, n in self.work.items() if s is not self.origin and joined.get(s, 0) < n]


def _capture_streams() -> _CaptureStreams | None:
    graph = _STATE.capturing
    return None if graph is None else graph.streams


class EmulatedStream:
    """A stream handle. Work is ordered by the CPU, so waits order nothing; they do join captures."""

    def __init__(self, device: object = None, priority: int = 0, **_: object) -> None:
        self.stream_id = next(_stream_ids)
        self.priority = priority
        self.device = torch.device("cpu")

    def wait_stream(self, stream: EmulatedStream) -> None:
        capture = _capture_streams()
        if capture is not None:
            capture.wait(self, capture.snapshot(stream))

    def wait_event(self, event: EmulatedEvent) -> None:
        capture = _capture_streams()
        if capture is not None and event._capture is capture:
            capture.wait(self, event._snapshot)

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        event = EmulatedEvent() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        _refuse_while_capturing("Stream.query()")
        return True

    def synchronize(self) -> None:
        _refuse_while_capturing("Stream.synchronize() waits for the device")

    def __repr__(self) -> str:
        return f"<EmulatedStream {self.stream_id}>"


class EmulatedEvent:
    """An event handle; ``elapsed_time`` measures host time between records."""

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self._when: float | None = None
        # The capture this event was last recorded in, and what it orders after.
        self._capture: _CaptureStreams | None = None
        self._snapshot: dict[EmulatedStream, int] | None = None

    def record(self, stream: EmulatedStream | None = None) -> None:
        self._when = time.perf_counter()
        self._capture = _capture_streams()
        stream = _STATE.current if stream is None else stream
        self._snapshot = None if self._capture is None else self._capture.snapshot(stream)

    def wait(self, stream: EmulatedStream | None = None) -> None:
        (_STATE.current if stream is None else stream).wait_event(self)

    def query(self) -> bool:
        _refuse_while_capturing("Event.query()")
        return True

    def synchronize(self) -> None:
        _refuse_while_capturing("Event.synchronize() waits for the device")

    def elapsed_time(self, end_event: EmulatedEvent) -> float:
        _refuse_while_capturing("Event.elapsed_time() waits for both events")
        if self._when is None or end_event._when is None:
            raise RuntimeError("emulated Event.elapsed_time: both events must be recorded first")
        return (end_event._when - self._when) * 1000.0


class _StreamState(threading.local):
    def __init__(self) -> None:
        self.default = EmulatedStream()
        self.current = self.default
        self.capturing: EmulatedCUDAGraph | None = None


_STATE = _StreamState()


class _StreamContext:
    def __init__(self, stream: EmulatedStream | None) -> None:
        self._stream = stream
        self._previous: EmulatedStream | None = None

    def __enter__(self) -> EmulatedStream | None:
        if self._stream is not None:
            self._previous, _STATE.current = _STATE.current, self._stream
        return self._stream

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            _STATE.current = self._previous


def _stream(stream: EmulatedStream | None) -> _StreamContext:
    return _StreamContext(stream)


def _current_stream(device: object = None) -> EmulatedStream:
    return _STATE.current


def _default_stream(device: object = None) -> EmulatedStream:
    return _STATE.default


def _synchronize(device: object = None) -> None:
    _refuse_while_capturing("torch.cuda.synchronize() waits for the device")


def _empty_cache() -> None:
    pass


def _is_current_stream_capturing() -> bool:
    return _STATE.capturing is not None


def _graph_pool_handle() -> tuple[int, int]:
    return _new_pool_handle()


class EmulatedCUDAGraph:
    """Stand-in for :class:`torch.cuda.CUDAGraph` with real static-memory semantics.

    ``capture_begin``/``capture_end`` record every aten op run in between (on
    this thread) and then undo the capture's writes to memory it did not
    allocate; ``replay`` re-runs the ops, reading the captured input memory as
    it is *now* and writing results into the captured output memory in place.
    The checks of torch's ``CUDAGraph`` (non-default capture stream, one
    capture per instance, end on the capture stream) apply.
    """

    def __init__(self, keep_graph: bool = False) -> None:
        self._recording: GraphRecording | None = None
        self._modes: tuple[RecordingMode, HostReadRefusalMode] | None = None
        self._pool: tuple[int, int] | None = None
        self._captured = False
        self._error_mode = "global"
        self.streams: _CaptureStreams | None = None

    def capture_begin(
        self,
        pool: object = None,
        capture_error_mode: str = "global",
        check_input_liveness: bool = False,
    ) -> None:
        if self._captured:
            raise RuntimeError(
                "This CUDAGraph instance already owns a captured graph. "
                "To capture a new graph, create a new instance. (emulated)"
            )
        if _STATE.capturing is not None:
            raise RuntimeError("emulated CUDAGraph: another capture is already underway")
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(
                f"emulated CUDAGraph: unknown capture_error_mode {capture_error_mode!r}"
            )
        if _STATE.current is _STATE.default:
            raise RuntimeError(
                "CUDA graphs must be captured on a non-default stream. (However, after capture, "
                "it's ok to replay them on the default stream.) (emulated: enter "
                "torch.cuda.stream(torch.cuda.Stream()) first, or use torch.cuda.graph)"
            )
        self._pool = pool if pool is not None else _new_pool_handle()  # type: ignore[assignment]
        self.streams = _CaptureStreams(_STATE.current)
        recording = GraphRecording()
        self._recording = recording
        self._modes = (
            RecordingMode(recording, self._in_capture),
            HostReadRefusalMode(recording.refusal),
        )
        self._error_mode = capture_error_mode
        _STATE.capturing = self
        for mode in self._modes:
            mode.__enter__()

    def _in_capture(self) -> bool:
        # An op on a stream that has not joined the capture runs eagerly and
        # is not part of the graph, as on a GPU (torch's streams are
        # non-blocking, so even the default stream may run work meanwhile).
        return self.streams is not None and self.streams.issue(_STATE.current)

    def refuse(self, what: str, fix: str, **kw: str) -> RuntimeError:
        """The error for an operation this capture refuses; capture_end() will then fail."""
        if self._recording is None:
            raise RuntimeError("emulated CUDAGraph: refuse() outside a capture")
        return self._recording.refusal.refuse(what, fix, **kw)

    def capture_end(self) -> None:
        recording, modes, streams = self._recording, self._modes, self.streams
        if modes is None or recording is None or streams is None or _STATE.capturing is not self:
            raise RuntimeError("emulated CUDAGraph: capture_end() without capture_begin()")
        if _STATE.current is not streams.origin:
            raise RuntimeError("Capture must end on the same stream it began on. (emulated)")
        try:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
        finally:
            _STATE.capturing = None
            self._modes = None
            self.streams = None
            # Undo the capture's side effects even when it failed.
            recording.seal()
        if recording.refusal.first is not None:
            self._recording = None
            raise capture_error(
                f"{INVALIDATED} (emulated; the first error was: {recording.refusal.first})"
            )
        unjoined = streams.unjoined()
        if unjoined:
            self._recording = None
            raise capture_error(
                "CUDA error: capture sequence contains a fork that was not joined to the primary "
                f"stream (emulated: {', '.join(map(repr, unjoined))} did work in the capture after "
                "the capture stream last waited on it; end the fork with "
                "torch.cuda.current_stream().wait_stream(side_stream) before the capture ends)"
            )
        self._captured = True

    def instantiate(self) -> None:
        pass

    def replay(self) -> None:
        if not self._captured or self._recording is None:
            raise RuntimeError(
                "Called CUDAGraph::replay without a preceding successful capture. (emulated)"
            )
        if _STATE.capturing is not None:
            raise NotImplementedError(
                "emulated CUDAGraph: replaying one graph while capturing another is not emulated"
            )
        self._recording.replay()

    def reset(self) -> None:
        self._destroyed_during_another_capture()
        self._recording = None
        self._captured = False

    def _destroyed_during_another_capture(self) -> None:
        # Destroying a captured graph is an API call CUDA refuses while a capture
        # runs (unless relaxed), and the refusal invalidates that capture: "operation
        # not permitted when stream is capturing (function reset)", seen on an H200.
        # Not modelled for a graph the garbage collector frees: when it runs is not
        # the test's to decide, and emulated suites would fail at random.
        active = _STATE.capturing
        if not self._captured or active is None or active is self:
            return
        if active._error_mode != "relaxed" and active._recording is not None:
            active._recording.refusal.refuse(
                "a captured CUDAGraph was reset during this capture",
                "Free graphs before capturing (gc.collect() first) and keep the collector off "
                "while capturing (gc.disable()).",
            )

    def pool(self) -> object:
        if not self._captured or self._pool is None:
            raise RuntimeError(
                "Called CUDAGraph::pool() without a preceding successful capture. (emulated)"
            )
        return self._pool

    @property
    def num_recorded_ops(self) -> int:
        """How many aten ops the capture recorded (0 before capture)."""
        return 0 if self._recording is None else self._recording.num_ops


class emulated_graph:  # noqa: N801 -- mirrors torch.cuda.graph, a class used as a context manager
    """Stand-in for :class:`torch.cuda.graph` (the capture context manager)."""

    default_capture_stream: EmulatedStream | None = None

    def __init__(
        self,
        cuda_graph: EmulatedCUDAGraph,
        pool: object = None,
        stream: EmulatedStream | None = None,
        capture_error_mode: str = "global",
        **_ignored: object,
    ) -> None:
        self.cuda_graph = cuda_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode
        if stream is None and emulated_graph.default_capture_stream is None:
            emulated_graph.default_capture_stream = EmulatedStream()
        self.capture_stream = (
            stream if stream is not None else emulated_graph.default_capture_stream
        )
        self._stream_ctx = _StreamContext(self.capture_stream)

    def __enter__(self) -> None:
        self._stream_ctx.__enter__()
        self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.cuda_graph.capture_end()
        finally:
            self._stream_ctx.__exit__(exc_type, exc, tb)


# Every slot the emulation replaces: (module, attribute, stand-in).
_SLOTS: Final = (
    ("torch.cuda", "CUDAGraph", EmulatedCUDAGraph),
    ("torch.cuda", "graph", emulated_graph),
    ("torch.cuda", "graph_pool_handle", _graph_pool_handle),
    ("torch.cuda", "is_current_stream_capturing", _is_current_stream_capturing),
    ("torch.cuda", "Stream", EmulatedStream),
    ("torch.cuda", "Event", EmulatedEvent),
    ("torch.cuda", "stream", _stream),
    ("torch.cuda", "current_stream", _current_stream),
    ("torch.cuda", "default_stream", _default_stream),
    ("torch.cuda", "synchronize", _synchronize),
    ("torch.cuda", "empty_cache", _empty_cache),
    ("torch.cuda.graphs", "CUDAGraph", EmulatedCUDAGraph),
    ("torch.cuda.graphs", "graph", emulated_graph),
    ("torch.cuda.graphs", "graph_pool_handle", _graph_pool_handle),
    ("torch.cuda.graphs", "is_current_stream_capturing", _is_current_stream_capturing),
)


def plan() -> list[Target]:
    """The slots emulation replaces (the registry's ``cuda_graphs_emulation`` patch)."""
    return [AttrTarget(module, attr, stand_in) for module, attr, stand_in in _SLOTS]


@contextmanager
def emulate_cuda_graphs() -> Iterator[None]:
    """Run CUDA-graph code (``torch.cuda.make_graphed_callables``, ``torch.cuda.graph``) on a CPU-only machine.

    Inside the block, ``torch.cuda.CUDAGraph``, ``torch.cuda.graph``,
    ``torch.cuda.graph_pool_handle``, ``torch.cuda.is_current_stream_capturing``,
    ``torch.cuda.Stream``/``Event``/``stream``/``current_stream``/``default_stream``,
    ``torch.cuda.synchronize`` and ``torch.cuda.empty_cache`` (and the same names
    in ``torch.cuda.graphs``) are CPU stand-ins with the memory semantics of
    real CUDA graphs:

    * capture runs the captured code once to record every aten op with the
      exact tensors it read and produced, then undoes every write it made to
      tensors that existed before the capture (and the CPU random state), so
      capture has no lasting effect outside the graph's own memory, as on a GPU;
    * what a real capture refuses raises ``torch.AcceleratorError`` ("operation
      not permitted when stream is capturing"): host reads (``.item()``,
      ``bool()``, ``.tolist()``, printing, ``torch.equal``, ``.cpu()``),
      data-dependent shapes (``nonzero``, boolean-mask indexing, ``unique``...)
      and waits (``torch.cuda.synchronize``, stream and event syncs); the
      capture then fails at its end, as a real one does; side streams must be
      joined back (fork/join rule);
    * ``replay()`` re-runs the recorded ops, reading the captured input tensors
      as they are now and writing every result into the tensor the capture
      produced, in place (no autograd version-counter bumps, no ops visible to
      dispatch modes), so a tensor that aliases a static buffer changes under
      its holder exactly as on a GPU; a result whose shape changed, or a
      static tensor resized or moved since capture, raises instead of being
      broadcast.

    Tensors stay on the CPU: pass CPU sample args and inputs. This makes graphed
    training loops testable in CPU-only CI, including aliasing bugs such as a
    gradient that lives in a static buffer being overwritten by the next replay.

    Not emulated: memory reuse between graphs sharing a pool (the emulation
    keeps every captured tensor alive, which can hide a pool-reuse bug), and
    replaying one graph inside another capture; tensors created during capture
    hold values until the first replay where a GPU leaves them uninitialised.
    docs/cuda_graphs.md lists every remaining difference.

    Nesting is allowed; torch's objects are put back when the outermost block
    exits (also on an exception).

    Example::

        from gradsafe.testing import emulate_cuda_graphs

        with emulate_cuda_graphs():
            graphed = torch.cuda.make_graphed_callables(model, (torch.randn(8, 16),))
            graphed(x).sum().backward()
    """
    # The same registry as gradsafe.patch(), so get_original() and
    # is_object_patched() see the stand-ins; not one of patch()'s names.
    if torch.cuda.Stream is not EmulatedStream:
        # Outermost block: start on the default stream, as a fresh process does,
        # whatever an earlier block left current (torch.cuda.graph leaves its
        # capture stream current when capture_begin raises: torch/cuda/graphs.py
        # enters the stream before capture_begin, and the emulation mirrors it).
        _STATE.current = _STATE.default
    with REGISTRY.hold("cuda_graphs_emulation"):
        yield
