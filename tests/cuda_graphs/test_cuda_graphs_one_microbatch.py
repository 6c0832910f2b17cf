"""A graphed callable holds one microbatch at a time: every use that would read a later call's state raises.

Each order runs on gradsafe's ``make_graphed_callables`` (emulated CUDA graphs,
fp64) and on the same model without graphs; legal orders must equal the eager
gradients, illegal ones must raise (upstream gives silently wrong gradients,
pinned here too). A real GPU runs the same bodies in the ``cuda`` mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gradsafe.cuda_graphs import make_graphed_callables

F64 = torch.float64
STALE_CALL = "was called again since"
STALE_OUTPUT = "modified by an inplace operation"


@dataclasses.dataclass(frozen=True)
class Env:
    device: torch.device

    def randn(self, *shape: int, **kw: Any) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=F64, **kw)


@pytest.fixture
def env(graph_device: torch.device) -> Env:
    return Env(graph_device)


class Model(torch.nn.Module):
    """``head(body(x))``: ``body`` is what gets graphed; ``head`` is eager and saves body's output."""

    def __init__(self, env: Env) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)
        ).to(env.device, F64)
        self.head = torch.nn.Parameter(env.randn(4, 3))


Body = Callable[[torch.Tensor], torch.Tensor]


def _graphed(env: Env, model: Model, mgc: Callable[..., Any] = make_graphed_callables) -> Body:
    return mgc(model.body, (env.randn(2, 4, requires_grad=True),))  # type: ignore[no-any-return]


def _run(
    env: Env,
    order: str,
    wrap: Callable[[Model, Body], Callable[[torch.Tensor], torch.Tensor]],
    graph: Callable[[Env, Model], Body] | None,
    allocated: bool = False,
) -> list[torch.Tensor]:
    """Gradients (parameters, then each microbatch's input) after running ``order``.

    ``order`` is a string like ``"F0 F1 B0 B1"``; ``wrap(model, body)`` builds
    the step's loss function from ``body`` (graphed or not). ``allocated``:
    every ``.grad`` starts as zeros, so upstream's aliasing of ``.grad`` (H3)
    plays no part.
    """
    torch.manual_seed(1)
    model = Model(env)
    xs = [env.randn(2, 4, requires_grad=True) for _ in range(2)]
    for t in [*model.parameters(), *xs] if allocated else []:
        t.grad = torch.zeros_like(t)
    step = wrap(model, model.body if graph is None else graph(env, model))
    losses: dict[int, torch.Tensor] = {}
    for action in order.split():
        mb = int(action[1:])
        if action[0] == "F":
            losses[mb] = step(xs[mb])
        else:
            losses.pop(mb).backward()
    return [p.grad for p in model.parameters()] + [x.grad for x in xs]  # type: ignore[misc]


def _plain(model: Model, body: Body) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: (body(x) @ model.head).pow(2).sum()


def _body_only(model: Model, body: Body) -> Callable[[torch.Tensor], torch.Tensor]:
    # The head reads a clone: no saved graphed output, only the callable's own state.
    return lambda x: (body(x).clone() @ model.head).pow(2).sum()


def _assert_exact(env: Env, order: str, wrap: Any, allocated: bool = False) -> None:
    expected = _run(env, order, wrap, None, allocated)
    got = _run(env, order, wrap, _graphed, allocated)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("allocated", [False, True], ids=["grad-None", "grad-allocated"])
@pytest.mark.parametrize("wrap", [_plain, _body_only], ids=["head-saves-output", "head-clones"])
def test_each_backward_before_the_next_call_is_exact(env: Env, wrap: Any, allocated: bool) -> None:
    _assert_exact(env, "F0 B0 F1 B1", wrap, allocated)


def test_an_eager_consumer_of_an_earlier_calls_output_raises_torchs_inplace_error(env: Env) -> None:
    # F0 F1 B0: the head saved h0, which call 1's replay rewrote in place.
    with pytest.raises(RuntimeError, match=STALE_OUTPUT):
        _run(env, "F0 F1 B0 B1", _plain, _graphed)


def test_upstream_gives_the_interleaved_order_silently_wrong_gradients(env: Env) -> None:
    expected = _run(env, "F0 F1 B0 B1", _body_only, None, allocated=True)

    def upstream(env: Env, model: Model) -> Body:
        return _graphed(env, model, torch.cuda.graphs.make_graphed_callables)

    got = _run(env, "F0 F1 B0 B1", _body_only, upstream, allocated=True)
    assert max((g - e).abs().max().item() for g, e in zip(got, expected)) > 1e-3


@pytest.mark.parametrize("order", ["F0 F1 B0 B1", "F0 F1 B1 B0"])
def test_a_backward_after_a_later_call_raises_naming_the_cause(env: Env, order: str) -> None:
    # The head reads a clone, so only the graphed backward can tell. B1 first is
    # legal for call 1 (its buffers), then B0 is not.
    with pytest.raises(RuntimeError, match=STALE_CALL) as raised:
        _run(env, order, _body_only, _graphed)
    message = str(raised.value)
    assert "make_graphed_split_callables" in message and "checkpoint" in message


