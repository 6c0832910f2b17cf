"""What the fused-into-main_grad weight slot costs, per choice of returned gradient.

Backward of one fused Linear under a Megatron-style AccumulateGrad hook (adds
``.grad`` unless ``grad_added_to_main_grad``, then frees it), side by side in
one process. Choices: gradsafe's zero-stride dummy, a TransformerEngine-style
cached full-size zero buffer, a fresh ``zeros_like`` per call, and (for
scale) returning the real wgrad without fusion. Prints medians relative to
gradsafe's dummy, the bytes each choice keeps alive between steps, the bytes
of the ``.grad`` AccumulateGrad hands the hook (transient: the hook frees it),
and whether that ``.grad`` is the returned buffer itself (stolen).

Run: PYTHONPATH=. python benchmarks/wgrad_dummy.py
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from gradsafe.wgrad import dummy_wgrad, fused_linear, wgrad_return

N_IN, N_OUT, TOKENS, REPS = 2048, 2048, 64, 60
SEEN: list[tuple[int, int]] = []  # (.grad bytes, .grad data_ptr) per hook call
_cached_full: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}


def te_cached(param: torch.Tensor) -> torch.Tensor:
    key = (tuple(param.shape), param.dtype)
    if key not in _cached_full:
        _cached_full[key] = torch.zeros(param.shape, dtype=param.dtype)
    return _cached_full[key]


def fresh(param: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(param)


def policy_with(make: Callable[[torch.Tensor], torch.Tensor]):  # type: ignore[no-untyped-def]
    def policy(param, wgrad, *, accumulated_into_main_grad, delayed):  # type: ignore[no-untyped-def]
        if accumulated_into_main_grad and not delayed:
            param.grad_added_to_main_grad = True
            return make(param)
        return wgrad_return(
            param, wgrad, accumulated_into_main_grad=accumulated_into_main_grad, delayed=delayed
        )

    return policy


def setup() -> tuple[torch.nn.Parameter, torch.Tensor]:
    w = torch.nn.Parameter(torch.randn(N_OUT, N_IN))
    w.main_grad = torch.zeros_like(w)
    w.grad_added_to_main_grad = False
    node = w.expand_as(w).grad_fn.next_functions[0][0]

    def hook(*_: object) -> None:
        SEEN.append((w.grad.untyped_storage().nbytes(), w.grad.data_ptr()))
        if w.grad is not None and not w.grad_added_to_main_grad:
            w.main_grad.add_(w.grad)
        w.grad = None

    node.register_hook(hook)
    w._keep = node  # the parameter holds its AccumulateGrad node only weakly
    return w, torch.randn(TOKENS, N_IN)


def step(w: torch.Tensor, x: torch.Tensor, fused: bool, policy) -> None:  # type: ignore[no-untyped-def]
    fused_linear(x, w, accumulate_into_main_grad=fused, policy=policy).sum().backward()


def main() -> None:
    torch.manual_seed(0)
    variants = {
        "gradsafe dummy (zero-stride)": (True, policy_with(dummy_wgrad)),
        "TE-style cached full buffer": (True, policy_with(te_cached)),
        "fresh zeros_like": (True, policy_with(fresh)),
        "unfused, return wgrad": (False, wgrad_return),
    }
    w, x = setup()
    for fused, policy in variants.values():
        for _ in range(3):
            step(w, x, fused, policy)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(REPS):  # interleaved, so drift hits every variant alike
        for name, (fused, policy) in variants.items():
            start = time.perf_counter()
            step(w, x, fused, policy)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["gradsafe dummy (zero-stride)"])
    kept = {
        "gradsafe dummy (zero-stride)": dummy_wgrad(w).untyped_storage().nbytes(),
        "TE-style cached full buffer": te_cached(w).untyped_storage().nbytes(),
        "fresh zeros_like": 0,
        "unfused, return wgrad": 0,
    }
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, CPU")
    print(f"Linear {N_IN}->{N_OUT} fp32, {TOKENS} tokens, weight {w.numel() * 4} bytes, {REPS} reps")
    returned = {
        "gradsafe dummy (zero-stride)": dummy_wgrad(w).data_ptr(),
        "TE-style cached full buffer": te_cached(w).data_ptr(),
    }
    header = f"{'variant':32} {'median ms':>10} {'ratio':>6} {'kept bytes':>11} {'.grad bytes':>11} stolen"
    print(header)
    for name, (fused, policy) in variants.items():
        SEEN.clear()
        step(w, x, fused, policy)
        (grad_bytes, grad_ptr), = SEEN
        stolen = "-" if name not in returned else str(grad_ptr == returned[name])
        med = statistics.median(times[name])
        print(f"{name:32} {med * 1e3:10.2f} {med / base:6.2f} {kept[name]:11d} {grad_bytes:11d} {stolen}")


if __name__ == "__main__":
    main()
