"""``register_multi_grad_hook`` over a stage's parameters: W fires it as one fused backward does
(once, with the same gradients, when the same parameters hold their new gradients), and a
mode-"any" one costs W no memory (a mode-"all" one holds its parameters' gradients until the last
arrives, as a fused backward's does).

A hook spanning parameters and anything else (an activation, a stage input) is refused at B:
tests/pipelining/test_pipelining_hook_edges.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import LiveStorage

# gradsafe's helper nodes allocate a few scalars (anchors, the hook's marker): bytes, not gradients.
_SLACK = 4096


def _stack(layers: int, dim: int) -> nn.Sequential:
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())))


def _w_peak(hook_mode: str | None) -> tuple[int, int]:
    """W's peak beyond what B left (8 x Linear(256), .grad held), and one layer's gradient bytes."""
    torch.manual_seed(0)
    model = _stack(8, 256)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    if hook_mode is not None:
        torch.autograd.graph.register_multi_grad_hook(params, lambda g: None, mode=hook_mode)  # type: ignore[arg-type]
    x = torch.randn(4, 256, requires_grad=True)
    with LiveStorage([*params, x, *(p.grad for p in params)]) as live:
        loss = model(x).pow(2).mean()
        _, handoff = stage_backward_input([loss], None, [x], params)
        live.mark()
        stage_backward_weight(params, handoff)
        peak = live.peak_since_mark
    one_layer = sum(p.numel() * p.element_size() for p in model[0].parameters())
    return peak, one_layer


def test_w_with_an_any_hook_over_every_parameter_holds_what_it_holds_without_one() -> None:
    """Mode "any" fires once, on the first gradient: W still delivers each layer's gradients as
    soon as they are final (before, the hook merged every parameter into one delivery, and W held
    the stage's whole set of weight gradients: 3.6x torch's split)."""
    plain, one_layer = _w_peak(None)
    hooked, _ = _w_peak("any")
    assert hooked <= plain + _SLACK, (hooked, plain, one_layer)


def test_w_with_an_all_hook_over_every_parameter_holds_what_a_fused_backward_holds() -> None:
    """Mode "all" is given every gradient at once: a fused backward keeps each in the hook's
    buffer until the last arrives, and W holds them as long (no more)."""
    hooked, _ = _w_peak("all")
    torch.manual_seed(0)
    model = _stack(8, 256)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    torch.autograd.graph.register_multi_grad_hook(params, lambda g: None, mode="all")
    x = torch.randn(4, 256, requires_grad=True)
    with LiveStorage([*params, x, *(p.grad for p in params)]) as live:
        loss = model(x).pow(2).mean()
        live.mark()
        loss.backward()
        fused = live.peak_since_mark
    grads = sum(p.numel() * p.element_size() for p in params)
    assert fused >= grads and hooked <= fused + _SLACK, (hooked, fused, grads)


_SPANS = {
    "every parameter": lambda ps: ps,
    "first weight and last bias": lambda ps: [ps[0], ps[-1]],
    "every weight": lambda ps: ps[::2],
}


def _run(
    split: bool, mode: str, span: str, grads_held: bool, microbatches: int, device: str = "cpu"
) -> list[tuple[Any, ...]]:
    """Per hook call: what it was given, and every parameter's ``.grad`` at that moment."""
    torch.manual_seed(0)
    model = _stack(3, 4).to(device)
    params = list(model.parameters())
    if grads_held:
        for p in params:
            p.grad = torch.randn_like(p)
    calls: list[tuple[Any, ...]] = []

    def hook(given: Any) -> None:
        grads: Sequence[Any] = given if isinstance(given, (list, tuple)) else [given]
        calls.append(
            (
                tuple(None if g is None else g.clone() for g in grads),
                tuple(None if p.grad is None else p.grad.clone() for p in params),
            )
        )

    torch.autograd.graph.register_multi_grad_hook(_SPANS[span](params), hook, mode=mode)  # type: ignore[arg-type]
    xs = [torch.randn(2, 4, device=device, requires_grad=True) for _ in range(microbatches)]
    losses = [model(x).pow(2).sum() for x in xs]
    if not split:
        for loss in losses:
            loss.backward()
        return calls
    handoffs = [stage_backward_input([loss], None, [x], params)[1] for loss, x in zip(losses, xs)]
    assert calls == []
    for handoff in handoffs:
        stage_backward_weight(params, handoff)
    return calls


