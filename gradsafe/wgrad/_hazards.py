"""H4, reproduced once: what a fused or delayed custom backward returns in the weight slot.

Used by ``gradsafe doctor`` (:data:`CHECKS`, and :data:`PROBES`: the behaviour of
torch the policy relies on), the tests and the benchmarks.
Nothing here is installed upstream code: the "upstream" side is a model of
TransformerEngine's policy as its source describes it (vanilla -> wgrad;
delayed -> None; fused into ``main_grad`` -> a cached full-size dummy if the
parameter has ``grad_added_to_main_grad``, else None; its delayed W without
fusion assigns ``.grad``). Both sides run the same small kernel
(:func:`repro_linear`, the policy injected) under
:class:`gradsafe.testing.MegatronStyleDDP`, against plain autograd in fp64:

* the six configurations of the table (a weight tied across two uses, four
  microbatches, delayed ones scheduled B0 B1 W0 B2 W1 B3 W2 W3);
* mixed uses of one weight in one backward (an embedding-style unfused use
  next to fused, unfused and delayed kernel uses).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from gradsafe._shared.megatron_ddp import HookCall, MegatronStyleDDP
from gradsafe.checks import Check, Outcome, Probe
from gradsafe.wgrad._policy import wgrad_return
from gradsafe.wgrad._store import GradReadyHook, WeightGradClosure, WeightGradStore
from gradsafe.wgrad._torch import graph_task_ids_differ
from gradsafe.wgrad.markers import mark_delayed_wgrad
from gradsafe.wgrad.megatron import module_of

__all__ = ["CHECKS", "PROBES"]

_TE_MODEL = "model of TransformerEngine's policy (not installed)"


# --- the kernel ---------------------------------------------------------------------------------


class ReturnPolicy(Protocol):
    """The signature of :func:`~gradsafe.wgrad.wgrad_return`."""

    def __call__(
        self,
        param: torch.Tensor,
        wgrad: torch.Tensor | None,
        *,
        accumulate_into_main_grad: bool,
        delayed: bool,
    ) -> torch.Tensor | None: ...


class Recorder(Protocol):
    """Where B records delayed weight-gradient work."""

    def record(
        self,
        param: torch.Tensor,
        compute: WeightGradClosure,
        *,
        accumulate_into_main_grad: bool,
        reads: Iterable[torch.Tensor] = (),
    ) -> None: ...


class Pending(Protocol):
    def run(self) -> None: ...


class DelayedStore(Recorder, Protocol):
    def seal(self) -> Pending: ...

    def register_grad_ready_hook(
        self, param: torch.Tensor, hook: GradReadyHook
    ) -> RemovableHandle: ...

    def awaits_w(self, param: torch.Tensor) -> bool: ...


class _ReproLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        fuse: bool,
        store: Recorder | None,
        policy: ReturnPolicy,
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight = weight  # the parameter itself: the store and hooks key on its identity
        ctx.fuse, ctx.store, ctx.policy = fuse, store, policy
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        weight: torch.Tensor = ctx.weight
        dgrad = grad_out @ weight

        def compute(main_grad: torch.Tensor | None) -> torch.Tensor | None:
            if main_grad is None:
                return grad_out.t() @ x
            main_grad.addmm_(grad_out.t().to(main_grad.dtype), x.to(main_grad.dtype))
            return None

        wgrad = None
        if ctx.store is not None:
            ctx.store.record(
                weight, compute, accumulate_into_main_grad=ctx.fuse, reads=(x, grad_out)
            )
        elif ctx.fuse:
            compute(weight.main_grad)  # type: ignore[attr-defined]
        else:
            wgrad = compute(None)
        returned = ctx.policy(
            weight, wgrad, accumulate_into_main_grad=ctx.fuse, delayed=ctx.store is not None
        )
        return dgrad, returned, None, None, None


def repro_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    fuse: bool,
    store: Recorder | None,
    policy: ReturnPolicy = wgrad_return,
) -> torch.Tensor:
    """``x @ weight.T``; its weight gradient is returned, fused into ``main_grad``, or recorded in ``store``."""
    return _ReproLinear.apply(x, weight, fuse, store, policy)


class Kernel(Protocol):
    """A weight-gradient kernel as the harness calls it (``examples/fused_linear.py`` fits)."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        *,
        accumulate_into_main_grad: bool,
        wgrad_store: Any,
    ) -> torch.Tensor: ...