def test_a_call_under_no_grad_between_forward_and_backward_raises(env: Env) -> None:
    # An evaluation call replays the same graph (same training flag): it
    # rewrites the activations the pending backward reads.
    torch.manual_seed(1)
    model = Model(env)
    body = _graphed(env, model)
    loss = (body(env.randn(2, 4, requires_grad=True)).clone() @ model.head).pow(2).sum()
    with torch.no_grad():
        body(env.randn(2, 4))
    with pytest.raises(RuntimeError, match=STALE_CALL):
        loss.backward()


def test_a_second_backward_through_one_call_is_refused(env: Env) -> None:
    # retain_graph, no call in between. On a GPU (H200, torch 2.11) the second
    # replay of the backward graph read activations its first replay had
    # overwritten: 0.024 max abs error, every element wrong.
    torch.manual_seed(1)
    model = Model(env)
    x = env.randn(2, 4, requires_grad=True)
    ref = x.detach().requires_grad_()
    (model.body(ref) @ model.head).pow(2).sum().backward()  # eager: graphing replaces forward
    body = _graphed(env, model)
    loss = (body(x) @ model.head).pow(2).sum()
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    torch.testing.assert_close(first, ref.grad)
    with pytest.raises(RuntimeError, match="a second backward through one call"):
        torch.autograd.grad(loss, x)
    # A new call may be differentiated again.
    loss = (body(x) @ model.head).pow(2).sum()
    torch.testing.assert_close(torch.autograd.grad(loss, x)[0], ref.grad)


def _checkpointed_body(use_reentrant: bool) -> Any:
    def wrap(model: Model, body: Body) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(body, x, use_reentrant=use_reentrant)
            return (h.clone() @ model.head).pow(2).sum()

        return step

    return wrap


def _checkpointed_body_and_head(use_reentrant: bool) -> Any:
    # The head's saved input is recomputed too, so recomputation always runs.
    def wrap(model: Model, body: Body) -> Callable[[torch.Tensor], torch.Tensor]:
        def region(x: torch.Tensor) -> torch.Tensor:
            return (body(x).tanh() @ model.head).pow(2)

        return lambda x: checkpoint(region, x, use_reentrant=use_reentrant).sum()

    return wrap


