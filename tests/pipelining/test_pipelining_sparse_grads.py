"""One weight receiving gradients of several layouts: W sums them as the engine does.

``EmbeddingBag(sparse=True)`` with per-sample weights from the stage input gives a sparse
gradient from a node W calls directly; a dense use of the same weight (``x @ E``, a tied
head ``h @ E.t()``) gives a dense one. The engine adds them in either order (a sparse
buffer goes second: ATen adds sparse to dense, not dense to sparse), and so must W. Each
case runs a fused backward and gradsafe's B then W from the same ``.grad`` start (None,
a dense or a sparse gradient already held), in fp64.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from gradsafe.pipelining import stage_backward_input, stage_backward_weight

_NUM, _DIM, _BATCH = 10, 4, 6


def _bag(idx: torch.Tensor, e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # Per-sample weights from the stage input: the bag's node depends on x and E (W calls it).
    return F.embedding_bag(
        idx, e, per_sample_weights=torch.tanh(x[:, : idx.shape[1]]), mode="sum", sparse=True
    )


Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_CASES: dict[str, Forward] = {
    # sparse from the bag, dense straight into E's accumulator (x @ E)
    "sparse + dense (x @ E)": lambda idx, e, x: _bag(idx, e, x).sum(-1, keepdim=True) * (x @ e.t()),
    # dense through the tied head's transpose (a weight-only node), sparse from the bag
    "sparse + dense (tied head h @ E.t())": lambda idx, e, x: torch.tanh(_bag(idx, e, x)) @ e.t(),
    # dense first in B's order, sparse second
    "dense + sparse": lambda idx, e, x: (x @ e.t()) @ e + _bag(idx, e, x),
    # two sparse gradients
    "sparse + sparse": lambda idx, e, x: _bag(idx, e, x) * _bag(idx.flip(0), e, x.flip(0)),
    # an expanded gradient (AddBackward passes the loss's expanded ones on) and a dense one
    "expanded + dense": lambda idx, e, x: (
        (x[:, :1] + e[:1, :]).sum() + (x @ e.t()).sum() + _bag(idx, e, x).sum()
    ),
}


def _param(layout: str) -> torch.nn.Parameter:
    if layout == "transposed":  # a non-contiguous parameter: gradients follow its strides
        return torch.nn.Parameter(torch.randn(_DIM, _NUM).t())
    return torch.nn.Parameter(torch.randn(_NUM, _DIM))


def _start(e: torch.nn.Parameter, held: str) -> None:
    if held == "dense":
        e.grad = torch.randn_like(e)
    elif held == "sparse":
        e.grad = torch.sparse_coo_tensor([[1, 3, 1]], torch.randn(3, _DIM), (_NUM, _DIM))


@pytest.mark.parametrize("held", ["None", "dense", "sparse"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_mixed_layout_gradients_sum_like_a_fused_backward(
    case: str, layout: str, held: str
) -> None:
    forward = _CASES[case]
    torch.manual_seed(0)
    e = _param(layout)
    idx = torch.randint(0, _NUM, (_BATCH, 3))
    x = torch.randn(_BATCH, _DIM, requires_grad=True)
    out = forward(idx, e, x)
    g = torch.randn_like(out)

    torch.manual_seed(1)
    _start(e, held)
    out = forward(idx, e, x)
    out.backward(g)
    want_x, want_e = x.grad, e.grad
    x.grad = None

    torch.manual_seed(1)
    _start(e, held)
    out = forward(idx, e, x)
    (got_x,), handoff = stage_backward_input([out], [g], [x], [e])
    stage_backward_weight([e], handoff)

    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-12)
    assert e.grad is not None and want_e is not None
    assert e.grad.layout == want_e.layout, (e.grad.layout, want_e.layout)
    torch.testing.assert_close(e.grad.to_dense(), want_e.to_dense(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_weight_grads_sums_mixed_layouts_like_a_fused_backward(case: str) -> None:
    """The non-delivering W (graphed split stages) sums the same way."""
    forward = _CASES[case]
    torch.manual_seed(0)
    e = _param("contiguous")
    idx = torch.randint(0, _NUM, (_BATCH, 3))
    x = torch.randn(_BATCH, _DIM, requires_grad=True)
    out = forward(idx, e, x)
    g = torch.randn_like(out)
    (want,) = torch.autograd.grad(forward(idx, e, x), [e], g)
    _, handoff = stage_backward_input([forward(idx, e, x)], [g], [x], [e])
    (got,) = handoff.weight_grads([e])
    assert got is not None and e.grad is None
    torch.testing.assert_close(got.to_dense(), want.to_dense(), rtol=1e-12, atol=1e-12)
