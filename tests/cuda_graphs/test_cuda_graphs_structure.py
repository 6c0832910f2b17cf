"""The installed torch's autograd internals that gradsafe.cuda_graphs relies on (probed in _structure.py)."""

from __future__ import annotations

from typing import Any

import torch

from gradsafe.cuda_graphs._autograd import has_tensor_hooks, is_accumulating_backward, leaf_fate


def _fates_during(run: Any) -> list[str]:
    seen: list[str] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            return x * p

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            acc = ctx.next_functions[1][0]
            seen.append(leaf_fate(acc))
            seen.append("accumulating" if is_accumulating_backward([acc]) else "not shown")
            return g, g

    x = torch.ones(2, requires_grad=True)
    p = torch.ones(2, requires_grad=True)
    run(lambda: Probe.apply(x + 1, p).sum(), x, p)
    return seen


def test_leaf_fate_and_backward_kind() -> None:
    assert _fates_during(lambda f, x, p: f().backward()) == ["accumulated", "accumulating"]
    assert _fates_during(lambda f, x, p: f().backward(inputs=[p])) == [
        "accumulated",
        "accumulating",
    ]
    assert _fates_during(lambda f, x, p: f().backward(inputs=[x])) == ["discarded", "not shown"]
    assert _fates_during(lambda f, x, p: torch.autograd.grad(f(), [p])) == ["captured", "not shown"]
    assert _fates_during(lambda f, x, p: torch.autograd.grad(f(), [x])) == [
        "discarded",
        "not shown",
    ]


def test_tensor_hooks_are_visible() -> None:
    leaf, other = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    assert not has_tensor_hooks(leaf)
    handle = leaf.register_hook(lambda g: None)
    assert has_tensor_hooks(leaf)
    handle.remove()
    assert not has_tensor_hooks(leaf)
    torch.autograd.graph.register_multi_grad_hook((leaf, other), lambda grads: None)
    assert has_tensor_hooks(leaf) and has_tensor_hooks(other)
    leaf.register_post_accumulate_grad_hook(lambda t: None)  # sees .grad, not the incoming view
    nonleaf = leaf * 2
    nonleaf.register_hook(lambda g: None)
    assert has_tensor_hooks(nonleaf)


def test_hooks_declared_as_keeping_nothing_do_not_count() -> None:
    from gradsafe.wgrad.markers import mark_hook_keeps_no_gradient

    leaf = torch.ones(2, requires_grad=True)

    def watcher(grad: torch.Tensor) -> None:
        pass

    mark_hook_keeps_no_gradient(watcher)
    leaf.register_hook(watcher)
    assert not has_tensor_hooks(leaf)  # e.g. gradsafe.wgrad's grad_added_to_main_grad watcher
    leaf.register_hook(lambda g: None)
    assert has_tensor_hooks(leaf)
