"""What the fused-into-main_grad weight slot costs, per choice of returned gradient (issue 13.2).

Backward of one fused Linear (``gradsafe.wgrad._hazards.repro_linear``) under
``gradsafe.testing.MegatronStyleDDP`` (adds ``.grad`` unless
``grad_added_to_main_grad``, then frees it), side by side in one process.
Choices: gradsafe's zero-stride dummy with its own element per call, the
shared element gradsafe used before (one per dtype and device: a hook's
``fill_`` on it corrupted every later dummy), a TransformerEngine-style cached
full-size zero buffer, a fresh ``zeros_like`` per call, and (for scale)
returning the real wgrad without fusion.

Prints medians relative to gradsafe's dummy, the bytes each choice keeps alive
between steps and allocates per call, the bytes of the ``.grad``
AccumulateGrad hands the hook (transient: the hook frees it), whether that
``.grad`` is the returned buffer itself (stolen), and the cost of making one
dummy on its own.

Run: PYTHONPATH=. python benchmarks/wgrad_dummy.py
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from gradsafe.testing import MegatronStyleDDP, module_of
from gradsafe.wgrad import dummy_wgrad, wgrad_return
from gradsafe.wgrad._hazards import ReturnPolicy, repro_linear, te_policy

N_IN, N_OUT, TOKENS, REPS, CALLS = 2048, 2048, 64, 60, 20000

_shared = torch.zeros(())


def shared_element(param: torch.Tensor) -> torch.Tensor:
    return _shared.expand(param.shape)


def fresh_full(param: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(param)


def flagging(make: Callable[[torch.Tensor], torch.Tensor]) -> ReturnPolicy:
    def policy(param, wgrad, *, accumulate_into_main_grad, delayed):  # type: ignore[no-untyped-def]
        if accumulate_into_main_grad and not delayed:
            param.grad_added_to_main_grad = True
            return make(param)
        return wgrad_return(
            param, wgrad, accumulate_into_main_grad=accumulate_into_main_grad, delayed=delayed
        )

    return policy


VARIANTS: dict[str, tuple[bool, ReturnPolicy]] = {
    "gradsafe dummy (own element)": (True, wgrad_return),
    "shared element (before)": (True, flagging(shared_element)),
    "TE-style cached full buffer": (True, te_policy),
    "fresh zeros_like": (True, flagging(fresh_full)),
    "unfused, return wgrad": (False, wgrad_return),
}
BASE = "gradsafe dummy (own element)"


def step(w: torch.Tensor, x: torch.Tensor, fused: bool, policy: ReturnPolicy) -> None:
    repro_linear(x, w, fuse=fused, store=None, policy=policy).sum().backward()


def inspect(
    w: torch.Tensor, x: torch.Tensor, fused: bool, policy: ReturnPolicy
) -> tuple[int, int, bool]:
    """(bytes behind the returned gradient, .grad bytes the hook sees, .grad is that buffer)."""
    returned: list[torch.Tensor | None] = []
    seen: list[tuple[int, int]] = []

    def recording(param, wgrad, *, accumulate_into_main_grad, delayed):  # type: ignore[no-untyped-def]
        returned.append(
            policy(
                param, wgrad, accumulate_into_main_grad=accumulate_into_main_grad, delayed=delayed
            )
        )
        return returned[-1]

    handle = w.register_post_accumulate_grad_hook(
        lambda p: seen.append((p.grad.untyped_storage().nbytes(), p.grad.data_ptr()))
    )
    step(w, x, fused, recording)
    handle.remove()
    out = returned[0]
    ((grad_bytes, grad_ptr),) = seen
    out_bytes = 0 if out is None else out.untyped_storage().nbytes()
    return out_bytes, grad_bytes, out is not None and grad_ptr == out.data_ptr()


def per_call_us(make: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        make(w)
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(N_OUT, N_IN))
    ddp = MegatronStyleDDP(module_of([w]), snapshots=False)
    x = torch.randn(TOKENS, N_IN)
    for fused, policy in VARIANTS.values():
        for _ in range(3):
            step(w, x, fused, policy)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(REPS):  # interleaved, so drift hits every variant alike
        for name, (fused, policy) in VARIANTS.items():
            start = time.perf_counter()
            step(w, x, fused, policy)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times[BASE])
    kept = {
        BASE: 0,
        "shared element (before)": _shared.untyped_storage().nbytes(),
        "TE-style cached full buffer": te_policy(
            w, None, accumulate_into_main_grad=True, delayed=False
        )
        .untyped_storage()
        .nbytes(),  # type: ignore[union-attr]
        "fresh zeros_like": 0,
        "unfused, return wgrad": 0,
    }
    print(
        f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, CPU"
    )
    print(
        f"Linear {N_IN}->{N_OUT} fp32, {TOKENS} tokens, weight {w.numel() * 4} bytes, {REPS} reps, medians"
    )
    print("returned B: storage behind what the weight slot returns; allocated per call unless kept")
    print(
        f"{'variant':30} {'median ms':>10} {'ratio':>6} {'kept B':>9} {'returned B':>10} {'.grad B':>9} stolen"
    )
    for name, (fused, policy) in VARIANTS.items():
        out_bytes, grad_bytes, stolen = inspect(w, x, fused, policy)
        med = statistics.median(times[name])
        print(
            f"{name:30} {med * 1e3:10.2f} {med / base:6.2f} {kept[name]:9d} "
            f"{out_bytes:10d} {grad_bytes:9d} {stolen}"
        )
    ddp.remove()
    own, shared = per_call_us(dummy_wgrad, w), per_call_us(shared_element, w)
    print(
        f"making one dummy, {CALLS} calls: own element {own:.2f} us, shared element {shared:.2f} us "
        f"(+{own - shared:.2f} us, +{dummy_wgrad(w).element_size()} bytes per call)"
    )


if __name__ == "__main__":
    main()
