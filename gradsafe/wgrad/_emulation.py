"""A small Megatron-style data-parallel emulation to check weight-gradient delivery end to end.

Used by ``gradsafe doctor`` and the tests. Like Megatron-core's DDP it keeps an
fp32 ``main_grad`` per parameter and hooks each parameter's AccumulateGrad node
(a Node post-hook): add ``.grad`` into ``main_grad`` unless
``grad_added_to_main_grad``, then clear ``.grad``. Parameters whose gradient
a delayed W pass owns get the same hook through the store instead, as
Megatron does for ``skip_backward_post_hook`` parameters.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from gradsafe.wgrad._policy import wgrad_return
from gradsafe.wgrad._store import GradReadyHook, WeightGradStore
from gradsafe.wgrad.example import ReturnPolicy, WgradRecorder, fused_linear
from gradsafe.wgrad.markers import grad_lifetime_is_managed, mark_delayed_wgrad

__all__ = ["CONFIGS", "Config", "DelayedStore", "EmulatedDDP", "Run", "reference", "run_config"]


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
        ``.grad`` None (on a GPU: on autograd's CPU thread). Megatron always sets
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


class _Pending(Protocol):
    def run(self) -> None: ...


class DelayedStore(WgradRecorder, Protocol):
    def seal(self) -> _Pending: ...

    def register_grad_ready_hook(self, param: torch.Tensor, hook: GradReadyHook) -> object: ...


@dataclasses.dataclass
class HookCall:
    thread: int
    grad_was_none: bool
    main_grad_after: torch.Tensor


class EmulatedDDP:
    """Megatron-style ``main_grad`` buffers and grad-ready hooks over ``params``."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        store: DelayedStore | None,
        *,
        honour_marks: bool = True,
    ) -> None:
        """``honour_marks=False`` hooks AccumulateGrad even for delayed parameters (a mistake)."""
        self.params = tuple(params)
        self.calls: dict[int, list[HookCall]] = {id(p): [] for p in self.params}
        self._handles: list[object] = []
        self._grad_accs: list[object] = []
        for p in self.params:
            # fp32 for low-precision parameters, as Megatron; the fp64 model here stays fp64.
            dtype = torch.promote_types(p.dtype, torch.float32)
            p.main_grad = torch.zeros_like(p, dtype=dtype)  # type: ignore[attr-defined]
            if honour_marks and grad_lifetime_is_managed(p):
                if store is None:
                    raise ValueError("a delayed-wgrad parameter needs the store to hook")
                self._handles.append(store.register_grad_ready_hook(p, self._hook_for(p)))
            else:
                view_fn = p.expand_as(p).grad_fn
                assert view_fn is not None  # p requires grad
                node = view_fn.next_functions[0][0]  # AccumulateGrad
                assert node is not None
                # A parameter holds its AccumulateGrad node only weakly: keep it (and
                # its hooks) alive, as Megatron does.
                self._grad_accs.append(node)
                hook = self._hook_for(p)
                self._handles.append(node.register_hook(lambda _gi, _go, hook=hook: hook()))

    def _hook_for(self, p: torch.nn.Parameter) -> Callable[..., None]:
        def hook(*_: object) -> None:
            grad_was_none = p.grad is None
            if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
                p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
            p.grad = None
            snapshot = p.main_grad.detach().clone()  # type: ignore[attr-defined]
            self.calls[id(p)].append(HookCall(threading.get_ident(), grad_was_none, snapshot))

        return hook

    def zero_grad(self) -> None:
        for p in self.params:
            p.main_grad.zero_()  # type: ignore[attr-defined]
            if hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            p.grad = None


@dataclasses.dataclass(frozen=True)
class Run:
    """What one configuration delivered, per parameter (in model order)."""

    main_grads: tuple[torch.Tensor, ...]
    calls: tuple[tuple[HookCall, ...], ...]
    driver_thread: int


def _model_params(seed: int = 0) -> tuple[torch.nn.Parameter, ...]:
    g = torch.Generator().manual_seed(seed)
    w1 = torch.nn.Parameter(torch.randn(5, 3, generator=g, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.randn(5, 5, generator=g, dtype=torch.float64) / 3)
    scale = torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))
    return w1, w2, scale


