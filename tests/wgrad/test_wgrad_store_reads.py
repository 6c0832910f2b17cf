"""``WeightGradStore.record(..., reads=)``: W refuses, before applying anything, when a read tensor changed since B."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.testing import emulate_cuda_graphs
from gradsafe.wgrad import WeightGradStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fused_linear.py"
MODIFIED = "modified in place since B recorded it"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fused_linear_example_reads", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record_reading(store: WeightGradStore, w: torch.Tensor, x: torch.Tensor, fused: bool) -> None:
    def compute(main_grad: torch.Tensor | None) -> torch.Tensor | None:
        if main_grad is None:
            return x.clone()
        main_grad.add_(x)
        return None

    store.record(w, compute, accumulate_into_main_grad=fused, reads=(x,))


@pytest.mark.parametrize("fused", [False, True], ids=["into-grad", "into-main_grad"])
def test_a_read_modified_in_place_after_b_is_refused_with_nothing_applied(fused: bool) -> None:
    store = WeightGradStore()
    first = torch.nn.Parameter(torch.zeros(3))
    w = torch.nn.Parameter(torch.zeros(3))
    for p in (first, w):
        p.main_grad = torch.zeros(3)  # type: ignore[attr-defined]
    fired: list[torch.Tensor] = []
    store.register_grad_ready_hook(first, fired.append)
    store.register_grad_ready_hook(w, fired.append)
    x = torch.ones(3)
    _record_reading(store, first, torch.ones(3), fused)  # recorded first: delivered first
    _record_reading(store, w, x[:], fused)  # a view: shares x's version counter
    pending = store.seal()
    x.mul_(2)
    for _ in range(2):  # the refusal leaves the pass unrun, and refuses again
        with pytest.raises(RuntimeError, match=MODIFIED):
            pending.run()
    assert fired == [] and not pending.done
    for p in (first, w):
        assert p.grad is None and p.main_grad.count_nonzero() == 0  # type: ignore[attr-defined]


def test_unmodified_reads_run_as_before() -> None:
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.zeros(3))
    x = torch.ones(3)
    _record_reading(store, w, x, False)
    y = x.clone()
    y.mul_(2)  # a copy's change is not a change of x
    store.seal().run()
    torch.testing.assert_close(w.grad, torch.ones(3))


def test_an_inference_tensor_in_reads_is_refused_at_record() -> None:
    with torch.inference_mode():
        x = torch.ones(3)
    with pytest.raises(ValueError, match="inference tensor"):
        WeightGradStore().record(
            torch.nn.Parameter(torch.zeros(3)),
            lambda _: x,
            accumulate_into_main_grad=False,
            reads=(x,),
        )


def _graphed_body_delayed_head(
    example: ModuleType, graphed: bool, w_lag: int, *, clone: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = body(x)`` (graphed or eager), the example's FusedLinear head on ``h`` with W delayed, fp64.

    W of microbatch ``k`` runs after B of microbatch ``k + w_lag``. Returns the
    head's and the body's weight gradients after 3 microbatches.
    """
    torch.manual_seed(7)
    store = WeightGradStore()
    body = torch.nn.Linear(4, 4, dtype=torch.float64)
    head = example.FusedLinear(4, 3, wgrad_store=store, dtype=torch.float64)
    xs = [torch.randn(2, 4, dtype=torch.float64) for _ in range(3)]
    run = body
    if graphed:
        run = make_graphed_callables(body, (torch.randn(2, 4, dtype=torch.float64),))
    pending = []
    for x in xs:
        h = run(x)
        head(h.clone() if clone else h).pow(2).sum().backward()
        pending.append(store.seal())
        if len(pending) > w_lag:
            pending.pop(0).run()
    for w_pass in pending:
        w_pass.run()
    return head.weight.grad, body.weight.grad


@pytest.mark.parametrize("clone", [False, True], ids=["reads-output", "reads-clone"])
def test_the_examples_kernel_on_a_graphed_output_is_exact_with_w_before_the_next_call(
    example: ModuleType, clone: bool
) -> None:
    with emulate_cuda_graphs():
        expected = _graphed_body_delayed_head(example, False, 0)
        got = _graphed_body_delayed_head(example, True, 0, clone=clone)
        lagged_clone = _graphed_body_delayed_head(example, True, 1, clone=True)
    for g, lag, e in zip(got, lagged_clone, expected):
        torch.testing.assert_close(g, e)
        torch.testing.assert_close(lag, e)


def test_the_examples_kernel_refuses_w_after_the_graphed_callable_ran_again(
    example: ModuleType,
) -> None:
    # W one microbatch behind reads h0 after call 1 rewrote its static buffer
    # (upstream and gradsafe both compute a wrong gradient then, silently).
    with emulate_cuda_graphs(), pytest.raises(RuntimeError, match=MODIFIED):
        _graphed_body_delayed_head(example, True, 1)
