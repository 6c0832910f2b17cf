"""What gradsafe's make_graphed_callables copies, and what it costs, per optimizer step.

Part 1 (any machine, counted under ``gradsafe.testing.emulate_cuda_graphs``
unless a GPU is present): clones and bytes cloned per optimizer step for
upstream (``ownership="never"``), ``"auto"`` and ``"always"``, with gradient
accumulation over 1, 4 and 16 microbatches, for ``zero_grad(set_to_none=True)``
(torch's default) and ``set_to_none=False``. Counted with a dispatch mode over
the steady-state steps (graph replays dispatch no ops, so only real copies
count), and expressed in parameter-sized copies: ``bytes cloned / parameter bytes``.

Part 2 (any machine, same counting): the copy budget case by case -- what
makes ``"auto"`` copy more than once per parameter per step (a Megatron-style
hook that clears ``.grad``, a tensor hook, a weight shared by two graphed
callables, an input produced by eager code) -- with the gradients checked
against the same model run eagerly in fp64.

Part 3 (GPU only): step time of a 12-layer transformer block stack, graphed
per layer, for the three policies, measured side by side in this process.

Run: ``PYTHONPATH=. python benchmarks/cuda_graphs_ownership.py``
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.cuda_graphs._hazards import CopyCounter
from gradsafe.testing import emulate_cuda_graphs

POLICIES = ("never", "auto", "always")
MICROBATCHES = (1, 4, 16)


def _layers(device: torch.device, n: int, width: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(width, width).to(device) for _ in range(n)]


def count_copies(
    device: torch.device, policy: str, microbatches: int, set_to_none: bool
) -> tuple[float, float, int, int]:
    """(clones per step, param-sized copies per step, #params, param bytes) over 2 steady steps."""
    width, batch = 64, 8
    layers = _layers(device, 4, width)
    params = [p for layer in layers for p in layer.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    samples = tuple((torch.randn(batch, width, device=device),) for _ in layers)
    # The first layer's sample input does not require grad; later layers' do (chained).
    samples = (samples[0],) + tuple((s[0].requires_grad_(),) for s in samples[1:])
    graphed = make_graphed_callables(tuple(layers), samples, ownership=policy)
    opt = torch.optim.SGD(params, lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=set_to_none)
        for _ in range(microbatches):
            h = torch.randn(batch, width, device=device)
            for layer in graphed:
                h = layer(h)
            h.pow(2).mean().backward()
        opt.step()

    step()  # first step: .grad is None for everyone, whatever set_to_none says
    steps = 2
    with CopyCounter() as counter:
        for _ in range(steps):
            step()
    return counter.clones / steps, counter.bytes / steps / param_bytes, len(params), param_bytes


def copy_table(device: torch.device) -> None:
    print("\n# copies per optimizer step (steady state, 4 chained Linear(64,64) layers, 8 params)")
    print(
        "set_to_none | microbatches | policy | clones/step | bytes cloned / parameter bytes, per step"
    )
    for set_to_none in (True, False):
        for mb in MICROBATCHES:
            for policy in POLICIES:
                clones, copies, _, _ = count_copies(device, policy, mb, set_to_none)
                print(
                    f"{set_to_none!s:>11} | {mb:>12} | {policy:>6} | {clones:>11.1f} | {copies:>8.2f}"
                )


# ---------------------------------------------------------------- part 2: the budget, case by case

WIDTH, BATCH, BUDGET_MICROBATCHES = 64, 8, 4


@dataclasses.dataclass
class Twin:
    """One model built twice from the same seed: graphed, and eager as the reference."""

    graphed_layers: list[torch.nn.Module]  # handed to make_graphed_callables
    eager_layers: list[torch.nn.Module]  # the same model, never graphed
    pre: tuple[
        torch.nn.Module | None, torch.nn.Module | None
    ]  # eager layer before the graphed ones
    params: tuple[
        list[torch.nn.Parameter], list[torch.nn.Parameter]
    ]  # unique, graphed / eager twin


def _build(kind: str, device: torch.device) -> Twin:
    def layers() -> tuple[list[torch.nn.Module], torch.nn.Module | None]:
        torch.manual_seed(0)
        pre = torch.nn.Linear(WIDTH, WIDTH).double().to(device) if kind == "eager input" else None
        n = 2 if kind == "tied" else 4
        ls = [torch.nn.Linear(WIDTH, WIDTH).double().to(device) for _ in range(n)]
        if kind == "tied":
            ls[1].weight = ls[0].weight  # one weight, two graphed callables
        return ls, pre

    def unique(ls: list[torch.nn.Module], pre: torch.nn.Module | None) -> list[torch.nn.Parameter]:
        seen: dict[int, torch.nn.Parameter] = {}
        for m in ([pre] if pre is not None else []) + ls:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    g_layers, g_pre = layers()
    e_layers, e_pre = layers()
    return Twin(
        g_layers, e_layers, (g_pre, e_pre), (unique(g_layers, g_pre), unique(e_layers, e_pre))
    )


def _install_hook(hook: str, params: list[torch.nn.Parameter]) -> list[object]:
    """Install ``hook`` on every parameter; returns what must stay referenced for the hooks to live."""
    keep: list[object] = []
    for p in params:
        if hook == "tensor hook":
            p.register_hook(lambda g: None)  # observes, keeps nothing
        elif hook == "megatron":
            # Megatron-core DDP: a post-hook on the AccumulateGrad node adds
            # .grad into main_grad and clears .grad.
            p.main_grad = torch.zeros_like(p)  # type: ignore[attr-defined]

            def consume(*_: object, p: torch.nn.Parameter = p) -> None:
                if p.grad is not None:
                    p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
                    p.grad = None

            # Megatron keeps the node: a new AccumulateGrad would not have the hook.
            node = p.expand_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            node.register_hook(consume)
            keep.append(node)
    return keep


@dataclasses.dataclass(frozen=True)
class BudgetCase:
    name: str
    kind: str  # model: "chain", "tied", "eager input"
    hook: str  # "none", "tensor hook", "megatron"
    set_to_none: bool


BUDGET_CASES = (
    BudgetCase("plain, zero_grad(set_to_none=True)", "chain", "none", True),
    BudgetCase("plain, zero_grad(set_to_none=False)", "chain", "none", False),
    BudgetCase("Megatron-style hook clears .grad", "chain", "megatron", False),
    BudgetCase("tensor hook on every parameter, set_to_none=False", "chain", "tensor hook", False),
    BudgetCase("weight shared by 2 graphed callables, set_to_none=True", "tied", "none", True),
    BudgetCase("weight shared by 2 graphed callables, set_to_none=False", "tied", "none", False),
    BudgetCase("input from an eager layer, set_to_none=False", "eager input", "none", False),
)


def measure_case(
    case: BudgetCase, policy: str, device: torch.device, microbatches: int = BUDGET_MICROBATCHES
) -> tuple[CopyCounter, int, bool]:
    """(clone counts over one steady-state step, parameter bytes, gradients equal the eager twin's)."""
    twin = _build(case.kind, device)
    g_params, e_params = twin.params
    samples = tuple(
        (
            torch.randn(
                BATCH,
                WIDTH,
                dtype=torch.float64,
                device=device,
                requires_grad=i > 0 or case.kind == "eager input",
            ),
        )
        for i in range(len(twin.graphed_layers))
    )
    graphed = make_graphed_callables(tuple(twin.graphed_layers), samples, ownership=policy)
    keep = _install_hook(case.hook, g_params) + _install_hook(case.hook, e_params)
    xs = [
        torch.randn(BATCH, WIDTH, dtype=torch.float64, device=device) for _ in range(microbatches)
    ]

    def step(
        layers: Sequence[Callable[[torch.Tensor], torch.Tensor]],
        pre: torch.nn.Module | None,
        params: list[torch.nn.Parameter],
    ) -> None:
        for p in params:
            if case.set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
            if case.hook == "megatron":
                p.main_grad.zero_()  # type: ignore[attr-defined]
        for x in xs:
            h = pre(x) if pre is not None else x
            for layer in layers:
                h = layer(h)
            h.pow(2).mean().backward()

    def result(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        return [p.main_grad if case.hook == "megatron" else p.grad for p in params]  # type: ignore[attr-defined,misc]

    g_pre, e_pre = twin.pre
    step(graphed, g_pre, g_params)  # first step: .grad is None for everyone
    step(twin.eager_layers, e_pre, e_params)
    with CopyCounter([p.shape for p in g_params]) as counter:
        step(graphed, g_pre, g_params)
    step(twin.eager_layers, e_pre, e_params)
    del keep
    right = all(
        torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(result(g_params), result(e_params))
    )
    graphed_param_bytes = sum(
        p.numel() * p.element_size()
        for p in g_params
        if all(p is not q for q in (g_pre.parameters() if g_pre else ()))
    )
    return counter, graphed_param_bytes, right


def budget_table(device: torch.device) -> None:
    print(
        f"\n# copy budget case by case: one steady-state optimizer step, {BUDGET_MICROBATCHES} microbatches, "
        f'Linear({WIDTH},{WIDTH}) layers in fp64, batch {BATCH}; "param copies" = bytes of parameter-shaped '
        'clones / bytes of the graphed callables\' parameters; "other" = activation-shaped bytes cloned; '
        '"right" = gradients (main_grad for Megatron) equal the eager twin\'s'
    )
    print("case | policy | clones/step | param copies/step | other bytes/step | right")
    for case in BUDGET_CASES:
        for policy in POLICIES:
            counter, param_bytes, right = measure_case(case, policy, device)
            print(
                f"{case.name} | {policy:>6} | {counter.clones:>3} | "
                f"{counter.param_shaped_bytes / param_bytes:5.2f} | "
                f"{counter.bytes - counter.param_shaped_bytes:>6} | {'yes' if right else 'NO'}"
            )


def _train_step(
    opt: torch.optim.Optimizer,
    xs: Sequence[torch.Tensor],
    graphed: Sequence[Callable[..., torch.Tensor]],
) -> None:
    """One optimizer step over ``xs`` as microbatches through the graphed layers."""
    opt.zero_grad(set_to_none=True)
    for x in xs:
        h = x
        for layer in graphed:
            h = layer(h)
        h.float().pow(2).mean().backward()
    opt.step()


def step_times(
    device: torch.device,
    d_model: int = 1024,
    n_layers: int = 12,
    seq: int = 512,
    batch: int = 8,
    microbatches: int = 4,
    repeats: int = 20,
) -> None:
    print(
        f"\n# step time, {n_layers} x TransformerEncoderLayer(d_model={d_model}), seq {seq}, "
        f"batch {batch}, {microbatches} microbatches, fp32, on {device}"
    )
    results: dict[str, list[float]] = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        layers = [
            torch.nn.TransformerEncoderLayer(
                d_model, 16, 4 * d_model, dropout=0.0, batch_first=True
            ).to(device)
            for _ in range(n_layers)
        ]
        params = [p for layer in layers for p in layer.parameters()]
        samples = tuple(
            (torch.randn(batch, seq, d_model, device=device, requires_grad=i > 0),)
            for i in range(n_layers)
        )
        graphed = make_graphed_callables(tuple(layers), samples, ownership=policy)
        opt = torch.optim.SGD(params, lr=1e-4)
        xs = [torch.randn(batch, seq, d_model, device=device) for _ in range(microbatches)]

        step = functools.partial(_train_step, opt, xs, graphed)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results[policy] = times
    base = statistics.median(results["never"])
    for policy in POLICIES:
        med = statistics.median(results[policy])
        print(f"{policy:>6}: median {med * 1e3:8.2f} ms/step  ratio vs upstream {med / base:.4f}")


def main() -> None:
    gpu = torch.cuda.is_available()
    print(
        f"torch {torch.__version__}, {platform.machine()}, {platform.processor() or 'cpu'}, "
        f"{'GPU ' + torch.cuda.get_device_name() if gpu else 'no GPU: copies counted under emulate_cuda_graphs'}"
    )
    with contextlib.nullcontext() if gpu else emulate_cuda_graphs():
        copy_table(torch.device("cuda" if gpu else "cpu"))
        budget_table(torch.device("cuda" if gpu else "cpu"))
    if gpu:
        step_times(torch.device("cuda"))
    else:
        print("\n# step time: not measured (no GPU on this machine)")


if __name__ == "__main__":
    main()