def _assert_same_calls(split: list[tuple[Any, ...]], fused: list[tuple[Any, ...]]) -> None:
    assert len(split) == len(fused), (len(split), len(fused))
    for ours, theirs in zip(split, fused):
        for a, b in zip(ours, theirs):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert (x is None) == (y is None)
                if x is not None:
                    torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("grads_held", [False, True], ids=["grad None", "grad held"])
@pytest.mark.parametrize("span", sorted(_SPANS))
@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_over_parameters_fires_as_in_a_fused_backward(
    mode: str, span: str, grads_held: bool, microbatches: int
) -> None:
    """Once per microbatch, given the same gradients, while every parameter's ``.grad`` is what it
    is at that moment of a fused backward (which parameters already hold this microbatch's)."""
    fused = _run(False, mode, span, grads_held, microbatches)
    _assert_same_calls(_run(True, mode, span, grads_held, microbatches), fused)


@pytest.mark.cuda
@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("grads_held", [False, True], ids=["grad None", "grad held"])
@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_over_cuda_parameters_fires_as_in_a_fused_backward(
    mode: str, grads_held: bool
) -> None:
    """On CUDA the accumulators, and the hook, run on autograd's device thread."""
    fused = _run(False, mode, "every parameter", grads_held, 2, "cuda")
    _assert_same_calls(_run(True, mode, "every parameter", grads_held, 2, "cuda"), fused)


@pytest.mark.usefixtures("fp64")
def test_any_hook_fires_in_a_fused_backward_after_w_as_before() -> None:
    """W's stand-in for the hook's per-backward record is gone once W returns."""
    torch.manual_seed(0)
    model = _stack(3, 4)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    calls: list[int] = []
    torch.autograd.graph.register_multi_grad_hook(params, lambda g: calls.append(1), mode="any")  # type: ignore[arg-type]
    x = torch.randn(2, 4, requires_grad=True)
    _, handoff = stage_backward_input([model(x).sum()], None, [x], params)
    stage_backward_weight(params, handoff)
    model(x).sum().backward()
    model(x).sum().backward()
    assert calls == [1, 1, 1]


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("grads_held", [False, True], ids=["grad None", "grad held"])
def test_any_hook_over_a_checkpointed_stages_parameters_fires_once_with_exact_gradients(
    grads_held: bool,
) -> None:
    """B computes the checkpointed Linear's gradients and W delivers them first: the hook fires
    once (on that gradient: docs/pipelining.md says how it differs from a fused backward's)."""
    results = []
    for split in (False, True):
        torch.manual_seed(0)
        model = _stack(3, 4)
        params = list(model.parameters())
        if grads_held:
            for p in params:
                p.grad = torch.randn_like(p)
        calls: list[int] = []
        torch.autograd.graph.register_multi_grad_hook(
            params, lambda g, c=calls: c.append(1), mode="any"
        )  # type: ignore[arg-type,misc]
        x = torch.randn(2, 4, requires_grad=True)
        h = checkpoint(model[2:4], model[:2](x), use_reentrant=False)
        loss = model[4:](h).pow(2).sum()
        if split:
            _, handoff = stage_backward_input([loss], None, [x], params)
            stage_backward_weight(params, handoff)
        else:
            loss.backward()
        results.append((calls, [p.grad for p in params]))
    (fused_calls, fused), (split_calls, ours) = results
    assert fused_calls == split_calls == [1]
    for a, b in zip(ours, fused):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
