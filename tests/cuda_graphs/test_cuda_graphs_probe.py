"""The structure probe of ``make_graphed_callables``: an unrecognised shape fails when the callables are made.

Each test hands gradsafe a stand-in for upstream's function that builds the
same closure structure as torch (a ``functionalized`` closure over a
``Graphed`` Function whose backward closes over its static buffers), altered in
one way, and checks that gradsafe refuses it in ``make_graphed_callables`` --
before any forward or backward runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd.function import once_differentiable

from gradsafe.cuda_graphs import UnsupportedTorchError, make_graphed_callables

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke


class _ReplayForbidden:
    def replay(self) -> None:
        raise AssertionError("the structure probe replayed a graph")


def _stand_in(
    *,
    leading: bool = False,
    extra_slot: bool = False,
    leading_grad: bool = False,
    closes_over_buffers: bool = True,
    closes_over_inputs: bool = True,
) -> Any:
    """A make_graphed_callables look-alike for one callable of one tensor input."""

    def make(callables: Any, sample_args: Any, *args: Any, **kwargs: Any) -> Any:
        static_input_surface = tuple(sample_args)
        static_grad_outputs = (torch.zeros(2),)
        static_grad_inputs = (torch.full((2,), 3.0),)
        bwd_graph = _ReplayForbidden()

        def body(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
            bwd_graph.replay()
            for g, grad in zip(static_grad_outputs, grads):
                if g.data_ptr() != grad.data_ptr():
                    g.copy_(grad)
            out: tuple[Any, ...] = tuple(b.detach() for b in static_grad_inputs)
            if leading:
                out = (torch.ones(1) if leading_grad else None,) + out
            return out + (None,) if extra_slot else out

        def opaque(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
            return (None,) * (2 if leading else 1)

        def read(ctx: Any, *inputs: torch.Tensor) -> torch.Tensor:
            # As torch's: an argument is copied into its static buffer unless it is that tensor.
            for static, given in zip(static_input_surface, inputs):
                if static.data_ptr() != given.data_ptr():
                    static.copy_(given)
            return static_input_surface[0] * 3

        def opaque_forward(ctx: Any, *inputs: torch.Tensor) -> torch.Tensor:
            return inputs[0] * 3

        class Graphed(torch.autograd.Function):
            forward = staticmethod(read if closes_over_inputs else opaque_forward)

            backward = staticmethod(once_differentiable(body if closes_over_buffers else opaque))

        if leading:

            def read_after_graphs(ctx: Any, graphs: Any, *inputs: torch.Tensor) -> torch.Tensor:
                for static, given in zip(static_input_surface, inputs):
                    if static.data_ptr() != given.data_ptr():
                        static.copy_(given)
                return static_input_surface[0] * 3

            def opaque_after_graphs(ctx: Any, graphs: Any, *inputs: torch.Tensor) -> torch.Tensor:
                return inputs[0] * 3

            Graphed.forward = staticmethod(  # type: ignore[method-assign,assignment]
                read_after_graphs if closes_over_inputs else opaque_after_graphs
            )
            graphs = (None, bwd_graph)

            def functionalized(*user_args: Any) -> Any:
                return Graphed.apply(graphs, *user_args)
        else:

            def functionalized(*user_args: Any) -> Any:
                return Graphed.apply(*user_args)

        return functionalized

    return make


@pytest.fixture
def sample() -> tuple[torch.Tensor]:
    return (torch.ones(2, requires_grad=True),)


@pytest.mark.parametrize("leading", [False, True], ids=["2.10-2.14 shape", "2.15 shape"])
def test_recognised_shapes_are_accepted_and_work(
    monkeypatch: pytest.MonkeyPatch, sample: tuple[torch.Tensor], leading: bool
) -> None:
    monkeypatch.setattr(torch.cuda.graphs, "make_graphed_callables", _stand_in(leading=leading))
    graphed = make_graphed_callables(lambda x: x * 3, sample)
    x = torch.ones(2, requires_grad=True)
    # The stand-in's backward replays nothing in the dry run; a real call would.
    with pytest.raises(AssertionError, match="replayed a graph"):
        graphed(x).sum().backward()


@pytest.mark.parametrize(
    "alteration, message",
    [
        (dict(extra_slot=True), "returns 2 gradient slots, expected 0 .* plus 1"),
        (dict(leading=True, extra_slot=True), "returns 3 gradient slots, expected 1 .* plus 1"),
        (dict(leading=True, leading_grad=True), "leading non-tensor argument"),
        (dict(closes_over_buffers=False), "does not close over static_grad_outputs"),
        (dict(closes_over_inputs=False), "does not close over a static_input_surface"),
    ],
    ids=[
        "extra slot",
        "extra slot after leading None",
        "gradient for the graphs tuple",
        "opaque backward",
        "opaque forward",
    ],
)
def test_altered_structure_fails_when_made(
    monkeypatch: pytest.MonkeyPatch,
    sample: tuple[torch.Tensor],
    alteration: dict[str, bool],
    message: str,
) -> None:
    monkeypatch.setattr(torch.cuda.graphs, "make_graphed_callables", _stand_in(**alteration))
    with pytest.raises(UnsupportedTorchError, match=message) as raised:
        make_graphed_callables(lambda x: x * 3, sample)
    assert torch.__version__ in str(raised.value)
    # ownership="never" is the documented way to take upstream's callable as it is.
    assert callable(make_graphed_callables(lambda x: x * 3, sample, ownership="never"))


def test_forward_signature_without_varargs_fails(
    monkeypatch: pytest.MonkeyPatch, sample: tuple[torch.Tensor]
) -> None:
    inner = _stand_in()

    def make(*args: Any, **kwargs: Any) -> Any:
        functionalized = inner(*args, **kwargs)
        graphed_cls = functionalized.__closure__[0].cell_contents
        graphed_cls.forward = staticmethod(lambda ctx, x: x * 3)
        return functionalized

    monkeypatch.setattr(torch.cuda.graphs, "make_graphed_callables", make)
    with pytest.raises(UnsupportedTorchError, match=r"expected \(ctx, \[leading"):
        make_graphed_callables(lambda x: x * 3, sample)
