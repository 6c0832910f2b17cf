"""emulate_cuda_graphs is as strict as a real capture (issue 13, item 4).

* capture records without applying: memory that existed before the capture
  holds its pre-capture values afterwards (a whole-step capture does not also
  take one optimizer step), and the RNG is not advanced;
* what a GPU capture refuses raises the error class a GPU raises
  (``torch.AcceleratorError``, "operation not permitted when stream is
  capturing"), and the capture then fails at its end, as on a GPU;
* replay uses the captured shapes and memory, and refuses a tensor whose
  shape or memory changed since capture instead of broadcasting into it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from gradsafe.testing import emulate_cuda_graphs

CUDA_ERROR = getattr(torch, "AcceleratorError", RuntimeError)


@pytest.fixture(autouse=True)
def emulated() -> Iterator[None]:
    with emulate_cuda_graphs():
        yield


def _capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


# ---------------------------------------------------------------- no lasting side effects


def _model_and_batch() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)
    ).double()
    return model, torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)


def _reference_weights(steps: int, momentum: float) -> list[torch.Tensor]:
    model, x, y = _model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_whole_step_capture_takes_no_step_itself(momentum: float) -> None:
    # The documented whole-network pattern: warm up eagerly, capture one full
    # step (forward, backward, optimizer), replay. On a GPU the capture
    # applies nothing, so warm-up + 3 replays = 4 steps, not 5.
    model, x, y = _model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    static_x, static_y = x.clone(), y.clone()

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(static_x), static_y)
        loss.backward()
        opt.step()
        return loss

    with torch.cuda.stream(torch.cuda.Stream()):
        step()  # warm-up: allocates .grad and the momentum buffers eagerly
    after_warmup = [p.detach().clone() for p in model.parameters()]
    g, _ = _capture(step)
    for p, before in zip(model.parameters(), after_warmup):
        assert torch.equal(p.detach(), before)
    for _ in range(3):
        g.replay()
    for p, want in zip(model.parameters(), _reference_weights(4, momentum)):
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-12)


def test_capture_undoes_writes_to_preexisting_memory_only() -> None:
    a, b, c = torch.zeros(4), torch.ones(3), torch.zeros(2)
    listed = [torch.zeros(2), torch.zeros(2)]
    before = [t.clone() for t in (a, b, c, *listed)]

    def body() -> torch.Tensor:
        a.add_(1)  # in place
        a[1:3].mul_(5)  # through a view
        torch.add(b, 2, out=b)  # out=
        c.data.copy_(torch.ones(2))  # through .data
        torch._foreach_add_(listed, 1.0)  # a list written in place
        fresh = torch.zeros(2)
        fresh.add_(7)  # the graph's own memory
        return fresh

    g, fresh = _capture(body)
    for t, want in zip((a, b, c, *listed), before):
        assert torch.equal(t, want)
    assert isinstance(fresh, torch.Tensor)
    g.replay()
    assert a.tolist() == [1.0, 5.0, 5.0, 1.0]
    assert b.tolist() == [3.0, 3.0, 3.0]
    assert c.tolist() == [1.0, 1.0] and listed[0].tolist() == [1.0, 1.0]
    assert fresh.tolist() == [7.0, 7.0]


def test_capture_does_not_advance_the_generator_and_replays_draw_anew() -> None:
    torch.manual_seed(0)
    expected = torch.randn(3)
    torch.manual_seed(0)
    g, noise = _capture(lambda: torch.randn(3))
    assert torch.equal(torch.randn(3), expected)
    assert isinstance(noise, torch.Tensor)
    g.replay()
    first = noise.clone()
    g.replay()
    assert not torch.equal(first, noise)


def test_grad_accumulation_into_existing_grad_is_undone_and_replayed() -> None:
    w = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    x = torch.tensor([3.0, 4.0], dtype=torch.float64)
    (w * x).sum().backward()  # .grad allocated eagerly: [3, 4]
    g, _ = _capture(lambda: (w * x).sum().backward())
    assert w.grad is not None and w.grad.tolist() == [3.0, 4.0]
    g.replay()
    g.replay()
    assert w.grad.tolist() == [9.0, 12.0]


# ---------------------------------------------------------------- refused during capture


def _mask_assign_tensor() -> None:
    x = torch.zeros(3)
    x[x > -1] = torch.ones(3)


REFUSED: dict[str, Callable[[], object]] = {
    "item": lambda: torch.ones(2).sum().item(),
    "bool": lambda: bool(torch.ones(1)),
    "print": lambda: print(torch.ones(2)),
    "f-string": lambda: f"{torch.ones(2)}",
    "numpy": lambda: torch.ones(2).numpy(),
    "torch.equal": lambda: torch.equal(torch.ones(2), torch.ones(2)),
    "bool-mask index": lambda: torch.arange(3.0)[torch.arange(3.0) > 0],
    "masked_select": lambda: torch.masked_select(torch.ones(2), torch.ones(2) > 0),
    "nonzero": lambda: torch.ones(2).nonzero(),
    "where(cond)": lambda: torch.where(torch.ones(2) > 0),
    "unique": lambda: torch.unique(torch.ones(2)),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "mask assign tensor": _mask_assign_tensor,
    "torch.cuda.synchronize": lambda: torch.cuda.synchronize(),
    "Stream.synchronize": lambda: torch.cuda.current_stream().synchronize(),
    "Event.synchronize": lambda: torch.cuda.current_stream().record_event().synchronize(),
    "Event.query": lambda: torch.cuda.current_stream().record_event().query(),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_capture_refuses_what_a_gpu_capture_refuses(name: str) -> None:
    g = torch.cuda.CUDAGraph()
    with pytest.raises(
        CUDA_ERROR, match="operation failed due to a previous error during capture"
    ) as failed:
        with torch.cuda.graph(g):
            REFUSED[name]()
    refused = failed.value.__context__
    assert isinstance(refused, CUDA_ERROR)
    assert "operation not permitted when stream is capturing" in str(refused)
    assert not torch.cuda.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()


# Refused by torch's own check before CUDA sees the copy (as on an H200 with
# torch 2.11): a plain RuntimeError, and the capture stays valid.
REFUSED_BY_TORCH: dict[str, Callable[[], object]] = {
    "tolist": lambda: torch.ones(2).tolist(),
    "cpu": lambda: torch.ones(2).cpu(),
    "bincount": lambda: torch.bincount(torch.tensor([1, 2])),
}


@pytest.mark.parametrize("name", list(REFUSED_BY_TORCH))
def test_a_device_to_host_copy_is_refused_by_torch_s_check(name: str) -> None:
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="unless the CPU tensor is pinned") as failed:
        with torch.cuda.graph(g):
            REFUSED_BY_TORCH[name]()
    assert type(failed.value) is RuntimeError
    assert not torch.cuda.is_current_stream_capturing()
    g.replay()  # what was captured before the refusal


def test_a_refusal_caught_inside_the_capture_still_fails_it() -> None:
    g = torch.cuda.CUDAGraph()
    with pytest.raises(CUDA_ERROR, match="previous error during capture.*_local_scalar_dense"):
        with torch.cuda.graph(g):
            try:
                torch.ones(1).item()
            except RuntimeError:
                pass


def test_what_a_gpu_capture_allows_still_captures() -> None:
    x = torch.tensor([1.0, -2.0, 3.0])

    def body() -> tuple[torch.Tensor, ...]:
        y = x.clone()
        y[y < 0] = 0.0  # torch turns this into masked_fill_
        z = torch.where(x > 0, x, torch.zeros_like(x))
        r = torch.repeat_interleave(x, torch.tensor([1, 1, 2]), output_size=4)
        return y, z, r, x.to(x.device)

    g, (y, z, r, _) = _capture(body)
    x.copy_(torch.tensor([-1.0, 2.0, -3.0]))
    g.replay()
    assert y.tolist() == [0.0, 2.0, 0.0]
    assert z.tolist() == [0.0, 2.0, 0.0]
    assert r.tolist() == [-1.0, 2.0, -3.0, -3.0]


def test_a_side_stream_joins_the_capture_and_must_be_joined_back() -> None:
    x = torch.ones(2)
    side = torch.cuda.Stream()

    def forked(join: bool) -> torch.Tensor:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        if join:
            torch.cuda.current_stream().wait_stream(side)
        return y

    g, y = _capture(lambda: forked(join=True))
    x.fill_(5.0)
    g.replay()
    assert isinstance(y, torch.Tensor) and y.tolist() == [10.0, 10.0]

    with pytest.raises(CUDA_ERROR, match="fork that was not joined to the primary stream"):
        _capture(lambda: forked(join=False))


def test_a_side_stream_joined_through_events() -> None:
    x = torch.ones(2)
    side = torch.cuda.Stream()

    def body() -> torch.Tensor:
        forked = torch.cuda.Event()
        forked.record()
        side.wait_event(forked)
        with torch.cuda.stream(side):
            y = x + 1
        done = side.record_event()
        done.wait()  # on the current (capture) stream
        return y

    g, y = _capture(body)
    x.fill_(2.0)
    g.replay()
    assert isinstance(y, torch.Tensor) and y.tolist() == [3.0, 3.0]


def test_work_on_a_stream_outside_the_capture_runs_eagerly_and_is_not_replayed() -> None:
    # As on a GPU: a stream that never waited on the capture stream is not
    # part of the capture; its work happens once, now, and replays skip it.
    x, out = torch.ones(2), torch.zeros(2)

    def body() -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            out.copy_(x * 3)

    g, _ = _capture(body)
    assert out.tolist() == [3.0, 3.0]  # ran for real, not undone
    x.fill_(7.0)
    g.replay()
    assert out.tolist() == [3.0, 3.0]
    assert g.num_recorded_ops == 0


def test_capture_checks_of_torch_cudagraph() -> None:
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()
    with torch.cuda.graph(g):
        torch.ones(1) + 1
    with pytest.raises(RuntimeError, match="already owns a captured graph"):
        with torch.cuda.graph(g):
            pass
    g.reset()
    with torch.cuda.graph(g):
        pass
    with torch.cuda.stream(torch.cuda.Stream()):
        h = torch.cuda.CUDAGraph()
        h.capture_begin()
        with torch.cuda.stream(torch.cuda.Stream()):
            with pytest.raises(RuntimeError, match="same stream it began on"):
                h.capture_end()
        h.capture_end()


# ---------------------------------------------------------------- replay keeps the captured shapes


def test_replay_refuses_a_static_input_resized_since_capture() -> None:
    x = torch.ones(3)
    g, out = _capture(lambda: x * 2)
    x.resize_(1)  # a GPU graph keeps reading 3 elements at the old address
    with pytest.raises(RuntimeError, match=r"changed from shape \[3\].*to shape \[1\]"):
        g.replay()


def test_replay_refuses_a_tensor_moved_to_other_memory() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    g, _ = _capture(lambda: w.detach() * 2)
    w.data = torch.zeros(3)  # the graph would keep reading the old memory
    with pytest.raises(RuntimeError, match="moved to other memory"):
        g.replay()


def test_in_place_metadata_ops_replay_with_the_captured_shapes() -> None:
    x = torch.tensor([1.0, 2.0, 3.0])

    def body() -> torch.Tensor:
        y = x * 2
        y.unsqueeze_(0)
        return y + 1

    g, out = _capture(body)
    assert isinstance(out, torch.Tensor)
    for scale in (1.0, 10.0):
        x.copy_(torch.tensor([1.0, 2.0, 3.0]) * scale)
        g.replay()
        assert out.shape == (1, 3)
        assert out.tolist() == [[2 * scale + 1, 4 * scale + 1, 6 * scale + 1]]


# ---------------------------------------------------------------- torch's own make_graphed_callables


@pytest.mark.parametrize("microbatches", [1, 3])
def test_upstream_make_graphed_callables_matches_eager_fp64(microbatches: int) -> None:
    # Upstream's function (2.15: Graphed.forward takes a leading graphs
    # tuple), with .grad kept allocated so its static-buffer hazard (H3) is
    # out of play: outputs and accumulated gradients equal plain autograd.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()
    graphed_module = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()
    graphed_module.load_state_dict(eager.state_dict())
    before = {k: v.clone() for k, v in graphed_module.state_dict().items()}
    sample = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    sample_before = sample.detach().clone()
    graphed = torch.cuda.graphs.make_graphed_callables(graphed_module, (sample,))
    for k, v in graphed_module.state_dict().items():
        assert torch.equal(v, before[k])  # warm-up and capture change no parameter
    assert torch.equal(sample.detach(), sample_before)
    for module in (eager, graphed):
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(microbatches)]
    for x in xs:
        want = eager(x)
        got = graphed(x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        (want**2).sum().backward()
        (got**2).sum().backward()
    for p_eager, p_graphed in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(p_graphed.grad, p_eager.grad, rtol=0, atol=1e-12)


def test_upstream_make_graphed_callables_refuses_a_host_read_in_the_callable() -> None:
    def reads_host(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # bool(tensor): a host read
            return x * 2
        return x

    with pytest.raises(CUDA_ERROR, match="previous error during capture"):
        torch.cuda.graphs.make_graphed_callables(reads_host, (torch.ones(2, requires_grad=True),))


def test_a_graph_reset_during_another_capture_invalidates_it() -> None:
    done = torch.cuda.CUDAGraph()
    with torch.cuda.graph(done):
        torch.ones(1) + 1
    g = torch.cuda.CUDAGraph()
    with pytest.raises(CUDA_ERROR, match="previous error during capture.*was reset"):
        with torch.cuda.graph(g):
            done.reset()  # what freeing it does: destroys the executable graph
