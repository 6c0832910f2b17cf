"""What keeping mixed uses of one weight exact costs (issue 13.1).

A tied weight (vocabulary x hidden, fp32) used twice per backward: an
embedding lookup (plain autograd, a real gradient) and a fused output head
(``gradsafe.wgrad._hazards.repro_linear`` adding its wgrad into ``main_grad``),
under ``gradsafe.testing.MegatronStyleDDP``. Side by side in one process:

* gradsafe's policy: the flag is cleared when the embedding's gradient reaches
  AccumulateGrad, so the hook adds ``.grad`` (the embedding's gradient);
* the policy before (``unwatched_policy``): the flag stays set and the hook
  drops the embedding's gradient (wrong; shown for its time);
* both uses unfused (the head returns its wgrad; autograd sums the two);

and the same three with the head alone (no embedding use: nothing mixed), to
show what the watching costs where nothing is mixed. Prints medians, ratios,
and each variant's largest error relative to the unfused run.

Run: PYTHONPATH=. python benchmarks/wgrad_mixed.py
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from gradsafe.testing import MegatronStyleDDP, module_of
from gradsafe.wgrad import wgrad_return
from gradsafe.wgrad._hazards import ReturnPolicy, repro_linear, unwatched_policy

VOCAB, HIDDEN, TOKENS, REPS = 8192, 1024, 256, 40

VARIANTS: dict[str, tuple[bool, bool, ReturnPolicy]] = {
    # name: (embedding use, fused head, policy)
    "mixed: gradsafe": (True, True, wgrad_return),
    "mixed: flag always set (before)": (True, True, unwatched_policy),
    "mixed: both unfused": (True, False, wgrad_return),
    "head only: gradsafe": (False, True, wgrad_return),
    "head only: flag always set (before)": (False, True, unwatched_policy),
    "head only: unfused": (False, False, wgrad_return),
}


def step(
    w: torch.Tensor, ids: torch.Tensor, h: torch.Tensor, variant: tuple[bool, bool, ReturnPolicy]
) -> None:
    embedding, fused, policy = variant
    x = h + torch.nn.functional.embedding(ids, w) if embedding else h
    repro_linear(x, w, fuse=fused, store=None, policy=policy).pow(2).mean().backward()


def main() -> None:
    torch.manual_seed(0)
    init = torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5
    # One weight per variant: gradsafe's flag watcher, once registered on a
    # weight, would also correct the "before" policy on it.
    weights = {name: torch.nn.Parameter(init.clone()) for name in VARIANTS}
    ddps = [MegatronStyleDDP(module_of([w]), snapshots=False) for w in weights.values()]
    ids = torch.randint(0, VOCAB, (TOKENS,))
    h = torch.randn(TOKENS, HIDDEN)
    for name, variant in VARIANTS.items():
        step(weights[name], ids, h, variant)
    main_grads = {name: w.main_grad.clone() for name, w in weights.items()}  # type: ignore[attr-defined]
    errors = {}
    for name, grad in main_grads.items():
        ref = main_grads[
            "mixed: both unfused" if name.startswith("mixed") else "head only: unfused"
        ]
        errors[name] = ((grad - ref).abs().max() / ref.abs().max()).item()
    for name, variant in VARIANTS.items():
        step(weights[name], ids, h, variant)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(REPS):  # interleaved, so drift hits every variant alike
        for name, variant in VARIANTS.items():
            start = time.perf_counter()
            step(weights[name], ids, h, variant)
            times[name].append(time.perf_counter() - start)
    for ddp in ddps:
        ddp.remove()
    print(
        f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, CPU"
    )
    print(
        f"tied weight {VOCAB}x{HIDDEN} fp32 ({init.numel() * 4} bytes), {TOKENS} tokens, {REPS} reps, medians"
    )
    print(
        "rel. error: max |main_grad - the unfused run's| / max |the unfused run's|, after one step"
    )
    print(f"{'variant':38} {'median ms':>10} {'vs gradsafe':>11} {'rel. error':>10}")
    for name in VARIANTS:
        base = statistics.median(
            times["mixed: gradsafe" if name.startswith("mixed") else "head only: gradsafe"]
        )
        med = statistics.median(times[name])
        print(f"{name:38} {med * 1e3:10.2f} {med / base:11.2f} {errors[name]:10.3g}")
    main_grad, grad = torch.zeros_like(init), torch.randn_like(init)
    adds = []
    for _ in range(REPS):
        start = time.perf_counter()
        main_grad.add_(grad)
        adds.append(time.perf_counter() - start)
    print(
        f"the price when uses are mixed, one parameter-sized main_grad.add_(.grad) by the hook: "
        f"{statistics.median(adds) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