def kernel_with(policy: ReturnPolicy) -> Kernel:
    def kernel(
        x: torch.Tensor, weight: torch.Tensor, *, accumulate_into_main_grad: bool, wgrad_store: Any
    ) -> torch.Tensor:
        return repro_linear(
            x, weight, fuse=accumulate_into_main_grad, store=wgrad_store, policy=policy
        )

    return kernel


# --- TransformerEngine's policy, modelled -------------------------------------------------------

_te_dummies: dict[tuple[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


def te_policy(
    param: torch.Tensor,
    wgrad: torch.Tensor | None,
    *,
    accumulate_into_main_grad: bool,
    delayed: bool,
) -> torch.Tensor | None:
    """TransformerEngine's return: delayed -> None; fused -> cached full-size dummy if flagged, else None."""
    if delayed:
        return None
    if not accumulate_into_main_grad:
        return wgrad
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    key = (tuple(param.shape), param.dtype, param.device)
    if key not in _te_dummies:  # one full-size zero buffer per shape, dtype and device
        _te_dummies[key] = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
    return _te_dummies[key]


class _TEPending:
    def __init__(
        self,
        uses: list[tuple[torch.Tensor, WeightGradClosure, bool]],
        hooks: dict[int, OrderedDict[int, GradReadyHook]],
    ) -> None:
        self._uses = uses
        self._hooks = hooks

    def run(self) -> None:
        params: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for param, compute, fused in self._uses:
                if fused:
                    compute(param.main_grad)  # type: ignore[attr-defined]
                    if hasattr(param, "grad_added_to_main_grad"):
                        param.grad_added_to_main_grad = True
                else:
                    param.grad = compute(None)  # overwrites: TransformerEngine's known bug
                params[id(param)] = param
            for key, param in params.items():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                for hook in self._hooks.get(key, {}).values():
                    hook(param)


class TEStyleStore:
    """TransformerEngine's delayed W, modelled: runs each use and assigns ``.grad``."""

    def __init__(self) -> None:
        self._uses: list[tuple[torch.Tensor, WeightGradClosure, bool]] = []
        self._hooks: dict[int, OrderedDict[int, GradReadyHook]] = {}

    def record(
        self,
        param: torch.Tensor,
        compute: WeightGradClosure,
        *,
        accumulate_into_main_grad: bool,
        reads: Iterable[torch.Tensor] = (),
    ) -> None:
        # TransformerEngine checks nothing at W: reads is ignored.
        self._uses.append((param, compute, accumulate_into_main_grad))

    def register_grad_ready_hook(self, param: torch.Tensor, hook: GradReadyHook) -> RemovableHandle:
        mark_delayed_wgrad(param)
        hooks = self._hooks.setdefault(id(param), OrderedDict())
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def seal(self) -> _TEPending:
        uses, self._uses = self._uses, []
        return _TEPending(uses, self._hooks)

    def awaits_w(self, param: torch.Tensor) -> bool:
        # TransformerEngine fires a delayed weight's hooks only in its W pass
        # (backward_dw): an undelayed use's gradient always waits for one.
        return True


def unwatched_policy(
    param: torch.Tensor,
    wgrad: torch.Tensor | None,
    *,
    accumulate_into_main_grad: bool,
    delayed: bool,
) -> torch.Tensor | None:
    """gradsafe's policy before mixed uses were handled: every fused call sets the flag and returns a dummy.

    A tied weight's unfused use is then summed into ``.grad`` behind a set
    flag, and the hook skips it.
    """
    if delayed:
        return None
    if not accumulate_into_main_grad:
        return wgrad
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    return torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)


GRADSAFE_KERNEL = kernel_with(wgrad_return)
TE_KERNEL = kernel_with(te_policy)


# --- the driver -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    """What one run delivered, per parameter (in model order)."""

    names: tuple[str, ...]
    main_grads: tuple[torch.Tensor, ...]
    calls: tuple[tuple[HookCall, ...], ...]
    driver_thread: int


def delayed_schedule(microbatches: int) -> list[tuple[str, int]]:
    """B0 B1 W0 B2 W1 ... : each W one microbatch behind, like a zero-bubble pipeline."""
    steps: list[tuple[str, int]] = []
    for i in range(microbatches):
        steps.append(("B", i))
        if i >= 1:
            steps.append(("W", i - 1))
    steps.append(("W", microbatches - 1))
    return steps


def _drive(
    names: Sequence[str],
    params: Sequence[torch.nn.Parameter],
    store: DelayedStore | None,
    losses: Sequence[Callable[[], torch.Tensor]],
    *,
    grad_added_flag: bool,
) -> Run:
    ddp = MegatronStyleDDP(
        module_of(params, store),
        delay_wgrad_compute=store is not None,
        grad_added_flag=grad_added_flag,
    )
    ddp.zero_grad_buffer()
    if store is None:
        for loss in losses:
            loss().backward()
    else:
        pending: dict[int, Pending] = {}
        for phase, i in delayed_schedule(len(losses)):
            if phase == "B":
                losses[i]().backward()
                pending[i] = store.seal()
            else:
                pending.pop(i).run()
    run = Run(
        tuple(names),
        tuple(p.main_grad.clone() for p in params),  # type: ignore[attr-defined]
        tuple(ddp.calls(p) for p in params),
        threading.get_ident(),
    )
    ddp.remove()
    return run


def compare(
    run: Run, ref: Run, *, hooks_see_grad: Sequence[bool], check_timing: bool = True
) -> list[str]:
    """Every way ``run`` differs from the plain-autograd reference, in words (empty: it matches).

    ``hooks_see_grad[i]``: whether parameter i's hook must see ``.grad`` (else
    it must see None). ``check_timing``: ``main_grad`` after each hook call must
    equal the reference's after the same call (no hook before its gradient
    is complete); off where B delivers an undelayed use's gradient that only
    the next W pass hands to the hook.
    """
    problems: list[str] = []
    for name, got, want, calls, ref_calls, sees in zip(
        run.names, run.main_grads, ref.main_grads, run.calls, ref.calls, hooks_see_grad
    ):
        if not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
            err = (got - want).abs().max().item()
            problems.append(f"{name}: main_grad wrong (max error {err:.3g})")
        if len(calls) != len(ref_calls):
            problems.append(
                f"{name}: {len(calls)} hook calls, plain backward gives {len(ref_calls)}"
            )
        elif check_timing and not all(
            c.main_grad_after is not None
            and r.main_grad_after is not None
            and torch.allclose(c.main_grad_after, r.main_grad_after, rtol=1e-9, atol=1e-12)
            for c, r in zip(calls, ref_calls)
        ):
            problems.append(f"{name}: a hook fired before its gradient was complete")
        if any(c.thread != run.driver_thread for c in calls):
            problems.append(f"{name}: hook ran on another thread")
        if any(c.grad_was_none == sees for c in calls):
            problems.append(f"{name}: hook saw .grad {'None' if sees else 'not None'}")
    return problems


# --- the six configurations -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One row of the wgrad-return table."""

    delayed: bool
    fused: bool
    has_flag: bool  # the parameter has ``grad_added_to_main_grad``

    @property
    def hook_sees_grad(self) -> bool:
        """Whether an AccumulateGrad hook sees a non-None ``.grad`` under the table.

        Not in the one row that returns None without delay (fused, no flag):
        without ``grad_added_to_main_grad`` nothing could tell a hook that a
        dummy must not be added, so nothing is returned, and the hook runs with
        ``.grad`` None. Megatron always sets
        the flag on its parameters, so its hooks never meet this row.
        """
        return self.delayed or not self.fused or self.has_flag

    def __str__(self) -> str:
        parts = ["delayed" if self.delayed else "now", "fused" if self.fused else "unfused"]
        if self.fused:
            parts.append("flag" if self.has_flag else "no-flag")
        return "/".join(parts)


CONFIGS: tuple[Config, ...] = (
    Config(delayed=False, fused=False, has_flag=False),
    Config(delayed=True, fused=False, has_flag=False),
    Config(delayed=False, fused=True, has_flag=False),
    Config(delayed=False, fused=True, has_flag=True),
    Config(delayed=True, fused=True, has_flag=False),
    Config(delayed=True, fused=True, has_flag=True),
)

_SIX_NAMES = ("w1", "w2 (tied)", "scale")


def _six_params() -> tuple[torch.nn.Parameter, ...]:
    g = torch.Generator().manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(5, 3, generator=g, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.randn(5, 5, generator=g, dtype=torch.float64) / 3)
    scale = torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))
    return w1, w2, scale


