"""gradsafe.testing.emulate_cuda_graphs: static-memory semantics and a clean install/restore."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsafe.testing import EmulatedCUDAGraph, emulate_cuda_graphs
from gradsafe.testing._cuda_emulation import _SLOTS


def _capture(fn, *static_inputs):  # type: ignore[no-untyped-def]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*static_inputs)
    return g, out


def test_replay_writes_into_captured_output_in_place() -> None:
    with emulate_cuda_graphs():
        x = torch.tensor([1.0, 2.0])
        g, out = _capture(lambda t: t * 3 + 1, x)
        ptr, held = out.data_ptr(), out.detach()
        x.copy_(torch.tensor([10.0, 20.0]))
        g.replay()
        assert out.data_ptr() == ptr
        assert out.tolist() == [31.0, 61.0]
        assert held.tolist() == [31.0, 61.0]  # any alias of the static output changes too


def test_replay_reads_current_static_inputs_and_views() -> None:
    with emulate_cuda_graphs():
        x = torch.arange(6.0)
        g, (head, total) = _capture(lambda t: (t.view(2, 3)[0], t.sum()), x)
        x.mul_(2)
        g.replay()
        assert head.tolist() == [0.0, 2.0, 4.0]
        assert total.item() == 30.0


def test_replay_reruns_in_place_ops_without_version_bumps() -> None:
    with emulate_cuda_graphs():
        acc = torch.zeros(2)
        step = torch.ones(2)
        g, _ = _capture(lambda a, s: a.add_(s), acc, step)
        assert acc.tolist() == [0.0, 0.0]  # capture records without applying (as on a GPU)
        version = acc._version
        g.replay()
        g.replay()
        assert acc.tolist() == [2.0, 2.0]
        assert acc._version == version


def test_replay_of_autograd_backward_capture() -> None:
    with emulate_cuda_graphs():
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        x = torch.tensor([3.0, 4.0])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            (gw,) = torch.autograd.grad((x * w).sum(), [w])
        assert gw.tolist() == [3.0, 4.0]
        x.copy_(torch.tensor([5.0, 6.0]))
        g.replay()
        assert gw.tolist() == [5.0, 6.0]


def test_dispatch_modes_do_not_see_replays() -> None:
    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with emulate_cuda_graphs():
        g, _ = _capture(lambda t: t.exp().sin(), torch.ones(3))
        assert isinstance(g, EmulatedCUDAGraph) and g.num_recorded_ops == 2
        with Count():
            g.replay()
        assert Count.ops == 0


def test_host_sync_during_capture_raises() -> None:
    with emulate_cuda_graphs():
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="previous error during capture") as failed:
            with torch.cuda.graph(g):
                torch.ones(2).sum().item()
        assert "operation not permitted when stream is capturing" in str(failed.value.__context__)
        assert not torch.cuda.is_current_stream_capturing()


def test_capture_state_and_errors() -> None:
    with emulate_cuda_graphs():
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="without a preceding successful capture"):
            g.replay()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
            assert torch.cuda.is_current_stream_capturing()
            with pytest.raises(RuntimeError, match="already underway"):
                torch.cuda.CUDAGraph().capture_begin()
        assert not torch.cuda.is_current_stream_capturing()
        other = torch.cuda.CUDAGraph()
        with torch.cuda.stream(torch.cuda.Stream()):
            other.capture_begin(pool=g.pool())
            other.capture_end()
        assert other.pool() == g.pool()


def test_stream_and_event_calls_of_the_documented_warmup_pattern() -> None:
    with emulate_cuda_graphs():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            assert torch.cuda.current_stream() is s
            y = torch.ones(2) * 2
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
        torch.cuda.current_stream().wait_stream(s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert end.query() and start.elapsed_time(end) >= 0.0
        assert y.tolist() == [2.0, 2.0]


def _current() -> list[object]:
    return [getattr(importlib.import_module(m), a) for m, a, _ in _SLOTS]


def test_install_restore_and_nesting() -> None:
    before = _current()
    with emulate_cuda_graphs():
        inside = _current()
        assert inside == [s for _, _, s in _SLOTS]
        with emulate_cuda_graphs():
            assert _current() == inside
        assert _current() == inside  # inner exit keeps the outer emulation
    assert _current() == before


def test_restore_on_exception() -> None:
    before = _current()
    with pytest.raises(KeyError):
        with emulate_cuda_graphs():
            raise KeyError("boom")
    assert _current() == before


def test_each_emulation_starts_on_the_default_stream() -> None:
    with emulate_cuda_graphs():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            pass
        with pytest.raises(RuntimeError, match="already owns a captured graph"):
            with torch.cuda.graph(g):  # capture_begin raises with the capture stream entered
                pass
        assert torch.cuda.current_stream() is not torch.cuda.default_stream()
    with emulate_cuda_graphs():
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
