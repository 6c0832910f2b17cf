"""The ``dtensor`` patch: every slot it replaces, listed in one place (``plan()``).

Targets, decided when ``gradsafe.patch("dtensor")`` is first applied:

* ``op_strategy_funcs[aten.new_empty_strided.default]`` and
  ``op_strategy_funcs[aten.new_empty.default]`` get torch 2.13's strategy for
  these ops, limited by :class:`~gradsafe.dtensor.FollowRule` to what the
  installed torch can accumulate into;
* where the propagator has a single-dim table (consulted first), the two ops'
  entries there are kept empty while the patch is active;
* ``torch.autograd._engine_run_backward`` (through which ``backward()`` and
  ``torch.autograd.grad`` start the engine) is wrapped so that each thread,
  and each accelerator's autograd thread, drops the sharding decisions it
  cached before the patch changed: torch keeps those caches per thread, and
  the applying thread can clear only its own.

Nothing is installed when a probe of the live propagator shows that upstream
already keeps placements through ``new_empty_strided`` + ``copy_``; the skip
reason then starts with "verified: upstream already keeps placements".
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from gradsafe.dtensor import _torch
from gradsafe.dtensor._probe import ProbeResult, probe_propagator
from gradsafe.dtensor._strategy import FollowRule
from gradsafe.patching import MISSING, AttrTarget, ItemTarget, Skip, Target

__all__ = ["StaleShardingCacheWarning", "after_change", "plan", "plan_for"]


class StaleShardingCacheWarning(RuntimeWarning):
    """gradsafe could not make an autograd thread drop sharding decisions cached before the patch."""


def _accelerator_devices(t_outputs: object, rest: tuple[object, ...]) -> list[torch.device]:
    # The roots and their gradients decide which autograd threads run the backward.
    # Runs at every backward: concrete sequence types, no allocation when all are on the CPU.
    found: list[torch.device] = []
    for group in (t_outputs, rest[0] if rest else ()):
        if isinstance(group, (tuple, list)):
            for tensor in group:
                if isinstance(tensor, torch.Tensor) and not tensor.is_cpu:
                    found.append(tensor.device)
    return found


class _ThreadCacheGuard:
    """Brings every backward's threads up to date with the latest change of the patch.

    ``changed()`` runs on the thread that applies or restores the patch, clears
    that thread's caches and starts a new epoch. The first backward a thread
    starts in a new epoch clears that thread's caches first (on the CPU,
    AccumulateGrad runs on the calling thread). For roots on an accelerator,
    AccumulateGrad runs on autograd's thread for that device instead; once per
    epoch and device, a one-element backward on that device clears that
    thread's caches from a hook that runs there.
    """

    def __init__(self) -> None:
        self._epoch = 0
        self._local = threading.local()
        self._devices_done: set[torch.device] = set()

    def changed(self) -> None:
        with _GUARD_LOCK:
            self._epoch += 1
            self._devices_done = set()
        _torch.clear_sharding_caches()
        self._local.epoch = self._epoch

    def engine_run_backward(self, t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._local, "epoch", None) != self._epoch:
            self._local.epoch = self._epoch
            _torch.clear_sharding_caches()
        for device in _accelerator_devices(t_outputs, args):
            if device in self._devices_done:
                continue
            with _GUARD_LOCK:
                if device in self._devices_done:
                    continue
                self._devices_done.add(device)
            self._clear_device_thread(device)
        return _torch.engine_run_backward(t_outputs, *args, **kwargs)

    @staticmethod
    def _clear_device_thread(device: torch.device) -> None:
        ran: list[int] = []

        def clear_here(grad_outputs: object) -> None:
            ran.append(threading.get_ident())
            _torch.clear_sharding_caches()

        with torch.enable_grad(), torch.inference_mode(False):
            leaf = torch.zeros((), device=device, requires_grad=True)
            out = leaf.clone()
            if out.grad_fn is None:
                raise RuntimeError(
                    f"gradsafe: no autograd node for a {device} tensor under enable_grad"
                )
            out.grad_fn.register_prehook(clear_here)
            # Goes through the wrapper again; this thread and device are already done.
            torch.autograd.grad(out, leaf, torch.ones((), device=device))
        if not ran:
            warnings.warn(
                f"gradsafe.patch('dtensor'): could not reach autograd's thread for {device}; "
                "DTensor sharding decisions it cached before the patch may still be used there "
                "(a Partial gradient then becomes a Replicate .grad through an all-reduce). "
                "Apply gradsafe.patch('dtensor') before the first backward to avoid this.",
                StaleShardingCacheWarning,
                stacklevel=4,
            )


_GUARD_LOCK = threading.Lock()
_GUARD = _ThreadCacheGuard()
_GUARDED_BACKWARD = _GUARD.engine_run_backward  # one object, recognisable as gradsafe's


def plan_for(found: ProbeResult) -> Sequence[Target] | Skip:
    """The patch's targets for a propagator that behaves as ``found`` says, or why none."""
    if found.keeps_placements:
        return Skip(
            "verified: upstream already keeps placements "
            "(probed new_empty(_strided) + copy_, Partial and Shard, 1-D and 2-D meshes)"
        )
    if found.copy_failures:
        # Not only for the reduce ops concerned: such a torch predates 2.11's
        # Partial arithmetic (2.10: Partial(sum) + 1 adds 1 on every rank), so
        # a Partial empty tensor would change what later ops compute.
        return Skip(
            "the installed torch's copy_ strategy redistributes a Partial source into a "
            f"Partial destination ({'; '.join(map(str, found.copy_failures))}); gradsafe "
            "does not change new_empty(_strided) on this torch"
        )
    rule = FollowRule(
        partial_reduce_ops=frozenset(found.accumulating_reduce_ops),
        uneven_strided=_torch.LOCAL_STRIDES_FOLLOW_LOCAL_SHAPE,
    )
    strategy = _torch.EmptyFactoryStrategy(rule)
    kept = ", ".join(sorted(rule.partial_reduce_ops)) or "none"
    targets: list[Target] = []
    for op in _torch.EMPTY_FACTORIES:
        targets.append(
            ItemTarget(
                f"DTensor sharding propagator op_strategy_funcs[{op}] "
                f"(keeps Shard, Replicate and Partial of reduce ops: {kept})",
                _torch.op_strategy_table,
                op,
                strategy,
            )
        )
        if _torch.single_dim_strategy_table() is not None:
            targets.append(
                ItemTarget(
                    f"DTensor sharding propagator op_single_dim_strategy_funcs[{op}] "
                    "(kept empty: consulted before op_strategy_funcs)",
                    _torch.single_dim_strategy_table,  # type: ignore[arg-type]
                    op,
                    MISSING,
                )
            )
    targets.append(AttrTarget(*_torch.BACKWARD_ENTRY, _GUARDED_BACKWARD))
    return tuple(targets)


@functools.cache
def plan() -> Sequence[Target] | Skip:
    # What the propagator does depends only on the installed torch, and the
    # first plan runs before gradsafe changes any table: probe once per
    # process, and give every later call the very same plan.
    return plan_for(probe_propagator())


def after_change() -> None:
    """After applying and after restoring: every thread drops its cached sharding decisions."""
    _GUARD.changed()