@pytest.mark.parametrize("order", ["F0 B0 F1 B1", "F0 F1 B0 B1", "F0 F1 B1 B0"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize(
    "region", [_checkpointed_body, _checkpointed_body_and_head], ids=["body", "body-and-head"]
)
def test_checkpoint_around_a_graphed_callable_recomputes_it_exactly(
    env: Env, order: str, use_reentrant: bool, region: Any
) -> None:
    # Recomputation replays the call with its own inputs before its backward,
    # so even calls whose backwards interleave are exact: not refused.
    _assert_exact(env, order, region(use_reentrant))


def test_checkpoint_does_not_cover_an_eager_consumer_outside_it(env: Env) -> None:
    # The head outside the region saved h0; call 1 rewrote it.
    def wrap(model: Model, body: Body) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: (checkpoint(body, x, use_reentrant=False) @ model.head).pow(2).sum()

    _assert_exact(env, "F0 B0 F1 B1", wrap)
    with pytest.raises(RuntimeError, match=STALE_OUTPUT):
        _run(env, "F0 F1 B0 B1", wrap, _graphed)


def test_ownership_never_is_upstream_and_does_not_check(env: Env) -> None:
    expected = _run(env, "F0 F1 B0 B1", _body_only, None, allocated=True)

    def never(env: Env, model: Model) -> Body:
        return _graphed(env, model, lambda *a: make_graphed_callables(*a, ownership="never"))

    got = _run(env, "F0 F1 B0 B1", _body_only, never, allocated=True)
    assert max((g - e).abs().max().item() for g, e in zip(got, expected)) > 1e-3


def test_each_call_bumps_the_version_counter_of_earlier_outputs(env: Env) -> None:
    torch.manual_seed(1)
    model = Model(env)
    body = _graphed(env, model)
    x = env.randn(2, 4, requires_grad=True)
    h = body(x)
    version = h._version
    view = h[0]
    body(x)
    assert h._version == view._version == version + 1


def test_one_callable_called_twice_in_one_forward_raises(env: Env) -> None:
    # A shared layer graphed once and applied twice: the second call rewrites
    # the activations the first call's backward reads.
    torch.manual_seed(1)
    model = Model(env)
    body = _graphed(env, model)
    with pytest.raises(RuntimeError, match=STALE_CALL):
        body(body(env.randn(2, 4, requires_grad=True))).sum().backward()


def test_a_call_under_inference_mode_returns_normal_outputs_and_later_calls_stay_exact(
    env: Env,
) -> None:
    torch.manual_seed(1)
    model = Model(env)
    body = _graphed(env, model)
    with torch.inference_mode():
        out = body(env.randn(2, 4))
    assert not out.is_inference()
    x = env.randn(2, 4, requires_grad=True)
    (body(x) @ model.head).pow(2).sum().backward()
    ref = x.detach().requires_grad_()
    (model.body(ref) @ model.head).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def _offloaded(model: Model, body: Body) -> Callable[[torch.Tensor], torch.Tensor]:
    # Saved tensors go through hooks (copies on the CPU): no version check at unpack.
    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            return (body(x) @ model.head).pow(2).sum()

    return step


def test_saved_tensor_hooks_keep_the_usual_order_exact_and_the_callable_checked(env: Env) -> None:
    _assert_exact(env, "F0 B0 F1 B1", _offloaded)
    with pytest.raises(RuntimeError, match=STALE_CALL):
        _run(env, "F0 F1 B0 B1", _offloaded, _graphed)


def _tanh_body(env: Env) -> torch.nn.Module:
    # Tanh saves its output, so the graphed backward reads the static output buffer.
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to(env.device, F64)


def test_an_output_modified_in_place_before_its_backward_is_refused(env: Env) -> None:
    body = _tanh_body(env)
    graphed = make_graphed_callables(body, (env.randn(2, 4, requires_grad=True),))
    y = graphed(env.randn(2, 4, requires_grad=True))
    y.mul_(2)  # eager autograd refuses this at backward (Tanh saved y)
    with pytest.raises(RuntimeError, match="modified in place after the call"):
        y.sum().backward()


def test_an_output_modified_in_place_after_a_clone_stays_exact(env: Env) -> None:
    body = _tanh_body(env)
    x = env.randn(2, 4, requires_grad=True)
    (body(x).clone().mul_(2) ** 2).sum().backward()
    want = [p.grad.clone() for p in body.parameters()]
    body.zero_grad(set_to_none=True)
    graphed = make_graphed_callables(body, (env.randn(2, 4, requires_grad=True),))
    (graphed(x).clone().mul_(2) ** 2).sum().backward()
    for got, expected in zip(body.parameters(), want):
        torch.testing.assert_close(got.grad, expected, rtol=0, atol=1e-12)


def test_a_parameter_modified_in_place_before_its_backward_is_refused(env: Env) -> None:
    # The graphs read parameters in place; Linear saved its weight, so eager
    # autograd refuses this too. Silently differentiated the scaled weight
    # before (0.726 max abs error on the input's gradient, fp64).
    body = _tanh_body(env)
    graphed = make_graphed_callables(body, (env.randn(2, 4, requires_grad=True),))
    y = graphed(env.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        body[0].weight.mul_(2)  # an optimizer step between the call and its backward
    with pytest.raises(RuntimeError, match="input 1 of this graphed callable's graphs"):
        y.sum().backward()


def test_the_sample_tensor_refilled_before_its_calls_backward_is_refused(env: Env) -> None:
    # Passed again, the sample tensor is not copied: the backward graph reads it
    # in place (1.996 max abs error on the weight's gradient before, fp64).
    body = _tanh_body(env)
    static_x = env.randn(2, 4, requires_grad=True)
    graphed = make_graphed_callables(body, (static_x,))
    y = graphed(static_x)
    with torch.no_grad():
        static_x.copy_(env.randn(2, 4))  # the next microbatch, before this one's backward
    with pytest.raises(RuntimeError, match="input 0 of this graphed callable's graphs"):
        y.sum().backward()


def test_the_sample_tensor_refilled_after_each_backward_stays_exact(env: Env) -> None:
    body = _tanh_body(env)
    static_x = env.randn(2, 4, requires_grad=True)
    data = [env.randn(2, 4) for _ in range(3)]
    for x in data:
        body(x.requires_grad_()).pow(2).sum().backward()
    want = [p.grad.clone() for p in body.parameters()]
    body.zero_grad(set_to_none=True)
    graphed = make_graphed_callables(body, (static_x,))
    for x in data:
        with torch.no_grad():
            static_x.copy_(x)
        graphed(static_x).pow(2).sum().backward()
    for got, expected in zip(body.parameters(), want):
        torch.testing.assert_close(got.grad, expected, rtol=0, atol=1e-12)


class _ReturnsWeight(torch.nn.Module):
    """Returns its weight beside its output (for a tied use outside the graphed callable)."""

    def __init__(self, env: Env) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4).to(env.device, F64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), self.lin.weight


def test_an_output_that_is_a_parameter_keeps_its_version_and_an_earlier_eager_use_exact(
    env: Env,
) -> None:
    # The replay does not rewrite a parameter, so the call must not bump its
    # version: an eager use of the weight saved before the call raised torch's
    # "modified by an inplace operation" at backward, with nothing modified.
    module = _ReturnsWeight(env)
    x, h = env.randn(2, 4, requires_grad=True), env.randn(2, 4, requires_grad=True)

    def loss(fn: Any) -> torch.Tensor:
        tied = h @ module.lin.weight  # saves the weight (h requires grad)
        y, w = fn(x)
        return (tied.pow(2) + y).sum() + w.pow(2).sum()

    loss(module).backward()
    leaves = [*module.parameters(), x, h]
    want = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    graphed = make_graphed_callables(module, (env.randn(2, 4, requires_grad=True),))
    loss(graphed).backward()
    for got, expected in zip(leaves, want):
        torch.testing.assert_close(got.grad, expected, rtol=0, atol=1e-12)
