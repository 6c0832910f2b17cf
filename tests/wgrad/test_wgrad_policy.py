"""The wgrad-return table and the dummy gradient."""

from __future__ import annotations

import pytest
import torch

from gradsafe.wgrad import dummy_wgrad, wgrad_return

TABLE = [
    # delayed, fused, has_flag, expected ("wgrad" | None | "dummy")
    (False, False, False, "wgrad"),
    (True, False, False, None),
    (False, True, False, None),
    (False, True, True, "dummy"),
    (True, True, False, None),
    (True, True, True, None),
]


@pytest.mark.parametrize(("delayed", "fused", "has_flag", "expected"), TABLE)
def test_table(delayed: bool, fused: bool, has_flag: bool, expected: str | None) -> None:
    param = torch.nn.Parameter(torch.randn(4, 3))
    if has_flag:
        param.grad_added_to_main_grad = False
    wgrad = torch.randn(4, 3)
    got = wgrad_return(param, wgrad, accumulate_into_main_grad=fused, delayed=delayed)
    if expected == "wgrad":
        assert got is wgrad
    elif expected == "dummy":
        assert got is not None and got is not wgrad
        assert got.shape == param.shape and got.dtype == param.dtype
        assert bool((got == 0).all())
        assert param.grad_added_to_main_grad is True
    else:
        assert got is None
    if has_flag and expected != "dummy":
        assert param.grad_added_to_main_grad is False  # only the dummy row sets it


