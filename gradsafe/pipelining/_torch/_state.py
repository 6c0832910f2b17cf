"""torch state outside autograd: RNG, FSDP2's parameters, modules' tensors, device probes.

Private torch read here: FSDP2's per-module state (``FSDPParam``),
``torch.distributed.pipelining._backward``, a multi-stage schedule's action
order (``pipeline_order``, its actions' ``computation_type`` and ``sub_actions``),
``nn.Module._apply`` and ``torch._utils``' device probes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._utils

__all__ = [
    "RngStates",
    "apply_to_tensors",
    "device_probes_answer",
    "fsdp_counterparts",
    "fsdp_reducing_in_backward",
    "rng_states",
    "set_rng_states",
    "split_backward_module",
    "splits_backward",
]


@dataclasses.dataclass(frozen=True)
class RngStates:
    """The CPU generator's state, and every CUDA device's where CUDA is initialised."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None


def rng_states() -> RngStates:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
    return RngStates(torch.get_rng_state(), cuda)


def set_rng_states(states: RngStates) -> None:
    torch.set_rng_state(states.cpu)
    if states.cuda is not None:
        torch.cuda.set_rng_state_all(list(states.cuda))


def _fsdp_param_groups() -> Iterator[Any]:
    """Every FSDP2 parameter group alive (none without torch.distributed)."""
    try:
        from torch.distributed import _composable_state
    except ImportError:
        return
    for state_ref in list(_composable_state._module_state_mapping.values()):
        state = state_ref()
        # Newer FSDP2 keeps several parameter groups per module, older one.
        groups: Any = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [] if single is None else [single]
        yield from groups


def fsdp_counterparts() -> dict[int, torch.Tensor]:
    """For every FSDP2-managed parameter: id(sharded) -> unsharded and id(unsharded) -> sharded.

    FSDP2 swaps a module's parameters between a sharded DTensor and an unsharded
    tensor; a graph recorded while one was installed holds it, while
    ``module.parameters()`` may yield the other by the time B or W runs.
    """
    pairs: dict[int, torch.Tensor] = {}
    for group in _fsdp_param_groups():
        for fsdp_param in getattr(group, "fsdp_params", ()):
            sharded = getattr(fsdp_param, "sharded_param", None)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if isinstance(sharded, torch.Tensor) and isinstance(unsharded, torch.Tensor):
                pairs[id(sharded)] = unsharded
                pairs[id(unsharded)] = sharded
    return pairs


def fsdp_reducing_in_backward(weight_ids: set[int]) -> torch.Tensor | None:
    """A parameter (by id, sharded or unsharded) whose FSDP2 group reduces its gradients
    when the group's backward hook fires (``requires_gradient_sync`` on), or None.

    That hook fires when the gradient reaches the module's inputs: in B.
    """
    for group in _fsdp_param_groups():
        if not getattr(group, "reduce_grads", False):
            continue
        for fsdp_param in getattr(group, "fsdp_params", ()):
            sharded = getattr(fsdp_param, "sharded_param", None)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for param in (sharded, unsharded):
                if isinstance(param, torch.Tensor) and id(param) in weight_ids:
                    return sharded if isinstance(sharded, torch.Tensor) else param
    return None


def split_backward_module() -> types.ModuleType:
    """``torch.distributed.pipelining._backward`` as it is now: torch's split functions, or gradsafe's when patched."""
    return importlib.import_module("torch.distributed.pipelining._backward")


def apply_to_tensors(
    module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.nn.Module:
    """``fn`` applied to every parameter and buffer of ``module``, in place, as ``Module.to`` does."""
    return module._apply(fn)


@contextlib.contextmanager
def device_probes_answer(device_type: str, device_module: Any) -> Iterator[None]:
    """While inside, torch's accelerator probes report ``device_type`` and ``device_module``."""
    probes = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: device_type
    torch._utils._get_device_module = lambda device_type=None: device_module  # type: ignore[assignment]
    try:
        yield
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = probes


def splits_backward(schedule: Any) -> bool:
    """Whether ``schedule`` runs a backward as B then W (an input-gradient action in its order).

    A single-stage schedule runs every backward fused. A multi-stage
    schedule's ``pipeline_order`` (every rank's actions) is read for a
    ``BACKWARD_INPUT`` action, also inside an overlapped one (DualPipeV's);
    where no order can be read, it is taken to split.
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if isinstance(schedule, PipelineScheduleSingle):
        return False
    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(order, dict):
        return True
    pending = [a for actions in order.values() for a in actions if a is not None]
    while pending:
        action = pending.pop()
        if getattr(getattr(action, "computation_type", None), "name", None) == "BACKWARD_INPUT":
            return True
        pending += getattr(action, "sub_actions", None) or ()
    return False