def _inputs(n: int, width: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, width, generator=g, dtype=torch.float64) for _ in range(n)]


def _six_loss(
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    w1, w2, scale = params
    h = torch.tanh(linear(x, w1))
    h = torch.tanh(linear(h, w2))
    h = linear(h, w2)  # w2 is tied across two uses
    return ((h * scale) ** 2).sum()


def _plain(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a @ w.t()


def reference(microbatches: int = 4) -> Run:
    """The six-configuration model in plain autograd (no fused kernel) under the same DDP."""
    params = _six_params()
    losses = [lambda x=x: _six_loss(x, params, _plain) for x in _inputs(microbatches, 3)]
    return _drive(_SIX_NAMES, params, None, losses, grad_added_flag=False)


def run_config(
    config: Config,
    *,
    microbatches: int = 4,
    kernel: Kernel = GRADSAFE_KERNEL,
    store_factory: Callable[[], DelayedStore] = WeightGradStore,
    mark_before_ddp: bool = True,
) -> Run:
    """The same model with both weights through ``kernel`` in ``config``.

    ``mark_before_ddp=False`` reproduces a wrapper that decided which node to
    hook before the delayed weights were marked (it hooks AccumulateGrad).
    """
    params = _six_params()
    weights = params[:2]
    store = store_factory() if config.delayed else None
    for w in weights:
        if config.has_flag:
            w.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        if config.delayed and mark_before_ddp:
            mark_delayed_wgrad(w)

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernel(a, w, accumulate_into_main_grad=config.fused, wgrad_store=store)

    losses = [lambda x=x: _six_loss(x, params, linear) for x in _inputs(microbatches, 3)]
    return _drive(_SIX_NAMES, params, store, losses, grad_added_flag=False)


def check_config(
    config: Config,
    *,
    ref: Run | None = None,
    kernel: Kernel = GRADSAFE_KERNEL,
    store_factory: Callable[[], DelayedStore] = WeightGradStore,
) -> list[str]:
    """:func:`run_config` against :func:`reference`, four microbatches: what differs, in words."""
    run = run_config(config, kernel=kernel, store_factory=store_factory)
    # ``scale`` is a plain autograd parameter: its hook always sees a gradient.
    sees = (config.hook_sees_grad, config.hook_sees_grad, True)
    return compare(run, ref if ref is not None else reference(), hooks_see_grad=sees)


# --- mixed uses of one weight ---------------------------------------------------------------------

Use = Literal["autograd", "now/unfused", "now/fused", "delayed/unfused", "delayed/fused"]
USES: tuple[Use, ...] = ("autograd", "now/unfused", "now/fused", "delayed/unfused", "delayed/fused")

# Each a case the doctor shows: the tied embedding + fused output head first.
MIXES: tuple[tuple[Use, ...], ...] = (
    ("autograd", "now/fused"),
    ("now/unfused", "now/fused"),
    ("autograd", "delayed/fused"),
    ("delayed/unfused", "delayed/fused"),
    ("now/fused", "now/fused", "autograd"),
    ("autograd", "now/fused", "delayed/fused", "delayed/unfused", "now/unfused"),
)

_MIX_NAMES = ("w (mixed)", "scale")
_WIDTH = 6


def _mixed_params() -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(_WIDTH, _WIDTH, generator=g, dtype=torch.float64) / 3)
    scale = torch.nn.Parameter(torch.randn(_WIDTH, generator=g, dtype=torch.float64))
    return w, scale


def _mixed_loss(
    x: torch.Tensor,
    ids: torch.Tensor,
    params: Sequence[torch.Tensor],
    uses: Sequence[Use],
    linear: Callable[[torch.Tensor, torch.Tensor, Use], torch.Tensor],
) -> torch.Tensor:
    w, scale = params
    h = x
    for use in uses:
        if use == "autograd":  # an embedding lookup of the same weight: plain autograd
            h = h + torch.nn.functional.embedding(ids, w)
        else:
            h = torch.tanh(linear(h, w, use))
    return ((h * scale) ** 2).sum()


def _mixed_data(microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(4, _WIDTH, generator=g, dtype=torch.float64),
            torch.randint(0, _WIDTH, (4,), generator=g),
        )
        for _ in range(microbatches)
    ]


