"""TransformerEngine's make_graphed_callables and gradsafe's delayed-wgrad mark (issue 19).

TransformerEngine (from commit a6c70f4dc, release 2.19) clones a graphed
module's parameter gradients on return except for parameters marked
``skip_backward_post_hook`` -- the attribute gradsafe's delayed path sets. TE
is not installed here (it needs a GPU), so these tests put a fake
``transformer_engine`` package on ``sys.path`` whose ``pytorch/graph.py`` is
``_te_graph_double.py``: TE's clone rule and the structure gradsafe's patch
reads, written from TE's source (see that file), run under CUDA-graph
emulation.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _delayed_matmul import DelayedMatmul

import gradsafe
from gradsafe.cuda_graphs import UnsupportedTransformerEngineError, _te
from gradsafe.patching import PatchRegistry
from gradsafe.testing import MegatronStyleDDP, emulate_cuda_graphs, module_of
from gradsafe.wgrad import WeightGradStore
from gradsafe.wgrad.markers import mark_delayed_wgrad

_DOUBLE = pathlib.Path(__file__).with_name("_te_graph_double.py")


def _install_fake_te(root: pathlib.Path, graph_source: str) -> None:
    package = root / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text("")
    (package / "pytorch" / "graph.py").write_text(graph_source)


@pytest.fixture
def fake_te(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: PatchRegistry
) -> Iterator[Callable[[str], Any]]:
    """Installs a fake TE whose graph.py is the given source; returns its graph module once imported."""

    def install(source: str) -> Any:
        _install_fake_te(tmp_path, source)
        monkeypatch.syspath_prepend(str(tmp_path))
        import transformer_engine.pytorch.graph as graph

        return graph

    with emulate_cuda_graphs():
        yield install
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


@pytest.fixture
def te_graph(fake_te: Callable[[str], Any]) -> Any:
    return fake_te(_DOUBLE.read_text())


def _tied_grad(
    graph: Callable[..., Any] | None,
    microbatches: int,
    *,
    w_lag: int = 1,
    fused: bool = False,
    mark: str = "record",
    megatron: bool = False,
) -> torch.Tensor:
    """A tied embedding/head in fp64: W used unfused inside the graphed module, and by a delayed head.

    The weight is marked delayed before the module is graphed: by
    ``mark_delayed_wgrad`` at construction (what Megatron-core's DDP needs),
    or by ``store.record`` in a first, eager step. ``graph`` graphs the
    embedding (None: eager). W of microbatch ``k`` runs after B of microbatch
    ``k + w_lag``. Returns the weight's whole gradient of the graphed step.
    ``megatron``: under ``MegatronStyleDDP(delay_wgrad_compute=True,
    overlap_grad_reduce=True)``, which takes the gradient into ``main_grad``
    through the store's W hooks.
    """
    torch.manual_seed(3)
    embed = torch.nn.Linear(6, 4, bias=False, dtype=torch.float64)
    if fused:
        embed.weight.main_grad = torch.zeros_like(embed.weight)  # type: ignore[attr-defined]
    store = WeightGradStore()
    if mark == "construction":
        mark_delayed_wgrad(embed.weight)
    elif mark == "record":  # one eager step, its gradients then cleared
        h0 = torch.randn(3, 4, dtype=torch.float64)
        DelayedMatmul.apply(h0, embed.weight, store, fused).sum().backward()
        store.seal().run()
        embed.weight.grad = None
        if fused:
            embed.weight.main_grad.zero_()  # type: ignore[attr-defined]
    ddp = None
    if megatron:
        ddp = MegatronStyleDDP(
            module_of([embed.weight], store), delay_wgrad_compute=True, overlap_grad_reduce=True
        )
    xs = [torch.randn(3, 6, dtype=torch.float64) for _ in range(microbatches)]
    # Megatron graphs inside its capture window, where its hooks (TE's warm-up
    # backward fills .grad) return at once.
    with contextlib.nullcontext() if ddp is None else ddp.graph_capture():
        run = embed if graph is None else graph(embed, (torch.randn(3, 6, dtype=torch.float64),))
    pending = []
    for x in xs:
        h = torch.tanh(run(x))
        DelayedMatmul.apply(h, embed.weight, store, fused).pow(2).sum().backward()
        pending.append(store.seal())
        if len(pending) > w_lag:
            pending.pop(0).run()
    for w_pass in pending:
        w_pass.run()
    if megatron:
        assert embed.weight.grad is None  # DDP's hook moved it into main_grad
        return embed.weight.main_grad  # type: ignore[attr-defined,no-any-return]
    assert embed.weight.grad is not None
    main_grad = getattr(embed.weight, "main_grad", None)
    return embed.weight.grad if main_grad is None else embed.weight.grad + main_grad


def _te_graphs(graph_module: Any, **options: Any) -> Callable[..., Any]:
    return lambda module, sample: graph_module.make_graphed_callables(module, sample, **options)


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("mark", ["construction", "record"])
def test_te_leaves_a_weight_gradsafe_marked_aliased_without_the_patch(
    te_graph: Any, mark: str
) -> None:
    # The finding: TE's clone rule skips the weight because gradsafe marked it,
    # though its slot carries the embedding's real gradient; the next replay
    # rewrites the .grad W added into. Unmarked, TE's clone keeps it exact.
    expected = _tied_grad(None, 2, mark=mark)
    aliased = _tied_grad(_te_graphs(te_graph), 2, mark=mark)
    assert _error(aliased, expected) > 1e-3
    torch.testing.assert_close(
        _tied_grad(_te_graphs(te_graph), 2, mark="none"), _tied_grad(None, 2, mark="none")
    )


@pytest.mark.parametrize("fused", [False, True], ids=["W-into-grad", "W-into-main_grad"])
@pytest.mark.parametrize("w_lag", [0, 1], ids=["W-after-its-B", "W-one-behind"])
@pytest.mark.parametrize("microbatches", [2, 3])
@pytest.mark.parametrize("mark", ["construction", "record"])
def test_patched_te_graphs_own_the_gradient_of_a_weight_gradsafe_marked(
    te_graph: Any, mark: str, microbatches: int, w_lag: int, fused: bool
) -> None:
    expected = _tied_grad(None, microbatches, w_lag=w_lag, fused=fused, mark=mark)
    with gradsafe.patch("cuda_graphs"):
        got = _tied_grad(_te_graphs(te_graph), microbatches, w_lag=w_lag, fused=fused, mark=mark)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("w_lag", [0, 1], ids=["W-after-its-B", "W-one-behind"])
def test_patched_te_graphs_under_megatron_ddp_keep_main_grad_exact(
    te_graph: Any, w_lag: int
) -> None:
    # The mark still routes the weight through the module (DDP's grad-ready
    # hook at W); only TE's clone of its slot changes.
    expected = _tied_grad(None, 3, w_lag=w_lag, mark="construction", megatron=True)
    aliased = _tied_grad(_te_graphs(te_graph), 3, w_lag=w_lag, mark="construction", megatron=True)
    with gradsafe.patch("cuda_graphs"):
        got = _tied_grad(_te_graphs(te_graph), 3, w_lag=w_lag, mark="construction", megatron=True)
    torch.testing.assert_close(got, expected)
    assert (_error(aliased, expected) > 1e-3) == (w_lag == 1)


def test_pipeline_graphed_forwards_are_covered(te_graph: Any) -> None:
    # With _order (Megatron-core's pipeline capture) TE returns graphed
    # forward functions, not modules.
    expected = _tied_grad(None, 2, mark="construction")
    with gradsafe.patch("cuda_graphs"):
        got = _tied_grad(_te_graphs(te_graph, _order=[1, -1]), 2, mark="construction")
    torch.testing.assert_close(got, expected)


def test_a_te_public_name_imported_before_patching_is_covered(te_graph: Any) -> None:
    # Megatron-core binds TE's make_graphed_callables at import; gradsafe wraps
    # the module global it calls, so that binding goes through the patch too.
    public = te_graph.make_graphed_callables
    expected = _tied_grad(None, 2, mark="construction")
    with gradsafe.patch("cuda_graphs"):
        got = _tied_grad(lambda m, s: public(m, s), 2, mark="construction")
    torch.testing.assert_close(got, expected)
    assert te_graph._make_graphed_callables is not _te._make_graphed_callables


def _slots(graphed: torch.nn.Module) -> tuple[bool, ...]:
    return _te._clone_slots(graphed).cell.cell_contents  # type: ignore[no-any-return]


def test_te_own_delayed_weights_and_opt_out_stay_tes_choice(te_graph: Any) -> None:
    # TE's own mark (a placeholder slot under fused accumulation) and
    # clone_param_grads_on_return=False are TE's decisions, not gradsafe's.
    def pair() -> torch.nn.Sequential:
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3, bias=False))
        model[0].weight.skip_backward_post_hook = True  # a TE module's own delayed weight
        mark_delayed_wgrad(model[1].weight)
        return model

    sample = (torch.randn(2, 3, requires_grad=True),)
    with gradsafe.patch("cuda_graphs"):
        # slots: the input, then weight0 (TE's mark), bias0, weight1 (gradsafe's mark)
        assert _slots(te_graph.make_graphed_callables(pair(), sample)) == (
            False,
            False,
            True,
            True,
        )
        opted_out = te_graph.make_graphed_callables(
            pair(), sample, clone_param_grads_on_return=False
        )
        assert _slots(opted_out) == (False,) * 4
    assert _slots(te_graph.make_graphed_callables(pair(), sample)) == (False, False, True, False)


def test_te_that_never_reads_the_mark_is_not_wrapped(fake_te: Callable[[str], Any]) -> None:
    # TE up to 2.18 returns a view for every slot, marked or not: nothing for gradsafe to undo.
    without_rule = _DOUBLE.read_text().replace("skip_backward_post_hook", "no_such_marker")
    graph = fake_te(without_rule)
    assert _te.plan() == []
    original = graph._make_graphed_callables
    with gradsafe.patch("cuda_graphs"):
        assert graph._make_graphed_callables is original


def test_te_reading_the_mark_in_an_unknown_structure_is_refused(
    fake_te: Callable[[str], Any],
) -> None:
    # A graph.py that reads skip_backward_post_hook without the known clone
    # slots: gradsafe cannot tell what the mark does there, so it refuses.
    graph = fake_te(
        "import torch\n"
        "def _make_graphed_callables(callables, sample_args, *, clone_param_grads_on_return=True):\n"
        "    # decides by getattr(p, 'skip_backward_post_hook', False)\n"
        "    return torch.cuda.graphs.make_graphed_callables(callables, sample_args)\n"
    )
    with gradsafe.patch("cuda_graphs"):
        with pytest.raises(UnsupportedTransformerEngineError, match="Refusing to return"):
            graph._make_graphed_callables(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