def _inputs(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in range(n)]


def _loss(
    x: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    w1, w2, scale = params
    h = torch.tanh(linear(x, w1))
    h = torch.tanh(linear(h, w2))
    h = linear(h, w2)  # w2 is tied across two uses
    return ((h * scale) ** 2).sum()


def _delayed_schedule(n: int) -> list[tuple[str, int]]:
    """B0 B1 W0 B2 W1 ... : each W one microbatch behind, like a zero-bubble pipeline."""
    steps: list[tuple[str, int]] = []
    for i in range(n):
        steps.append(("B", i))
        if i >= 1:
            steps.append(("W", i - 1))
    steps.append(("W", n - 1))
    return steps


def _finish(ddp: EmulatedDDP, params: Sequence[torch.nn.Parameter]) -> Run:
    return Run(
        tuple(p.main_grad.clone() for p in params),  # type: ignore[attr-defined]
        tuple(tuple(ddp.calls[id(p)]) for p in params),
        threading.get_ident(),
    )


def reference(microbatches: int = 4) -> Run:
    """Plain autograd (no fused kernel) under the same emulated DDP."""
    params = _model_params()
    ddp = EmulatedDDP(params, store=None)
    ddp.zero_grad()
    for x in _inputs(microbatches):
        _loss(x, params, lambda a, w: a @ w.t()).backward()
    return _finish(ddp, params)


def run_config(
    config: Config,
    *,
    microbatches: int = 4,
    policy: ReturnPolicy = wgrad_return,
    store_factory: Callable[[], DelayedStore] | None = None,
    ddp_honours_marks: bool = True,
) -> Run:
    """The same model with its two weights through :func:`fused_linear` in ``config``."""
    if store_factory is None:
        store_factory = WeightGradStore
    params = _model_params()
    weights = params[:2]
    store = store_factory() if config.delayed else None
    for w in weights:
        if config.has_flag:
            w.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        if config.delayed:
            mark_delayed_wgrad(w)
    ddp = EmulatedDDP(params, store, honour_marks=ddp_honours_marks)
    ddp.zero_grad()

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fused_linear(
            a, w, accumulate_into_main_grad=config.fused, wgrad_store=store, policy=policy
        )

    xs = _inputs(microbatches)
    if store is None:
        for x in xs:
            _loss(x, params, linear).backward()
        return _finish(ddp, params)
    pending: dict[int, _Pending] = {}
    for phase, i in _delayed_schedule(microbatches):
        if phase == "B":
            _loss(xs[i], params, linear).backward()
            pending[i] = store.seal()
        else:
            pending.pop(i).run()
    return _finish(ddp, params)


def compare(run: Run, ref: Run, *, hook_sees_grad: bool = True) -> list[str]:
    """Every way ``run`` differs from the reference, in words (empty: it matches).

    ``hook_sees_grad=False`` expects every hook call to see ``.grad`` None
    (see :attr:`Config.hook_sees_grad`) instead of never.
    """
    problems: list[str] = []
    names = ("w1", "w2 (tied)", "scale")
    for index, (name, got, want, calls, ref_calls) in enumerate(
        zip(names, run.main_grads, ref.main_grads, run.calls, ref.calls)
    ):
        if not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
            problems.append(f"{name}: main_grad wrong")
        if len(calls) != len(ref_calls):
            problems.append(f"{name}: {len(calls)} hook calls, plain backward gives {len(ref_calls)}")
        elif not all(
            torch.allclose(c.main_grad_after, r.main_grad_after, rtol=1e-9, atol=1e-12)
            for c, r in zip(calls, ref_calls)
        ):
            problems.append(f"{name}: a hook fired before its gradient was complete")
        if any(c.thread != run.driver_thread for c in calls):
            problems.append(f"{name}: hook ran on another thread")
        # ``scale`` is a plain autograd parameter: its hook always sees a gradient.
        expect_grad = hook_sees_grad or name == "scale"
        if any(c.grad_was_none == expect_grad for c in calls):
            problems.append(f"{name}: hook saw .grad {'None' if expect_grad else 'not None'}")
    return problems
