"""``verify`` replaces ``torch.Tensor.register_hook`` while its forwards run: other threads are unaffected."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from gradsafe.verify import verify


def _batches() -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(3, 4, generator=generator),) for _ in range(2)]


def _identity(grad: torch.Tensor) -> torch.Tensor:
    return grad


def _hook_in_forward(during: Callable[[], object]) -> nn.Module:
    """A module that registers a tensor hook in forward and calls ``during`` right after.

    ``during`` lives on a class of its own: verify deep-copies the module, and
    a lock or thread cannot be copied.
    """

    class HookInForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            h.register_hook(_identity)
            during()
            return torch.tanh(h)

    return HookInForward()


def test_hooks_another_thread_registers_during_a_verify_are_neither_wrapped_nor_counted() -> None:
    seen: list[object] = []

    def other_thread() -> None:
        t = torch.zeros(2, requires_grad=True).clone()
        t.register_hook(_identity)
        seen.extend(t._backward_hooks.values())  # type: ignore[union-attr]

    def during() -> None:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join(timeout=30)

    torch.manual_seed(0)
    report = verify(_hook_in_forward(during), _batches(), orders=("w-after-b",))
    assert report.ok, str(report)
    assert seen and all(fn is _identity for fn in seen), seen
    counted = {h.label: h.fused for h in report.hooks if "registered in forward" in h.label}
    assert counted == {"tensor hook _identity (registered in forward)": 2}, report.hooks


def test_concurrent_verifies_count_their_own_hooks_and_leave_register_hook_restored() -> None:
    original = torch.Tensor.register_hook
    barrier = threading.Barrier(2, timeout=30)  # both threads inside a forward at once
    reports: dict[int, object] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            torch.manual_seed(i)
            reports[i] = verify(_hook_in_forward(barrier.wait), _batches(), orders=("w-after-b",))
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert torch.Tensor.register_hook is original
    for report in reports.values():
        assert report.ok, str(report)  # type: ignore[attr-defined]
        counted = {h.label: h.fused for h in report.hooks}  # type: ignore[attr-defined]
        assert counted == {"tensor hook _identity (registered in forward)": 2}, counted


def test_forward_phases_overlapping_on_two_threads_count_their_own_hooks_and_restore() -> None:
    from gradsafe.verify._hooks import HookCounter

    original = torch.Tensor.register_hook
    counters = [HookCounter(), HookCounter()]
    tensors = [torch.ones(2, requires_grad=True).clone() for _ in range(2)]
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:  # enters first, registers while both are inside, leaves first
        with counters[0].forward_phase():
            a_in.set()
            b_in.wait(30)
            tensors[0].register_hook(_identity)
        a_out.set()

    def second() -> None:
        a_in.wait(30)
        with counters[1].forward_phase():
            b_in.set()
            a_out.wait(30)
            tensors[1].register_hook(_identity)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert torch.Tensor.register_hook is original
    for t in tensors:
        t.sum().backward()
    label = "tensor hook _identity (registered in forward)"
    assert [dict(c.counts) for c in counters] == [{label: 1}, {label: 1}]