def reference_mixed(uses: Sequence[Use], microbatches: int) -> Run:
    """The mixed-use model in plain autograd (every use a plain matmul or embedding)."""
    params = _mixed_params()
    losses = [
        lambda x=x, ids=ids: _mixed_loss(x, ids, params, uses, lambda a, w, _u: _plain(a, w))
        for x, ids in _mixed_data(microbatches)
    ]
    return _drive(_MIX_NAMES, params, None, losses, grad_added_flag=True)


def run_mixed(
    uses: Sequence[Use],
    microbatches: int,
    *,
    kernel: Kernel = GRADSAFE_KERNEL,
    store_factory: Callable[[], DelayedStore] = WeightGradStore,
    grad_added_flag: bool = True,
) -> Run:
    """One weight used in every way ``uses`` lists, in each backward, under Megatron-style hooks.

    ``grad_added_flag=False``: a wrapper without Megatron's flag.
    """
    params = _mixed_params()
    delayed = any(use.startswith("delayed") for use in uses)
    store = store_factory() if delayed else None
    if delayed:
        mark_delayed_wgrad(params[0])  # its hook goes to the store, as Megatron does

    def linear(a: torch.Tensor, w: torch.Tensor, use: Use) -> torch.Tensor:
        return kernel(
            a,
            w,
            accumulate_into_main_grad=use.endswith("/fused"),
            wgrad_store=store if use.startswith("delayed") else None,
        )

    losses = [
        lambda x=x, ids=ids: _mixed_loss(x, ids, params, uses, linear)
        for x, ids in _mixed_data(microbatches)
    ]
    return _drive(_MIX_NAMES, params, store, losses, grad_added_flag=grad_added_flag)


