"""One run of ``verify``: fresh copies of the stages, microbatches forwarded and backwarded in one order.

The events are those of a zero-bubble schedule on one rank: a microbatch's
forward through every stage, then its B stage by stage from the last, and
each W where the order puts it. A fused run does one backward per stage
instead of B and W. Every run starts from the same seed and forwards in the
same sequence, so dropout and other random ops draw the same numbers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.parameter import is_lazy

from gradsafe._shared.flops import MatmulFlops
from gradsafe._shared.live_storage import LiveStorage
from gradsafe.pipelining.inspection import apply_to_tensors, watching_unsplit
from gradsafe.verify import _graph_scan, _isolate
from gradsafe.verify._hooks import HookCounter, parameter_hooks
from gradsafe.wgrad.markers import grad_lifetime_is_managed

__all__ = [
    "ORDERS",
    "RunResult",
    "Split",
    "cast_module",
    "compare",
    "events",
    "projection_loss",
    "refuse_gradients_kept_elsewhere",
    "run",
]

ORDERS: dict[str, str] = {
    "w-after-b": "each W right after its B",
    "w-reversed": "every B first, then every W in reverse order",
    "w-lag-3": "W of microbatch k right after B of microbatch k+3 (DualPipeV's interleaving)",
}
_LAG = 3

LossFn = Callable[[Any, int], torch.Tensor]
_PROJECTION_SEED = 1234


@dataclasses.dataclass(frozen=True)
class Split:
    """A split-backward implementation: B, W, and the fused stage backward a schedule uses for a
    first stage whose inputs need no gradient."""

    backward_input: Callable[..., Any]
    backward_weight: Callable[..., Any]
    backward: Callable[..., Any]


@dataclasses.dataclass
class RunResult:
    params: dict[str, torch.Tensor | None]
    shapes: dict[str, tuple[int, ...]]
    inputs: dict[str, torch.Tensor | None]  # "stage s input i, microbatch k"
    counts: collections.Counter[str]
    error: BaseException | None = None
    where: str = ""
    timing: tuple[float, float] = (0.0, 0.0)  # backward wall, thread CPU
    peak_bytes: int | None = None  # most live storage created from the first forward on
    hazards: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    # "value of NAME after the run": how far each parameter moved from its initial
    # value, where it moved (absent: it did not; a lazy one's value itself). A hook that folds the
    # gradient into the parameter (an optimizer step in backward) leaves no .grad
    # to compare: a wrong gradient shows only here.
    values: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # With ``work``: backward matmul FLOPs per (event kind B / W / BW, stage), and those of
    # them run inside a module's forward (recomputation).
    flops: dict[tuple[str, int], int] | None = None
    recomputed_flops: dict[tuple[str, int], int] | None = None
    # Per stage, the torch.compile'd regions whose backward a B ran whole (compiled without
    # gradsafe's split): W gets none of their weight gradients.
    unsplit_compiled: dict[int, int] = dataclasses.field(default_factory=dict)


def refuse_gradients_kept_elsewhere(modules: Sequence[nn.Module]) -> None:
    """Raise if a parameter's gradient lives outside what verify compares (``.grad``).

    A delayed weight (``skip_backward_post_hook``) gets its gradient from a W pass of
    its own (a WeightGradStore's, TransformerEngine's), which no verify run calls: None
    in every run, it would compare equal unchecked. A parameter with ``main_grad``
    belongs to a Megatron-style data-parallel wrapper, whose hooks (read from the
    caller's parameters and run on the copies) act on the caller's parameter itself.
    """
    prefixes = [f"{s}." if len(modules) > 1 else "" for s in range(len(modules))]
    named = [
        (prefix + name, p)
        for prefix, module in zip(prefixes, modules)
        for name, p in module.named_parameters()
    ]
    delayed = [name for name, p in named if grad_lifetime_is_managed(p)]
    wrapped = [name for name, p in named if hasattr(p, "main_grad")]
    if delayed:
        raise ValueError(
            f"verify cannot check {_some(delayed)}: marked as delayed (skip_backward_post_hook), "
            "its weight gradient comes from a W pass of its own (a gradsafe.wgrad.WeightGradStore's, "
            "TransformerEngine's) that verify does not run, so it would be None in every run and "
            "compare equal unchecked. Build the stages for verify with the delay off (the kernel "
            "returning or fusing its weight gradient in B); gradsafe.wgrad's own checks cover the "
            "store's W pass."
        )
    if wrapped:
        raise ValueError(
            f"verify cannot check {_some(wrapped)}: it has a main_grad, so a Megatron-style "
            "data-parallel wrapper owns its gradient. Its hooks act on your parameter itself "
            "(they would add your .grad into your main_grad and clear it while verify runs on "
            "copies), and verify compares .grad, not main_grad. Verify the stages before wrapping "
            "them (and with gradient-accumulation fusion off)."
        )


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (and {len(names) - 4} more)" if len(names) > 4 else "")


def events(order: str | None, stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    """(kind, stage, microbatch) in run order; kind F (all stages), B, W, or BW (fused)."""
    out: list[tuple[str, int, int]] = []
    pending: list[tuple[int, int]] = []
    for k in range(microbatches):
        out.append(("F", 0, k))
        for s in reversed(range(stages)):
            if order is None:
                out.append(("BW", s, k))
            elif order == "w-after-b":
                out += [("B", s, k), ("W", s, k)]
            else:
                out.append(("B", s, k))
                pending.append((s, k))
        if order == "w-lag-3":
            while pending and pending[0][1] <= k - _LAG:
                out.append(("W", *pending.pop(0)))
    if order == "w-reversed":
        pending.reverse()
    return out + [("W", s, k) for s, k in pending]


# Module.to(float64) would cast a complex buffer (a RoPE cache) to real, dropping
# its imaginary part: complex tensors get the complex dtype of the same precision.
_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def cast_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with floating parameters and buffers in ``dtype``, complex ones in its complex
    counterpart (kept as they are for 16-bit dtypes), in place."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(dtype)
        if t.is_complex() and dtype in _COMPLEX:
            return t.to(_COMPLEX[dtype])
        return t

    return apply_to_tensors(module, cast)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _stage_input(value: Any, first: bool, alone: bool, dtype: torch.dtype) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if first:
        if not value.is_floating_point():
            return value.detach()
        return value.detach().to(dtype).requires_grad_(alone)
    return value.detach().requires_grad_(value.requires_grad)


def _output_grads(outputs: tuple[Any, ...], dinputs: Sequence[Any]) -> tuple[Any, ...]:
    """The gradients a stage's outputs receive: the next stage's input gradients, zeros if unused."""
    grads: list[Any] = []
    for out, grad in zip(outputs, dinputs):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            grads.append(torch.zeros_like(out) if grad is None else grad)
        else:
            grads.append(None)
    return tuple(grads)


def run(
    modules: Sequence[nn.Module],
    microbatches: Sequence[tuple[Any, ...]],
    loss_fn: LossFn | None,
    dtype: torch.dtype,
    split: Split | None,
    order: str | None,
    seed: int,
    find_hazards: bool = False,
    memory: bool = False,
    work: bool = False,
) -> RunResult:
    """Run ``order`` with ``split`` (None: fused) on fresh copies of ``modules``, from RNG seed ``seed``.

    With ``work``, ``flops`` holds each backward step's matmul FLOPs. With ``memory``, ``peak_bytes`` is the peak of the tensor storage created
    from the first forward on and still alive (activations, saved tensors,
    handoffs, gradients; not the copies' parameters). The caller's RNG state
    (CPU, and the CUDA devices the modules are on) is restored after.
    """
    devices = sorted(
        {p.device.index or 0 for m in modules for p in m.parameters() if p.device.type == "cuda"}
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return _run(modules, microbatches, loss_fn, dtype, split, order, find_hazards, memory, work)


def _run(
    modules: Sequence[nn.Module],
    microbatches: Sequence[tuple[Any, ...]],
    loss_fn: LossFn | None,
    dtype: torch.dtype,
    split: Split | None,
    order: str | None,
    find_hazards: bool,
    memory: bool,
    work: bool,
) -> RunResult:
    n = len(modules)
    prefixes = [f"{s}." if n > 1 else "" for s in range(n)]
    copies, loss_fn, copied_hooks = _fresh_copies(modules, loss_fn, dtype)
    counter = HookCounter()
    counter.instrument_copies(list(zip(prefixes, modules, copies)), copied_hooks)
    stage_params, held = _stage_parameters(loss_fn, copies, dtype)
    result = RunResult({}, {}, {}, counter.counts)
    if find_hazards and (hooked := _split_stage_names(counter.hooked, copies, prefixes)):
        result.hazards[_graph_scan.HOOKS_IN_W] = hooked
    inputs: dict[tuple[int, int], tuple[Any, ...]] = {}
    outputs: dict[tuple[int, int], Any] = {}
    dinputs: dict[tuple[int, int], tuple[Any, ...]] = {}
    handoffs: dict[tuple[int, int], Any] = {}
    step = ("", 0, 0)
    live = _storage_counter(copies, microbatches) if memory else None
    flops = MatmulFlops(forwards=True) if work else None
    clock = _BackwardClock(any(p.is_cuda for c in copies for p in c.parameters()), flops)
    try:
        with contextlib.nullcontext() if live is None else live:
            for step in events(order, n, len(microbatches)):
                kind, s, k = step
                if kind == "F":
                    _forward(copies, microbatches[k], k, loss_fn, dtype, counter, inputs, outputs)
                    if find_hazards and k == 0:
                        for hazard, params in _hazards(copies, prefixes, inputs, outputs).items():
                            result.hazards.setdefault(hazard, set()).update(params)
                    continue
                counter.in_backward = True
                with clock.timing(kind, s):
                    out, grads = _roots(s, k, n, outputs, dinputs, loss_fn is None)
                    args = inputs[s, k]
                    _backward(
                        kind, s, k, stage_params[s], split, args, out, grads, dinputs, handoffs
                    )
                counter.in_backward = False
    except Exception as exc:  # reported: a crash of the split under test is a finding
        result.error = exc
        result.where = f"{step[0]} of stage {step[1]}, microbatch {step[2]}"
        return result
    finally:
        counter.in_backward = False
    result.timing = (clock.wall, clock.cpu)
    result.unsplit_compiled = {s: len(regions) for s, regions in clock.unsplit.items() if regions}
    _record_work(result, flops)
    result.peak_bytes = None if live is None else live.peak
    _record_gradients(copies, prefixes, inputs, dinputs, result, held)
    _record_values(modules, copies, prefixes, result)
    return result


def _storage_counter(
    copies: Sequence[nn.Module], microbatches: Sequence[tuple[Any, ...]]
) -> LiveStorage:
    """Counts the storage a run creates: not the copies' parameters nor the microbatches."""
    existing: list[torch.Tensor] = [p for c in copies for p in c.parameters()]
    existing += [t for b in microbatches for t in b if isinstance(t, torch.Tensor)]
    return LiveStorage(existing)


def _stage_parameters(
    loss_fn: LossFn | None, copies: Sequence[nn.Module], dtype: torch.dtype
) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    """Each stage's parameters for its B and W, and (by path) those the loss copy holds of its
    own (a learned temperature), cast to ``dtype`` as the stages are: the last stage's B and W
    cover them too."""
    held = _isolate.loss_parameters(loss_fn, copies[-1])
    for p in held.values():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    stage_params: list[list[torch.Tensor]] = [list(c.parameters()) for c in copies]
    stage_params[-1] += held.values()
    return stage_params, held


def _split_stage_names(
    names: set[str], copies: Sequence[nn.Module], prefixes: Sequence[str]
) -> set[str]:
    """Of the parameters ``names`` (as the first stage holding each names it), those a split's W
    runs: not the first of several stages' own, which runs fused as a schedule runs it."""
    if len(copies) == 1:
        return set(names)
    later = {id(p) for c in copies[1:] for p in c.parameters()}
    first = {prefixes[0] + n: p for n, p in copies[0].named_parameters()}
    return {n for n in names if n not in first or id(first[n]) in later}


def _record_work(result: RunResult, flops: MatmulFlops | None) -> None:
    """The backward steps' FLOPs, and their recomputed part, into ``result`` (with ``work``)."""
    if flops is None:
        return
    # Forwards count under phase None, backward steps under (kind, stage): only those are kept.
    result.flops = {k: v for k, v in flops.counts.items() if isinstance(k, tuple)}
    result.recomputed_flops = {
        k: v for k, v in flops.in_forward_counts.items() if isinstance(k, tuple)
    }


class _BackwardClock:
    """Wall and CPU seconds summed over a run's backward steps, and per stage the compiled
    regions its steps ran whole (``unsplit``).

    Autograd runs CUDA nodes on a device thread: on CUDA the process's CPU time
    is counted, and the device is waited for so that wall time covers the kernels.
    """

    def __init__(self, cuda: bool, flops: MatmulFlops | None) -> None:
        self.wall = self.cpu = 0.0
        self._cpu_clock = time.process_time if cuda else time.thread_time
        self._sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        self.flops = flops  # with it, each step's matmul FLOPs, under (kind, stage)
        self.unsplit: dict[int, set[type]] = {}

    @contextlib.contextmanager
    def timing(self, kind: str, stage: int) -> Iterator[None]:
        """Adds the time of its block (not when the block raises: the run is then reported crashed)."""
        self._sync()
        if self.flops is not None:
            self.flops.phase = (kind, stage)
        started, started_cpu = time.perf_counter(), self._cpu_clock()
        # The FLOP counter is a dispatch mode: active only here, so that the forwards of
        # torch.compile'd blocks run compiled (dynamo runs a frame eagerly under a mode).
        counting = contextlib.nullcontext() if self.flops is None else self.flops
        with watching_unsplit() as whole, counting:
            yield
        self.unsplit.setdefault(stage, set()).update(whole)
        self.cpu += self._cpu_clock() - started_cpu  # before the wait: it may spin
        self._sync()
        self.wall += time.perf_counter() - started
        if self.flops is not None:
            self.flops.phase = None


def _fresh_copies(
    modules: Sequence[nn.Module], loss_fn: LossFn | None, dtype: torch.dtype
) -> tuple[list[nn.Module], LossFn | None, dict[int, Callable[..., Any]]]:
    """The stages, the loss and the parameters' hooks deep-copied together, cast to ``dtype``,
    without gradients: a parameter two stages share (tied embeddings on a V-shaped rank)
    stays shared, and a loss or hook closing over a stage's tensors closes over the copy's.
    Raises if a copy still reaches one of the caller's tensors (it would change them)."""
    hooks = parameter_hooks(modules)
    copies, loss_copy, copied = _isolate.copy_together(modules, loss_fn, hooks)
    caller = _isolate.caller_tensors(modules)
    _isolate.refuse_reaching_caller("loss_fn", [loss_copy], caller)
    _isolate.refuse_reaching_caller("a hook", copied.values(), caller)
    _isolate.refuse_reaching_caller("a stage's hook or attribute", copies, caller)
    copies = [cast_module(c, dtype) for c in copies]
    for c in copies:
        for p in c.parameters():
            p.grad = None
    return copies, loss_copy, copied


def _record_gradients(
    copies: Sequence[nn.Module],
    prefixes: Sequence[str],
    inputs: dict[tuple[int, int], tuple[Any, ...]],
    dinputs: dict[tuple[int, int], tuple[Any, ...]],
    result: RunResult,
    held: dict[str, Any],
) -> None:
    """Every parameter's gradient (the loss's ``held`` ones too), and each stage input's per
    microbatch, into ``result``."""
    for name, p in held.items():
        result.params[name] = None if p.grad is None else p.grad.detach().clone()
        result.shapes[name] = tuple(p.shape)
    for s, c in enumerate(copies):
        for name, p in c.named_parameters():
            if p.requires_grad:
                key = prefixes[s] + name
                result.params[key] = None if p.grad is None else p.grad.detach().clone()
                result.shapes[key] = tuple(p.shape)
    for (s, k), grads in sorted(dinputs.items()):
        for i, (value, grad) in enumerate(zip(inputs[s, k], grads)):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                key = f"stage {s} input {i}, microbatch {k}"
                result.inputs[key] = None if grad is None else grad.detach().clone()
                result.shapes[key] = tuple(value.shape)


def _record_values(
    modules: Sequence[nn.Module],
    copies: Sequence[nn.Module],
    prefixes: Sequence[str],
    result: RunResult,
) -> None:
    # The caller's tensors are unchanged by verify: cast, they are every run's start.
    # Parameters only: buffers change in forwards (BatchNorm's running statistics,
    # again in a checkpoint's recomputation), whose count is compared already, and
    # a first stage's recomputation moves to W's slot in any split schedule.
    for prefix, module, copied in zip(prefixes, modules, copies):
        starts = dict(module.named_parameters())
        for name, end in copied.named_parameters():
            key = f"value of {prefix}{name} after the run"
            final, start = end.detach(), starts.get(name)
            # A lazy module's parameters exist only in the copies: their value is compared.
            result.shapes[key] = tuple(final.shape)
            if start is None or is_lazy(start) or start.shape != final.shape:
                result.values[key] = final.clone()
                continue
            move = final - start.detach().to(final)
            if move.any():  # kept only where it moved: a model's worth of zeros per run else
                result.values[key] = move


def _forward(
    copies: Sequence[nn.Module],
    microbatch: tuple[Any, ...],
    k: int,
    loss_fn: LossFn | None,
    dtype: torch.dtype,
    counter: HookCounter,
    inputs: dict[tuple[int, int], tuple[Any, ...]],
    outputs: dict[tuple[int, int], Any],
) -> None:
    values = _as_tuple(microbatch)
    for s, stage in enumerate(copies):
        # A single stage's inputs get gradients (its B is what is checked); the
        # first of several stages gets none, as in a schedule (which runs it fused).
        args = tuple(_stage_input(v, s == 0, len(copies) == 1, dtype) for v in values)
        with counter.forward_phase():
            out = stage(*args)
            if s == len(copies) - 1 and loss_fn is not None:
                out = loss_fn(out, k)
        stop = {
            get_gradient_edge(a).node
            for a in args
            if isinstance(a, torch.Tensor) and a.requires_grad
        }
        roots = [
            t.grad_fn
            for t in _as_tuple(out)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        counter.instrument_graph(roots, stop)
        inputs[s, k], outputs[s, k] = args, out
        values = _as_tuple(out)


def _backward(
    kind: str,
    s: int,
    k: int,
    params: list[torch.Tensor],
    split: Split | None,
    args: tuple[Any, ...],
    out: tuple[Any, ...],
    grads: tuple[Any, ...] | None,
    dinputs: dict[tuple[int, int], tuple[Any, ...]],
    handoffs: dict[tuple[int, int], Any],
) -> None:
    if kind == "BW":
        pairs = [
            (o, torch.ones_like(o) if grads is None else grads[i])
            for i, o in enumerate(out)
            if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        dinputs[s, k] = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)
        return
    split = cast(Split, split)  # events() gives B and W only to a split run
    if kind == "W":
        handoff = handoffs.pop((s, k))
        if handoff is _FULL_IN_W:
            dinputs[s, k] = tuple(split.backward(out, grads, list(args)))
        else:
            split.backward_weight(iter(params), handoff)
        return
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        # As the schedule does for a first stage: no B, the whole backward in W's slot.
        handoffs[s, k] = _FULL_IN_W
        dinputs[s, k] = tuple(None for _ in args)
        return
    dinput, handoffs[s, k] = split.backward_input(out, grads, list(args), iter(params))
    dinputs[s, k] = tuple(dinput)


_FULL_IN_W = object()


def _roots(
    s: int,
    k: int,
    n: int,
    outputs: dict[tuple[int, int], Any],
    dinputs: dict[tuple[int, int], tuple[Any, ...]],
    project: bool,
) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
    """A stage's outputs (as the schedule passes them: a tuple) and their gradients (None: a loss)."""
    out = _as_tuple(outputs[s, k])
    if s < n - 1:
        return out, _output_grads(out, dinputs[s + 1, k])
    if not project:
        return out, None
    # No loss_fn: a fixed random projection of every output element, i.e.
    # seeded random output gradients (a loss would hide parameter-only outputs).
    return out, _projection(out, k)


def _projection(out: tuple[Any, ...], k: int) -> tuple[torch.Tensor | None, ...]:
    generator = torch.Generator().manual_seed(_PROJECTION_SEED + k)
    return tuple(
        torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.dtype).to(o.device)
        if isinstance(o, torch.Tensor) and o.requires_grad
        else None
        for o in out
    )


def projection_loss(output: Any, k: int) -> torch.Tensor:
    """The default loss as a scalar (a schedule needs one): the projection's output gradients."""
    out = _as_tuple(output)
    terms = [(o * w).sum() for o, w in zip(out, _projection(out, k)) if w is not None]
    if not terms:
        raise ValueError(
            "the last stage's output has no tensor requiring grad to project to a loss"
        )
    return torch.stack(terms).sum()


def _hazards(
    copies: Sequence[nn.Module],
    prefixes: Sequence[str],
    inputs: dict[tuple[int, int], tuple[Any, ...]],
    outputs: dict[tuple[int, int], Any],
) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for s, stage in enumerate(copies):
        names = {id(p): prefixes[s] + name for name, p in stage.named_parameters()}
        edges = [
            get_gradient_edge(t)
            for t in _as_tuple(outputs[s, 0])
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        stop = [
            get_gradient_edge(a).node
            for a in inputs[s, 0]
            if isinstance(a, torch.Tensor) and a.requires_grad
        ]
        if not stop:
            continue  # no stage input needs a gradient: the schedule runs this stage's backward fused
        for hazard, params in _graph_scan.find(edges, stop, names).items():
            found.setdefault(hazard, set()).update(params)
    return found


def compare(
    want: torch.Tensor | None, got: torch.Tensor | None, tol: float
) -> tuple[float | str, bool]:
    """Relative max error of ``got`` against ``want`` and whether it is within ``tol``.

    A missing gradient on one side only, or a shape or layout (sparse against
    dense) mismatch, is a "None pattern".
    Complex tensors are compared as complex (``double()`` would drop the
    imaginary part).
    """
    if (want is None) != (got is None):
        return "None pattern", False
    if want is None or got is None:
        return 0.0, True
    if got.shape != want.shape or got.layout != want.layout:
        return "None pattern", False
    # A sparse gradient (nn.Embedding(sparse=True)) has no max: compare its dense form.
    want, got = want.to_dense(), got.to_dense()
    wide = torch.complex128 if got.is_complex() or want.is_complex() else torch.float64
    diff = float((got.to(wide) - want.to(wide)).abs().max()) if want.numel() else 0.0
    scale = float(want.to(wide).abs().max()) if want.numel() else 0.0
    if math.isnan(diff):
        return float("nan"), False
    rel = diff / scale if scale > 0 else diff
    return rel, rel <= tol
