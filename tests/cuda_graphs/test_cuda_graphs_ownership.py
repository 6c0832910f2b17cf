"""gradsafe.cuda_graphs.make_graphed_callables vs upstream's, under CUDA-graph emulation and on a real GPU.

Every test body runs twice through the ``env`` fixture: ``emulated`` (CPU,
``gradsafe.testing.emulate_cuda_graphs``) and ``cuda`` (a real GPU, skipped
without one).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _delayed_matmul import DelayedMatmul

import gradsafe
from gradsafe.cuda_graphs import UnsupportedTorchError, make_graphed_callables
from gradsafe.cuda_graphs._hazards import (
    ALIASED,
    EXPECTED,
    SEED_X1,
    SEED_X2,
    CopyCounter,
    ScaleByWeight,
    seed_grads,
)
from gradsafe.testing import emulate_cuda_graphs
from gradsafe.wgrad import WeightGradStore
from gradsafe.wgrad.markers import mark_delayed_wgrad


@dataclasses.dataclass(frozen=True)
class Env:
    device: torch.device

    def tensor(self, data: Any, **kw: Any) -> torch.Tensor:
        return torch.tensor(data, device=self.device, **kw)

    def randn(self, *shape: int, **kw: Any) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, **kw)


@pytest.fixture
def env(graph_device: torch.device) -> Env:
    return Env(graph_device)


def upstream_mgc(*args: Any, **kwargs: Any) -> Any:
    return torch.cuda.graphs.make_graphed_callables(*args, **kwargs)


def gradsafe_mgc(*args: Any, **kwargs: Any) -> Any:
    return make_graphed_callables(*args, **kwargs)


def _always(*args: Any, **kwargs: Any) -> Any:
    return make_graphed_callables(*args, ownership="always", **kwargs)


SAFE = [pytest.param(gradsafe_mgc, id="auto"), pytest.param(_always, id="always")]


def mlp(env: Env, width: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width)
    ).to(env.device)


def grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def assert_close_lists(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


# --- the seed report ------------------------------------------------------------------------


def _seed(env: Env, mgc: Callable[..., Any]) -> list[float]:
    return seed_grads(mgc, env.device)


def test_seed_repro_upstream_aliases(env: Env) -> None:
    assert _seed(env, upstream_mgc) == ALIASED


@pytest.mark.parametrize("mgc", SAFE)
def test_seed_repro_gradsafe_accumulates(env: Env, mgc: Callable[..., Any]) -> None:
    assert _seed(env, mgc) == EXPECTED


# --- leaf inputs ----------------------------------------------------------------------------


def _leaf_input(env: Env, mgc: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
    w = env.tensor([1.0, 2, 3, 4])
    graphed = mgc(lambda x: x * w, (torch.ones(4, device=env.device, requires_grad=True),))
    x = torch.ones(4, device=env.device, requires_grad=True)
    (graphed(x) * 1).sum().backward()  # grad w, stolen as x.grad upstream
    (graphed(x) * 3).sum().backward()  # grad 3w
    return x.grad, w


def test_leaf_input_upstream_aliases(env: Env) -> None:
    got, w = _leaf_input(env, upstream_mgc)
    torch.testing.assert_close(got, 6 * w)


@pytest.mark.parametrize("mgc", SAFE)
def test_leaf_input_gradsafe_accumulates(env: Env, mgc: Callable[..., Any]) -> None:
    got, w = _leaf_input(env, mgc)
    torch.testing.assert_close(got, 4 * w)


def test_leaf_input_through_pass_through_node(env: Env) -> None:
    # x + 0 is a non-leaf whose AddBackward passes the gradient through
    # unchanged into x's AccumulateGrad: a non-leaf slot can end up as .grad.
    w = env.tensor([1.0, 2, 3, 4])
    results = {}
    for name, mgc in (("upstream", upstream_mgc), ("gradsafe", gradsafe_mgc)):
        graphed = mgc(lambda x: x * w, (torch.ones(4, device=env.device, requires_grad=True),))
        x = torch.ones(4, device=env.device, requires_grad=True)
        (graphed(x + 0) * 1).sum().backward()
        (graphed(x + 0) * 3).sum().backward()
        results[name] = x.grad
    torch.testing.assert_close(results["upstream"], 6 * w)
    torch.testing.assert_close(results["gradsafe"], 4 * w)


# --- hooks ----------------------------------------------------------------------------------


def _hook_keeps(env: Env, mgc: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
    model = ScaleByWeight(env.device)
    graphed = mgc(model, (torch.ones(2, 4, device=env.device),))
    model.weight.grad = torch.zeros_like(model.weight)  # in-place accumulation path
    kept: list[torch.Tensor] = []
    model.weight.register_hook(lambda g: kept.append(g))
    x1 = env.tensor(SEED_X1)
    graphed(x1).sum().backward()
    graphed(env.tensor(SEED_X2)).sum().backward()
    return kept[0], x1.sum(0)


def test_param_hook_keeps_view_upstream(env: Env) -> None:
    kept, g1 = _hook_keeps(env, upstream_mgc)
    assert kept.tolist() == [11.0, 22.0, 33.0, 44.0]  # microbatch 2's values
    assert not torch.equal(kept, g1)


@pytest.mark.parametrize("mgc", SAFE)
def test_param_hook_keeps_owned_gradsafe(env: Env, mgc: Callable[..., Any]) -> None:
    kept, g1 = _hook_keeps(env, mgc)
    torch.testing.assert_close(kept, g1)


@pytest.mark.parametrize("mgc", [pytest.param(upstream_mgc, id="upstream"), *SAFE])
def test_nonleaf_input_hook(env: Env, mgc: Callable[..., Any]) -> None:
    w = env.tensor([1.0, 2, 3, 4])
    graphed = mgc(lambda x: x * w, (torch.ones(4, device=env.device, requires_grad=True),))
    x = torch.ones(4, device=env.device, requires_grad=True)
    kept: list[torch.Tensor] = []
    h = x * 2
    h.register_hook(lambda g: kept.append(g))
    (graphed(h) * 1).sum().backward()
    (graphed(x * 2) * 3).sum().backward()
    if mgc is upstream_mgc:
        torch.testing.assert_close(kept[0], 3 * w)  # overwritten by the second replay
    else:
        torch.testing.assert_close(kept[0], w)


# --- autograd.grad --------------------------------------------------------------------------


@pytest.mark.parametrize("mgc", [pytest.param(upstream_mgc, id="upstream"), *SAFE])
def test_autograd_grad_returns_owned(env: Env, mgc: Callable[..., Any]) -> None:
    model = ScaleByWeight(env.device)
    graphed = mgc(model, (torch.ones(2, 4, device=env.device),))
    model.weight.grad = torch.zeros_like(model.weight)
    x1 = env.tensor(SEED_X1)
    (g1,) = torch.autograd.grad(graphed(x1).sum(), [model.weight])
    (g2,) = torch.autograd.grad(graphed(env.tensor(SEED_X2)).sum(), [model.weight])
    assert g2.tolist() == [11.0, 22.0, 33.0, 44.0]
    if mgc is upstream_mgc:
        assert g1.tolist() == g2.tolist()
    else:
        torch.testing.assert_close(g1, x1.sum(0))
    assert model.weight.grad.abs().sum().item() == 0  # autograd.grad never accumulates


# --- several callables, chains, shared pool -------------------------------------------------


def _two_layer_reference(
    env: Env, mgc: Callable[..., Any] | None, microbatches: int, hook_on_h: bool = False
) -> list[torch.Tensor]:
    torch.manual_seed(1)
    a, b = mlp(env), mlp(env)
    xs = [env.randn(3, 8) for _ in range(microbatches)]
    if mgc is not None:
        sample = env.randn(3, 8)
        a, b = mgc((a, b), ((sample,), (env.randn(3, 8, requires_grad=True),)))
    kept: list[torch.Tensor] = []
    for x in xs:
        h = a(x)
        if hook_on_h:
            h.register_hook(lambda g: kept.append(g))
        b(h).pow(2).sum().backward()
    out = grads(a) + grads(b)
    if hook_on_h:
        out += kept
    return out


@pytest.mark.parametrize("mgc", SAFE)
def test_chained_callables_share_pool(env: Env, mgc: Callable[..., Any]) -> None:
    want = _two_layer_reference(env, None, 4)
    assert_close_lists(_two_layer_reference(env, mgc, 4), want)
    assert not all(
        torch.allclose(x, y) for x, y in zip(_two_layer_reference(env, upstream_mgc, 4), want)
    )


def test_chained_link_not_copied_under_auto(env: Env) -> None:
    # b's input slot comes from gradsafe-graphed a: a's backward copies it at
    # once, so "auto" copies only the parameters (once: their .grad is None).
    torch.manual_seed(1)
    a, b = mlp(env), mlp(env)
    n_params = len(list(a.parameters())) + len(list(b.parameters()))
    a, b = make_graphed_callables(
        (a, b), ((env.randn(3, 8),), (env.randn(3, 8, requires_grad=True),))
    )
    with CopyCounter() as counter:
        for _ in range(3):
            b(a(env.randn(3, 8))).sum().backward()
    assert counter.clones == n_params


@pytest.mark.parametrize("mgc", SAFE)
def test_chained_link_with_hook_is_copied(env: Env, mgc: Callable[..., Any]) -> None:
    want = _two_layer_reference(env, None, 3, hook_on_h=True)
    assert_close_lists(_two_layer_reference(env, mgc, 3, hook_on_h=True), want)


def test_explicit_shared_pool_across_calls(env: Env) -> None:
    torch.manual_seed(2)
    a, b = mlp(env), mlp(env)
    ref_a, ref_b = mlp(env), mlp(env)
    ref_a.load_state_dict(a.state_dict())
    ref_b.load_state_dict(b.state_dict())
    pool = torch.cuda.graph_pool_handle()
    ga = make_graphed_callables(a, (env.randn(3, 8),), pool=pool)
    gb = make_graphed_callables(b, (env.randn(3, 8),), pool=pool)
    # Replayed in capture order (a fwd, a bwd, b fwd, b bwd): the order under
    # which separately captured graphs may share a pool.
    for _ in range(3):
        x = env.randn(3, 8)
        ga(x).sum().backward()
        gb(x).pow(2).sum().backward()
        ref_a(x).sum().backward()
        ref_b(x).pow(2).sum().backward()
    assert_close_lists(grads(a) + grads(b), grads(ref_a) + grads(ref_b))


# --- pytree outputs, eval fallback, requires_grad=False, allow_unused_input -----------------


@pytest.mark.parametrize("mgc", SAFE)
def test_pytree_outputs(env: Env, mgc: Callable[..., Any]) -> None:
    torch.manual_seed(3)
    lin = torch.nn.Linear(4, 4).to(env.device)
    ref = torch.nn.Linear(4, 4).to(env.device)
    ref.load_state_dict(lin.state_dict())

    class Two(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            y = self.inner(x)
            return {"y": y, "pair": (y.tanh(), y * 2)}

    graphed, eager = mgc(Two(lin), (env.randn(2, 4),)), Two(ref)
    for _ in range(3):
        x = env.randn(2, 4)
        for model in (graphed, eager):
            out = model(x)
            (out["y"].sum() + out["pair"][0].pow(2).sum() + out["pair"][1].mean()).backward()
    assert_close_lists(grads(lin), grads(ref))


@pytest.mark.parametrize("mgc", SAFE)
def test_eval_falls_back_to_eager_forward(env: Env, mgc: Callable[..., Any]) -> None:
    torch.manual_seed(4)
    model = mlp(env)
    ref = mlp(env)
    ref.load_state_dict(model.state_dict())
    graphed = mgc(model, (env.randn(3, 8),))
    x = env.randn(3, 8)
    static = graphed(x)
    graphed.eval()
    ref.eval()
    eager_out = graphed(x)
    # The eval call ran the original forward: a fresh tensor, not the static output.
    assert eager_out.data_ptr() != static.data_ptr()
    torch.testing.assert_close(eager_out, ref(x))
    eager_out.sum().backward()
    ref(x).sum().backward()
    graphed.train()
    ref.train()
    graphed(x).sum().backward()
    ref(x).sum().backward()
    assert_close_lists(grads(model), grads(ref))


@pytest.mark.parametrize("mgc", SAFE)
def test_requires_grad_false_input(env: Env, mgc: Callable[..., Any]) -> None:
    w = env.tensor([1.0, 2, 3, 4])

    def fn(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x * w * mask

    sample = (
        torch.ones(4, device=env.device, requires_grad=True),
        torch.ones(4, device=env.device),
    )
    graphed = mgc(fn, sample)
    x = torch.ones(4, device=env.device, requires_grad=True)
    mask = env.tensor([1.0, 0, 1, 0])
    graphed(x, mask).sum().backward()
    graphed(x, mask * 2).sum().backward()
    torch.testing.assert_close(x.grad, w * 3 * env.tensor([1.0, 0, 1, 0]))
    assert mask.grad is None


@pytest.mark.parametrize("mgc", SAFE)
def test_allow_unused_input(env: Env, mgc: Callable[..., Any]) -> None:
    model = ScaleByWeight(env.device)

    class Unused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    sample = (
        torch.ones(2, 4, device=env.device),
        torch.ones(4, device=env.device, requires_grad=True),
    )
    graphed = mgc(Unused(), sample, allow_unused_input=True)
    unused = torch.ones(4, device=env.device, requires_grad=True)
    graphed(env.tensor(SEED_X1), unused).sum().backward()
    graphed(env.tensor(SEED_X2), unused).sum().backward()
    assert model.weight.grad.tolist() == [14.0, 27.0, 40.0, 53.0]
    assert unused.grad is None


# --- delayed wgrad --------------------------------------------------------------------------


def _tied_delayed_grad(
    env: Env, graph: Callable[..., Any] | None, microbatches: int, w_lag: int, fused: bool = False
) -> torch.Tensor:
    """A tied embedding/head in fp64: W used unfused inside the callable, and by a delayed head.

    ``graph`` graphs the embedding (None: eager). W of microbatch ``k`` runs
    after B of microbatch ``k + w_lag``; the rest after the last B. Returns
    the weight's whole gradient (``.grad``, plus ``main_grad`` when fused).
    """
    torch.manual_seed(3)
    embed = torch.nn.Linear(6, 4, bias=False, device=env.device, dtype=torch.float64)
    if fused:
        embed.weight.main_grad = torch.zeros_like(embed.weight)  # type: ignore[attr-defined]
    store = WeightGradStore()
    xs = [env.randn(3, 6, dtype=torch.float64) for _ in range(microbatches)]
    run = embed if graph is None else graph(embed, (env.randn(3, 6, dtype=torch.float64),))
    pending = []
    for x in xs:
        h = torch.tanh(run(x))
        DelayedMatmul.apply(h, embed.weight, store, fused).pow(2).sum().backward()
        pending.append(store.seal())
        if len(pending) > w_lag:
            pending.pop(0).run()
    for w_pass in pending:
        w_pass.run()
    assert embed.weight.grad is not None
    return embed.weight.grad + embed.weight.main_grad if fused else embed.weight.grad  # type: ignore[attr-defined]


def _ownership(mode: str) -> Callable[..., Any]:
    return lambda *a, **kw: make_graphed_callables(*a, ownership=mode, **kw)


@pytest.mark.parametrize("fused", [False, True], ids=["W-into-grad", "W-into-main_grad"])
@pytest.mark.parametrize("w_lag", [0, 1], ids=["W-after-its-B", "W-one-behind"])
@pytest.mark.parametrize("microbatches", [1, 2, 3])
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_tied_weight_with_delayed_wgrad_is_exact(
    env: Env, mode: str, microbatches: int, w_lag: int, fused: bool
) -> None:
    # store.record() marks the weight delayed; its slot in the graphed
    # backward still carries the embedding's real gradient and must be owned.
    expected = _tied_delayed_grad(env, None, microbatches, w_lag, fused)
    got = _tied_delayed_grad(env, _ownership(mode), microbatches, w_lag, fused)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("w_lag", [0, 1], ids=["W-after-its-B", "W-one-behind"])
@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_tied_weight_with_delayed_wgrad_never_is_upstream(
    env: Env, microbatches: int, w_lag: int
) -> None:
    # ownership="never" is upstream's aliasing, accepted knowingly: from the
    # second microbatch on, a replay rewrites the .grad W added into.
    expected = _tied_delayed_grad(env, None, microbatches, w_lag)
    never = _tied_delayed_grad(env, _ownership("never"), microbatches, w_lag)
    upstream = _tied_delayed_grad(env, upstream_mgc, microbatches, w_lag)
    torch.testing.assert_close(never, upstream)
    error = (never - expected).abs().max().item()
    assert (error < 1e-12) if microbatches == 1 else (error > 1e-3)


def _delayed_head_grad(env: Env, graphed: bool, *, clone: bool) -> torch.Tensor:
    """``h = body(x)``, a delayed head ``h @ W`` (unfused), W one microbatch behind, fp64."""
    torch.manual_seed(5)
    body = torch.nn.Linear(4, 4, device=env.device, dtype=torch.float64)
    head = torch.nn.Parameter(env.randn(4, 4, dtype=torch.float64))
    xs = [env.randn(2, 4, dtype=torch.float64) for _ in range(2)]
    run = body
    if graphed:
        run = make_graphed_callables(body, (env.randn(2, 4, dtype=torch.float64),))
    store = WeightGradStore()
    pending = []
    for x in xs:
        h = run(x).clone() if clone else run(x)
        DelayedMatmul.apply(h, head, store, False).pow(2).sum().backward()
        pending.append(store.seal())
        if len(pending) > 1:
            try:
                pending.pop(0).run()
            except RuntimeError:
                assert head.grad is None  # refused before applying anything
                raise
    pending.pop().run()
    assert head.grad is not None
    return head.grad


def test_a_delayed_w_reading_a_graphed_output_after_the_next_call_is_refused(env: Env) -> None:
    # Outputs are static buffers (not owned, as upstream's; docs/cuda_graphs.md): the
    # next call rewrites h before W reads it (max abs error 3.9 when W ran). The
    # call bumps h's version and the kernel's reads= lets W see it; a clone is exact.
    expected = _delayed_head_grad(env, False, clone=False)
    with pytest.raises(RuntimeError, match="modified in place since B recorded it"):
        _delayed_head_grad(env, True, clone=False)
    torch.testing.assert_close(_delayed_head_grad(env, True, clone=True), expected)


class _DelayedHead(torch.nn.Module):
    def __init__(self, env: Env, store: WeightGradStore) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(env.randn(4, 4, dtype=torch.float64))
        self.store = store

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return DelayedMatmul.apply(h, self.weight, self.store, False)


@pytest.mark.parametrize("mgc", [*SAFE, pytest.param(upstream_mgc, id="upstream")])
def test_a_delayed_kernel_inside_a_graphed_callable_is_refused_at_the_next_seal(
    env: Env, mgc: Callable[..., Any]
) -> None:
    # The graph's replay runs no Python: the kernel recorded its weight gradient
    # at capture only, and every later W pass silently missed it (the first one
    # ran the warm-up's and the capture's 4 records instead).
    store = WeightGradStore()
    head = _DelayedHead(env, store)
    sample = (env.randn(3, 4, dtype=torch.float64, requires_grad=True),)
    graphed = mgc(head, sample, allow_unused_input=True)
    graphed(env.randn(3, 4, dtype=torch.float64, requires_grad=True)).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="recorded while a CUDA graph was captured"):
        store.seal()
    # The records were discarded: the store records an eager kernel as before (fp64).
    eager = _DelayedHead(env, store)
    h = env.randn(3, 4, dtype=torch.float64, requires_grad=True)
    eager(h).pow(2).sum().backward()
    store.seal().run()
    w = eager.weight.detach().requires_grad_()
    (h.detach() @ w).pow(2).sum().backward()
    torch.testing.assert_close(eager.weight.grad, w.grad)


def test_a_whole_step_graph_records_seals_and_runs_w_inside_one_capture(env: Env) -> None:
    # Capturing B and its W pass together replays both: main_grad gets every
    # replay's weight gradient (fused W), as eager fp64 autograd.
    store = WeightGradStore()
    w = torch.nn.Parameter(env.randn(4, 4, dtype=torch.float64))
    w.main_grad = torch.zeros_like(w)  # type: ignore[attr-defined]
    h = env.randn(3, 4, dtype=torch.float64)

    def step() -> None:
        DelayedMatmul.apply(h, w, store, True).pow(2).sum().backward()
        store.seal().run()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up, as torch asks before capturing a backward
    torch.cuda.current_stream().wait_stream(side)
    w.main_grad.zero_()  # type: ignore[attr-defined]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    xs = [env.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    for x in xs:
        h.copy_(x)
        graph.replay()
    ref = w.detach().clone().requires_grad_()
    for x in xs:
        (x @ ref).pow(2).sum().backward()
    torch.testing.assert_close(w.main_grad, ref.grad)  # type: ignore[attr-defined]


def test_a_w_pass_sealed_in_a_capture_and_run_after_it_is_refused(env: Env) -> None:
    store = WeightGradStore()
    w = torch.nn.Parameter(env.randn(4, 4, dtype=torch.float64))
    h = env.randn(3, 4, dtype=torch.float64)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        DelayedMatmul.apply(h, w, store, False).pow(2).sum().backward()
        pending = store.seal()
    with pytest.raises(RuntimeError, match="recorded while a CUDA graph was captured"):
        pending.run()
    assert w.grad is None


def _mark_gradsafe(p: torch.nn.Parameter) -> None:
    mark_delayed_wgrad(p)


def _mark_te(p: torch.nn.Parameter) -> None:
    p.skip_backward_post_hook = True  # type: ignore[attr-defined]


@pytest.mark.parametrize("mark", [_mark_gradsafe, _mark_te], ids=["gradsafe-marker", "te-attr"])
@pytest.mark.parametrize("mgc", SAFE)
def test_delayed_wgrad_mark_does_not_exempt_a_real_gradient(
    env: Env, mgc: Callable[..., Any], mark: Callable[[torch.nn.Parameter], None]
) -> None:
    # A mark says some use of the weight is delayed, not that this slot holds
    # a placeholder: a marked weight's returned gradient is owned like any other.
    marked, plain = ScaleByWeight(env.device), ScaleByWeight(env.device)
    mark(marked.weight)

    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.marked, self.plain = marked, plain

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.marked(x) + self.plain(x)

    graphed = mgc(Both(), (torch.ones(2, 4, device=env.device),))
    graphed(env.tensor(SEED_X1)).sum().backward()
    graphed(env.tensor(SEED_X2)).sum().backward()
    assert marked.weight.grad.tolist() == EXPECTED
    assert plain.weight.grad.tolist() == EXPECTED


# --- accumulation and optimizer steps -------------------------------------------------------


def _train(
    env: Env, mgc: Callable[..., Any] | None, steps: int, microbatches: int, set_to_none: bool
) -> list[torch.Tensor]:
    torch.manual_seed(5)
    model = mlp(env)
    data = [[env.randn(3, 8) for _ in range(microbatches)] for _ in range(steps)]
    run = model if mgc is None else mgc(model, (env.randn(3, 8),))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in data:
        opt.zero_grad(set_to_none=set_to_none)
        for x in batch:
            run(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("microbatches", [1, 5])
@pytest.mark.parametrize("mgc", SAFE)
def test_training_matches_eager(
    env: Env, mgc: Callable[..., Any], microbatches: int, set_to_none: bool
) -> None:
    want = _train(env, None, 3, microbatches, set_to_none)
    assert_close_lists(_train(env, mgc, 3, microbatches, set_to_none), want)


def test_upstream_training_with_accumulation_is_wrong(env: Env) -> None:
    want = _train(env, None, 2, 5, True)
    got = _train(env, upstream_mgc, 2, 5, True)
    assert not all(torch.allclose(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("microbatches", [4, 6])
def test_accumulation_over_many_microbatches(env: Env, microbatches: int) -> None:
    torch.manual_seed(6)
    model, ref = mlp(env), mlp(env)
    ref.load_state_dict(model.state_dict())
    graphed = make_graphed_callables(model, (env.randn(3, 8),))
    for _ in range(microbatches):
        x = env.randn(3, 8)
        graphed(x).sum().backward()
        ref(x).sum().backward()
    assert_close_lists(grads(model), grads(ref))


# --- ownership policies: what each one copies -----------------------------------------------


@pytest.mark.parametrize(
    ("ownership", "set_to_none", "expected_clones"),
    [
        ("auto", True, 4),  # first microbatch of each of 2 steps, 2 params
        ("auto", False, 2),  # .grad stays allocated after step 1
        ("always", True, 2 * 3 * 2),  # every microbatch
        ("never", True, 0),
    ],
)
def test_ownership_clone_counts(
    env: Env, ownership: str, set_to_none: bool, expected_clones: int
) -> None:
    model = torch.nn.Linear(8, 8).to(env.device)
    graphed = make_graphed_callables(model, (env.randn(3, 8),), ownership=ownership)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CopyCounter() as counter:
        for _ in range(2):
            opt.zero_grad(set_to_none=set_to_none)
            for _ in range(3):
                graphed(env.randn(3, 8)).sum().backward()
            opt.step()
    assert counter.clones == expected_clones


def test_invalid_ownership_rejected(env: Env) -> None:
    with pytest.raises(ValueError, match="ownership must be one of"):
        make_graphed_callables(
            ScaleByWeight(env.device), (torch.ones(2, 4),), ownership="sometimes"
        )


# --- patch and unsupported structures (no graphs needed beyond emulation) -------------------


def test_patch_installs_and_restores_both_names() -> None:
    before = (torch.cuda.make_graphed_callables, torch.cuda.graphs.make_graphed_callables)
    with gradsafe.patch("cuda_graphs"):
        assert torch.cuda.make_graphed_callables is make_graphed_callables
        assert torch.cuda.graphs.make_graphed_callables is make_graphed_callables
        assert gradsafe.get_original("torch.cuda.graphs", "make_graphed_callables") is before[1]
        assert gradsafe.status()["cuda_graphs"].active
    assert (torch.cuda.make_graphed_callables, torch.cuda.graphs.make_graphed_callables) == before


def test_patched_torch_name_is_safe(env: Env) -> None:
    with gradsafe.patch("cuda_graphs"):
        got = _seed(env, torch.cuda.make_graphed_callables)
    assert got == [14.0, 27.0, 40.0, 53.0]


def test_unrecognised_structure_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    def reshaped(callables: Any, sample_args: Any, *args: Any, **kwargs: Any) -> Any:
        return lambda *a: a  # no closure over a ``Graphed`` Function

    monkeypatch.setattr(torch.cuda.graphs, "make_graphed_callables", reshaped)
    with pytest.raises(UnsupportedTorchError, match=torch.__version__.replace("+", r"\+")):
        make_graphed_callables(lambda x: x, (torch.ones(1),))
    assert make_graphed_callables(lambda x: x, (torch.ones(1),), ownership="never")(1) == (1,)


def test_arguments_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, ...]] = []

    def recorder(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        return lambda *a: a

    monkeypatch.setattr(torch.cuda.graphs, "make_graphed_callables", recorder)
    make_graphed_callables(
        "c", "s", 7, True, pool="p", capture_error_mode="relaxed", ownership="never"
    )  # type: ignore[call-overload]
    # torch's parameters go by position (their defaults are torch's on every
    # supported release); newer ones as given.
    assert seen == [(("c", "s", 7, True, "p"), {"capture_error_mode": "relaxed"})]
    make_graphed_callables("c", "s", 3, False, None, "relaxed", ownership="never")  # type: ignore[call-overload]
    assert seen[1] == (("c", "s", 3, False, None, "relaxed"), {})


def test_no_availability_gate() -> None:
    # Works wherever upstream works: under emulation, with no GPU at all.
    with emulate_cuda_graphs() if not torch.cuda.is_available() else contextlib.nullcontext():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        graphed = make_graphed_callables(
            lambda x: x * 2, (torch.ones(2, device=device, requires_grad=True),)
        )
        x = torch.ones(2, device=device, requires_grad=True)
        graphed(x).sum().backward()
        assert x.grad.tolist() == [2.0, 2.0]


def test_retain_grad_on_chained_link_is_owned(env: Env) -> None:
    # retain_grad copies on its own, so "auto" need not copy the chained slot.
    a, b = mlp(env), mlp(env)
    ga, gb = make_graphed_callables(
        (a, b), ((env.randn(3, 8),), (env.randn(3, 8, requires_grad=True),))
    )
    h1 = ga(env.randn(3, 8))
    h1.retain_grad()
    gb(h1).sum().backward()
    first = h1.grad.clone()
    gb(ga(env.randn(3, 8))).pow(2).sum().backward()
    torch.testing.assert_close(h1.grad, first)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_param_shared_by_two_callables_and_eager_code(env: Env, set_to_none: bool) -> None:
    torch.manual_seed(7)
    shared = torch.nn.Linear(8, 8).to(env.device)
    ref = torch.nn.Linear(8, 8).to(env.device)
    ref.load_state_dict(shared.state_dict())

    class Wrap(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).tanh()

    ga, gb = make_graphed_callables(
        (Wrap(shared), Wrap(shared)),
        ((env.randn(3, 8),), (env.randn(3, 8, requires_grad=True),)),
    )
    eager_a, eager_b = Wrap(ref), Wrap(ref)
    for model in (shared, ref):
        model.zero_grad(set_to_none=set_to_none)
    for _ in range(3):
        x = env.randn(3, 8)
        (gb(ga(x)) + shared(x)).pow(2).sum().backward()
        (eager_b(eager_a(x)) + ref(x)).pow(2).sum().backward()
    assert_close_lists(grads(shared), grads(ref))


@pytest.mark.parametrize("requested", ["h", "h+params"])
def test_autograd_grad_of_chained_link_is_owned(env: Env, requested: str) -> None:
    a, b = mlp(env), mlp(env)
    ga, gb = make_graphed_callables(
        (a, b), ((env.randn(3, 8),), (env.randn(3, 8, requires_grad=True),))
    )
    params = list(b.parameters()) if requested == "h+params" else []
    kept = []
    x = env.randn(3, 8)
    for scale in (1.0, 3.0):
        h = ga(x)
        kept.append(torch.autograd.grad((gb(h) * scale).sum(), [h, *params])[0])
    # Same upstream gradient pattern scaled by 3: an owned first result is 1/3 of the second.
    torch.testing.assert_close(kept[1], 3 * kept[0])