def check_mixed(
    uses: Sequence[Use],
    microbatches: int,
    *,
    kernel: Kernel = GRADSAFE_KERNEL,
    store_factory: Callable[[], DelayedStore] = WeightGradStore,
) -> list[str]:
    """:func:`run_mixed` against :func:`reference_mixed`: what differs, in words."""
    run = run_mixed(uses, microbatches, kernel=kernel, store_factory=store_factory)
    # Timing is only comparable where every use delivers in the same pass (B or W).
    one_pass = len({use.startswith("delayed") for use in uses}) == 1
    return compare(
        run,
        reference_mixed(uses, microbatches),
        hooks_see_grad=(True, True),
        check_timing=one_pass,
    )


# --- the doctor rows ------------------------------------------------------------------------------


def _six(kernel: Kernel, store_factory: Callable[[], DelayedStore]) -> Outcome:
    ref = reference()
    failing = []
    for config in CONFIGS:
        problems = check_config(config, ref=ref, kernel=kernel, store_factory=store_factory)
        if problems:
            failing.append(f"{config}: {problems[0]}")
    if failing:
        return Outcome(False, f"{len(failing)}/{len(CONFIGS)} configs fail: " + "; ".join(failing))
    return Outcome(
        True, f"{len(CONFIGS)}/{len(CONFIGS)} configs: main_grad, hook count, timing, thread"
    )


def _mixed(kernel: Kernel, store_factory: Callable[[], DelayedStore]) -> Outcome:
    failing = []
    for uses, microbatches in itertools.product(MIXES, (1, 4)):
        problems = check_mixed(uses, microbatches, kernel=kernel, store_factory=store_factory)
        if problems:
            failing.append(f"{'+'.join(uses)} x{microbatches}: {problems[0]}")
    total = 2 * len(MIXES)
    if failing:
        return Outcome(False, f"{len(failing)}/{total} mixes fail: " + "; ".join(failing))
    return Outcome(
        True, f"{total}/{total} mixes (1 and 4 microbatches): main_grad, hook count, thread"
    )


CHECKS = (
    Check(
        "H4 wgrad policy",
        "wgrad",
        lambda: _six(TE_KERNEL, TEStyleStore),
        lambda: _six(GRADSAFE_KERNEL, WeightGradStore),
        upstream_source=_TE_MODEL,
    ),
    Check(
        "H4 wgrad mixed uses of one weight",
        "wgrad",
        lambda: _mixed(TE_KERNEL, TEStyleStore),
        lambda: _mixed(GRADSAFE_KERNEL, WeightGradStore),
        upstream_source=_TE_MODEL,
    ),
)


PROBES = (
    Probe(
        "wgrad_return: one graph-task id per backward call",
        "wgrad",
        "every wgrad_return of a flagged parameter returns a zero dummy of its own (exact: "
        "zeros added; one transient parameter-sized buffer per call, not per backward)",
        graph_task_ids_differ,
    ),
)
