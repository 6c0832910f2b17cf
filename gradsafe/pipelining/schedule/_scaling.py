"""Gradient scaling at the end of a step, once per parameter however many stages of a rank hold it (H7).

A multi-stage schedule ends each stage's part of a step with that stage's
``scale_grads(n_microbatches)`` (through ``perform_reduce_grad``, right after
the stage's last backward), which divides the gradient of every parameter of
its module. A parameter two stages of one rank share -- the tied embedding and
head of a V-shaped schedule (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``),
where rank 0 holds the first and the last stage -- is divided once per stage,
and the last stage's division comes while the first stage's backwards are
still adding to it: neither the sum over microbatches nor its mean.

gradsafe records which parameters a multi-stage schedule's stages share
(:class:`SharedParameters`) when the schedule is built and again as each
``step`` starts (so a schedule built before ``gradsafe.patch()`` is covered,
and a step that raised part-way leaves nothing behind). A stage without a
module (``submod`` not an ``nn.Module``: schedule planners and torch's own
schedule tests build such stages to read ``pipeline_order``) holds no
parameter, as in torch's own checks of its stages, and its ``scale_grads`` is
torch's. A shared parameter is divided once,
by the ``scale_grads`` call that completes the set of stages holding it: all
of them have run their last backward, so the gradient is the step's sum. Every
other parameter is divided as torch does, when its stage asks.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "SHARED",
    "SharedParameters",
    "once_per_gradient",
    "registering_at_init",
    "registering_at_step",
]


def _parameters(stage: Any) -> Iterable[torch.Tensor]:
    """The parameters of ``stage``'s module; none where it has no module."""
    submod = getattr(stage, "submod", None)
    return submod.parameters() if isinstance(submod, nn.Module) else ()


class _Shared:
    """One parameter held by several stages: which of them asked for its division since the last one.

    Stages are held weakly: a dead stage leaves the set, and a new stage never
    joins one it was not registered in, whatever address it reuses.
    """

    def __init__(self, stages: Iterable[object]) -> None:
        self.stages: weakref.WeakSet[object] = weakref.WeakSet(stages)
        self.asked: weakref.WeakSet[object] = weakref.WeakSet()

    def ask(self, stage: object) -> bool:
        """Note ``stage``'s request; True when it completes the set (and starts the next step's)."""
        self.asked.add(stage)
        if all(s in self.asked for s in self.stages):
            self.asked = weakref.WeakSet()
            return True
        return False


class SharedParameters:
    """The parameters the stages of one rank's schedules share, registered per schedule."""

    def __init__(self) -> None:
        self._shared: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._lock = threading.Lock()

    def register(self, stages: Sequence[Any]) -> None:
        """Record which parameters several of ``stages`` (one schedule's) hold, none asked yet.

        The record of every parameter of ``stages`` is replaced, also where
        one stage holds it now: an earlier schedule's record (a stage reused
        with a partner that no longer holds the parameter, still alive) would
        make that stage wait for a partner this schedule never runs.
        """
        holders: dict[int, tuple[torch.Tensor, list[object]]] = {}
        for stage in stages:
            for param in _parameters(stage):
                holders.setdefault(id(param), (param, []))[1].append(stage)
        with self._lock:
            for param, holding in holders.values():
                if len(holding) > 1:
                    self._shared[param] = _Shared(holding)
                else:
                    self._shared.pop(param, None)

    def divide_now(self, param: torch.Tensor, stage: object) -> bool:
        """Whether ``stage``'s ``scale_grads`` divides ``param``'s gradient (False: another stage will)."""
        with self._lock:
            shared = self._shared.get(param)
            if shared is None or stage not in shared.stages:
                return True
            return shared.ask(stage)


#: The one registry: a parameter is shared on this rank whatever schedule saw it.
SHARED = SharedParameters()


def registering_at_init(original: Callable[..., None]) -> Callable[..., None]:
    """``PipelineScheduleMulti.__init__`` that then registers the parameters its stages share."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        SHARED.register(self._stages)

    return __init__


def registering_at_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """``PipelineScheduleMulti.step`` that first registers the parameters its stages share afresh."""

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        SHARED.register(self._stages)
        return original(self, *args, **kwargs)

    return step


def once_per_gradient(original: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
    """``_PipelineStageBase.scale_grads`` that divides a shared parameter once, after its last stage."""

    @functools.wraps(original)
    def scale_grads(self: Any, grad_scale_factor: int) -> None:
        if not isinstance(getattr(self, "submod", None), nn.Module):
            original(self, grad_scale_factor)
            return
        if grad_scale_factor == 1:
            return
        for param in self.submod.parameters():
            # Asked even without a gradient: the set of stages must complete.
            if SHARED.divide_now(param, self) and param.grad is not None:
                param.grad.div_(grad_scale_factor)

    return scale_grads
