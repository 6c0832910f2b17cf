"""Doctor row for ``wgrad``: the six wgrad-return configurations end to end.

There is nothing to patch (kernels call :func:`gradsafe.wgrad.wgrad_return`),
so the row is built directly: "upstream" runs the example fused Linear with
TransformerEngine's current choices (hazards.md H4), "gradsafe" with
gradsafe's policy and :class:`~gradsafe.wgrad.WeightGradStore`, both under
the emulated Megatron-style DDP hook, four microbatches, a tied weight.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch.utils.hooks import RemovableHandle

from gradsafe.doctor import Check, Outcome
from gradsafe.wgrad._emulation import CONFIGS, Config, compare, reference, run_config
from gradsafe.wgrad._store import GradReadyHook, WgradClosure
from gradsafe.wgrad.markers import mark_delayed_wgrad

__all__ = ["CHECKS"]

_te_dummies: dict[tuple[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


def _te_policy(
    param: torch.Tensor,
    wgrad: torch.Tensor | None,
    *,
    accumulated_into_main_grad: bool,
    delayed: bool,
) -> torch.Tensor | None:
    """TransformerEngine's return: delayed -> None; fused -> cached dummy if flagged, else None."""
    if delayed:
        return None
    if not accumulated_into_main_grad:
        return wgrad
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    key = (tuple(param.shape), param.dtype, param.device)
    if key not in _te_dummies:  # one full-size zero buffer per shape, dtype and device
        _te_dummies[key] = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
    return _te_dummies[key]


class _TEStyleStore:
    """TransformerEngine's delayed W: runs each use and assigns ``.grad`` (the known bug)."""

    def __init__(self) -> None:
        self._uses: list[tuple[torch.Tensor, WgradClosure, bool]] = []
        self._hooks: dict[int, OrderedDict[int, GradReadyHook]] = {}

    def record(
        self, param: torch.Tensor, compute: WgradClosure, *, accumulate_into_main_grad: bool
    ) -> None:
        self._uses.append((param, compute, accumulate_into_main_grad))

    def register_grad_ready_hook(self, param: torch.Tensor, hook: GradReadyHook) -> RemovableHandle:
        mark_delayed_wgrad(param)
        hooks = self._hooks.setdefault(id(param), OrderedDict())
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def seal(self) -> _TEStyleStore._Pending:
        uses, self._uses = self._uses, []
        return _TEStyleStore._Pending(uses, self._hooks)

    class _Pending:
        def __init__(
            self,
            uses: list[tuple[torch.Tensor, WgradClosure, bool]],
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
                        param.grad = compute(None)  # overwrites: the bug
                    params[id(param)] = param
                for key, param in params.items():
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    for hook in self._hooks.get(key, {}).values():
                        hook(param)


def _six(gradsafe: bool) -> Outcome:
    ref = reference()
    failing: list[str] = []
    for config in CONFIGS:
        if gradsafe:
            run = run_config(config)
        else:
            run = run_config(config, policy=_te_policy, store_factory=_TEStyleStore)
        problems = compare(run, ref, hook_sees_grad=config.hook_sees_grad)
        if problems:
            failing.append(f"{config}: {problems[0]}")
    if failing:
        return Outcome(False, f"{len(failing)}/6 configs fail: " + "; ".join(failing))
    return Outcome(True, "6/6 configs: main_grad, hook count, timing, thread")


def _upstream() -> Outcome:
    return _six(gradsafe=False)


def _with_gradsafe() -> Outcome:
    return _six(gradsafe=True)


CHECKS = (Check("H4 wgrad policy", "wgrad", _upstream, _with_gradsafe),)