def test_plain_row_needs_the_gradient() -> None:
    param = torch.nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match="pass the computed weight gradient"):
        wgrad_return(param, None, accumulate_into_main_grad=False, delayed=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dummy_costs_one_element(dtype: torch.dtype) -> None:
    param = torch.nn.Parameter(torch.randn(64, 32, dtype=dtype))
    dummy = dummy_wgrad(param)
    assert dummy.shape == param.shape and dummy.dtype == dtype and dummy.device == param.device
    assert dummy.stride() == (0, 0)
    assert dummy.untyped_storage().nbytes() == dummy.element_size()
    # Its own element: nothing written into one dummy reaches another.
    other = dummy_wgrad(torch.nn.Parameter(torch.randn(7, dtype=dtype)))
    assert other.untyped_storage().data_ptr() != dummy.untyped_storage().data_ptr()


class _ReturnsDummy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.w = w
        return x * 1.0

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g, dummy_wgrad(ctx.w)


def _backward_through_dummy(param: torch.Tensor) -> None:
    x = torch.randn(3, requires_grad=True)
    _ReturnsDummy.apply(x, param).sum().backward()


class _FusedFlagged(torch.autograd.Function):
    """A fused kernel on a flagged parameter: its gradient already went to main_grad."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.w = w
        return x * 1.0

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g, wgrad_return(ctx.w, None, accumulate_into_main_grad=True, delayed=False)


def _flagged(*shape: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(*shape))
    p.main_grad = torch.zeros(*shape)
    p.grad_added_to_main_grad = False
    return p


def _fused_loss(p: torch.Tensor) -> torch.Tensor:
    return _FusedFlagged.apply(torch.randn(3, requires_grad=True), p).sum()


WRITES = {
    "fill_": lambda g: g.fill_(7.0),
    # (torch warns that masked_fill_ on an expanded tensor is deprecated, and does it)
    "masked_fill_": lambda g: g.masked_fill_(torch.ones(g.shape, dtype=torch.bool), 7.0),
    "data.fill_": lambda g: g.data.fill_(7.0),
    "zero_ then fill_": lambda g: g.zero_().fill_(7.0),
}


@pytest.mark.filterwarnings("ignore:Use of masked_fill_ on expanded tensors")
@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_hook_writing_the_dummy_changes_no_other_gradient(write) -> None:  # type: ignore[no-untyped-def]
    p, q = _flagged(5, 4), _flagged(5, 4)

    def hook(grad: torch.Tensor) -> None:  # a tensor hook receives the dummy
        write(grad)

    p.register_hook(hook)
    _fused_loss(p).backward()
    _fused_loss(q).backward()
    _fused_loss(p).backward()
    assert bool((q.grad == 0).all())
    assert dummy_wgrad(q).abs().sum().item() == 0.0


@pytest.mark.filterwarnings("ignore:Use of masked_fill_ on expanded tensors")
@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_an_autograd_grad_caller_writing_the_dummy_changes_no_other_gradient(write) -> None:  # type: ignore[no-untyped-def]
    p, q = _flagged(5, 4), _flagged(5, 4)
    (gp,) = torch.autograd.grad(_fused_loss(p), [p])
    assert gp.stride() == (0, 0)  # the caller holds the dummy itself
    write(gp)
    (gq,) = torch.autograd.grad(_fused_loss(q), [q])
    assert bool((gq == 0).all())
    _fused_loss(q).backward()
    assert bool((q.grad == 0).all())


def test_in_place_arithmetic_on_the_dummy_raises_instead_of_writing_it() -> None:
    """What a one-element dummy cannot support: torch refuses, naming clone()."""
    p = _flagged(5, 4)

    def hook(grad: torch.Tensor) -> None:
        grad.mul_(2.0)

    handle = p.register_hook(hook)
    with pytest.raises(RuntimeError, match="single memory location"):
        _fused_loss(p).backward()
    handle.remove()
    p.register_hook(lambda g: g.clone().mul_(2.0))  # the fix the message names
    _fused_loss(p).backward()
    assert bool((p.grad == 0).all())


def test_one_dummy_per_backward_for_tied_fused_uses() -> None:
    """A second fused use in the same backward returns None: the first dummy is enough."""
    p = _flagged(5, 4)
    returned: list[torch.Tensor | None] = []

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def]
            ctx.w = w
            return x * 1.0

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            returned.append(
                wgrad_return(ctx.w, None, accumulate_into_main_grad=True, delayed=False)
            )
            return g, returned[-1]

    seen: list[torch.Tensor] = []
    p.register_hook(lambda g: seen.append(g))
    x = torch.randn(3, requires_grad=True)
    Fused.apply(Fused.apply(x, p), p).sum().backward()
    assert [r is None for r in returned] == [False, True]
    assert seen[0] is returned[0]  # AccumulateGrad got the dummy itself, no sum
    assert p.grad_added_to_main_grad is True
    Fused.apply(x, p).sum().backward()  # the next backward gets its own dummy
    assert returned[-1] is not None


def test_accumulategrad_copies_the_dummy_and_never_keeps_it() -> None:
    p = torch.nn.Parameter(torch.randn(5, 4))
    q = torch.nn.Parameter(torch.randn(5, 4))
    shared = dummy_wgrad(p)
    _backward_through_dummy(p)
    # .grad was None: AccumulateGrad made a param-layout copy, not an alias.
    assert p.grad is not None and p.grad.stride() == p.stride()
    assert p.grad.data_ptr() != shared.data_ptr()
    p.grad.fill_(7.0)  # user code writing .grad in place
    p.grad.add_(1.0)
    assert dummy_wgrad(q).abs().sum().item() == 0.0
    # .grad present: zeros are added in place, the buffer is kept.
    ptr = p.grad.data_ptr()
    _backward_through_dummy(p)
    assert p.grad.data_ptr() == ptr and bool((p.grad == 8.0).all())
    assert shared.abs().sum().item() == 0.0


relaxed = pytest.mark.skipif(
    not hasattr(torch.autograd, "enforce_grad_layout_policy"),
    reason="this torch always enforces the gradient layout contract",
)


@relaxed
def test_relaxed_layout_contract_gets_a_private_element() -> None:
    p = torch.nn.Parameter(torch.randn(5, 4))
    q = torch.nn.Parameter(torch.randn(5, 4))
    with torch.autograd.enforce_grad_layout_policy(False):
        _backward_through_dummy(p)
    # Kept as .grad (zero strides), but its element belongs to p.grad alone.
    assert p.grad is not None and p.grad.stride() == (0, 0)
    p.grad.fill_(3.0)
    assert dummy_wgrad(q).abs().sum().item() == 0.0


@relaxed
def test_hazard_always_shared_element_is_corrupted_when_relaxed() -> None:
    """The wrong approach: one cached element even where AccumulateGrad may keep the view."""
    shared = torch.zeros(())

    class SharedDummy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def]
            ctx.shape = w.shape
            return x * 1.0

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            return g, shared.expand(ctx.shape)

    p = torch.nn.Parameter(torch.randn(5, 4))
    with torch.autograd.enforce_grad_layout_policy(False):
        SharedDummy.apply(torch.randn(3, requires_grad=True), p).sum().backward()
    p.grad.fill_(3.0)
    assert shared.item() == 3.0  # every later dummy of this dtype is now 3, not 0
