"""The ``pipelining`` patch: every slot it replaces, listed in one place (``plan()``).

``torch.distributed.pipelining.stage`` imports the three functions by name, so
they are replaced both where torch defines them and where the stage looks
them up. ``_IR`` also imports ``stage_backward`` but only compares it by
identity in traced graphs, so it is left alone.

Before replacing anything, :func:`plan` checks two things about the installed
torch and turns a mismatch into a skip with the reason: the autograd features
gradsafe's W relies on, and how ``stage.py`` calls the three functions (names
imported, arguments passed), so that a changed call site is reported instead
of silently receiving gradsafe's functions with other arguments.

Where ``PipelineStage`` infers output metadata with a forward of its module
(torch 2.13+), that method is wrapped to run a DDP module's forward under
``no_sync``: see :func:`gradsafe.pipelining.schedule._stage.inference_without_ddp_prepare`.

A last stage's view outputs are kept for ``step()``'s merge detached, so that
they do not keep the microbatch's graph until the next step (gradsafe's W frees
no saved tensor): see :func:`gradsafe.pipelining.schedule._stage.merge_without_view_graphs`.

Stage metadata inference is made free of side effects (hazard H6, see
:mod:`gradsafe.pipelining.schedule._inference`) wherever the installed torch has it,
found by the methods it defines (:func:`_inference_targets`): a schedule-wide
inference (``_PipelineSchedule._initialize_pp_stages``) with per-stage forward
and backward inference and inputs made from metadata (2.13+), or a per-stage
forward-only ``_shape_inference`` (2.11).

The end-of-step gradient scaling divides a parameter several stages of one
rank share once, after the last of them (hazard H7, see
:mod:`gradsafe.pipelining.schedule._scaling`): a multi-stage schedule registers what
its stages share when built and as each ``step`` starts, and each stage's
``scale_grads`` asks.

:data:`PROBES` are the behaviours of torch the split relies on, with what
gradsafe does where one differs; ``gradsafe doctor`` runs them.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from gradsafe.checks import Probe
from gradsafe.patching import AttrTarget, Skip, Target
from gradsafe.pipelining import _backward, _compiled, _torch
from gradsafe.pipelining.schedule import _inference, _scaling, _stage

__all__ = ["PROBES", "plan"]

_DEFINED_IN = "torch.distributed.pipelining._backward"
_CALLED_FROM = "torch.distributed.pipelining.stage"

_OURS: dict[str, Callable[..., Any]] = {
    "stage_backward_input": _backward.stage_backward_input,
    "stage_backward_weight": _backward.stage_backward_weight,
    "stage_backward": _backward.stage_backward,
}
_SCHEDULES = "torch.distributed.pipelining.schedules"
_METADATA_INFERENCE = "_forward_metadata_inference"
# Where torch runs stages to infer their metadata: per schedule (2.13+), per
# stage (2.13+: forward and backward; 2.11: _shape_inference, forward only),
# and the stage method that materialises an input from metadata (2.13+).
_SCHEDULE_INFERENCE = "_initialize_pp_stages"
_STAGE_INFERENCE = (_METADATA_INFERENCE, "_backward_metadata_inference", "_shape_inference")
_FROM_METADATA = "_to_tensor"
# Keeps a last stage's outputs for the merge at the end of step().
_FORWARD_CHUNK = "forward_one_chunk"
# Called per stage at the end of a step to divide by n_microbatches (H7).
_SCALE_GRADS = "scale_grads"
# The stage must call these (zero-bubble schedules go through them).
_REQUIRED_CALLS = ("stage_backward_input", "stage_backward_weight")


PROBES: tuple[Probe, ...] = (
    Probe(
        "split backward's autograd features",
        "pipelining",
        "the pipelining patch is skipped (torch's own split runs) and gradsafe's "
        "stage_backward_input refuses, naming the feature",
        _torch.missing_feature,
    ),
    Probe(
        "IN_W: checkpoint holders unpack twice from one recomputation",
        "pipelining",
        "CheckpointedWeights.IN_W runs as IN_B (exact; B computes checkpointed ops' weight "
        "gradients), warning once",
        _torch.unpack_twice_unsupported,
    ),
    Probe(
        "RECOMPUTE_IN_W: a new checkpoint group recomputes alike",
        "pipelining",
        "CheckpointedWeights.RECOMPUTE_IN_W runs as IN_B (exact), warning once",
        _torch.recompute_alike_unsupported,
    ),
    Probe(
        "compiled regions: AOTAutograd's backward compiler takes the split's graphs",
        "pipelining",
        "torch.compile'd regions run their backward whole in B (exact; W gets none of their "
        "weight gradients), warning once per region, and zero-bubble schedules keep torch's "
        "refusal of compiled stages",
        _torch.compiled_split_unsupported,
    ),
)


def _call_site_mismatch(stage: Any, backward: Any) -> str | None:
    """How ``stage.py`` calling the split functions differs from what gradsafe's accept, if it does."""
    for name in _OURS:
        if getattr(stage, name, None) is not getattr(backward, name, None):
            return (
                f"{_CALLED_FROM}.{name} is not {_DEFINED_IN}.{name}: the stage no longer imports "
                "it by name, so replacing it could not take effect where the schedule calls it"
            )
    try:
        tree = ast.parse(inspect.getsource(stage))
    except (OSError, TypeError, SyntaxError) as exc:
        return (
            f"cannot read {_CALLED_FROM}'s source to check how it calls the split functions ({exc})"
        )
    seen: set[str] = set()
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            continue
        name = call.func.id
        if name not in _OURS:
            continue
        seen.add(name)
        where = f"{_CALLED_FROM} line {call.lineno}"
        if any(isinstance(a, ast.Starred) for a in call.args) or any(
            k.arg is None for k in call.keywords
        ):
            return f"{where} calls {name} with *args/**kwargs, which gradsafe cannot check"
        keywords = [k.arg for k in call.keywords if k.arg is not None]
        signature = inspect.signature(_OURS[name])
        try:
            signature.bind(*call.args, **dict.fromkeys(keywords))
        except TypeError as exc:
            return (
                f"{where} calls {name} with {len(call.args)} positional argument(s) and keywords "
                f"{keywords}, which gradsafe's {name}({', '.join(signature.parameters)}) does not "
                f"accept ({exc})"
            )
    missing = [name for name in _REQUIRED_CALLS if name not in seen]
    if missing:
        return f"{_CALLED_FROM} no longer calls {', '.join(missing)}, so the split backward moved"
    return None


def plan() -> Sequence[Target] | Skip:
    import torch.distributed.pipelining._backward as backward
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    mismatch = _torch.missing_feature() or _call_site_mismatch(stage, backward)
    if mismatch is not None:
        return Skip(mismatch)
    targets: list[Target] = [
        AttrTarget(module, name, replacement)
        for module in (_DEFINED_IN, _CALLED_FROM)
        for name, replacement in _OURS.items()
    ]
    forward_chunk = vars(stage._PipelineStageBase).get(_FORWARD_CHUNK)
    if forward_chunk is not None:
        targets.append(
            AttrTarget(
                _CALLED_FROM,
                f"_PipelineStageBase.{_FORWARD_CHUNK}",
                _stage.merge_without_view_graphs(forward_chunk),
            )
        )
    return [
        *targets,
        *_inference_targets(stage, schedules),
        *_scaling_targets(stage, schedules),
        *_compiled_targets(schedules),
    ]


def _compiled_targets(schedules: Any) -> list[Target]:
    """Split compiled regions' backwards (B: input gradients, W: weight gradients), where the
    installed AOTAutograd has what the split wraps; then zero-bubble schedules take compiled stages."""
    import importlib

    if _torch.compiled_split_unsupported() is not None:
        return []  # compiled regions run whole in B, announced there; the doctor's probe says why
    aot = importlib.import_module(_torch.AOT_MODULE)
    stage2 = getattr(aot, _torch.STAGE2)
    targets: list[Target] = [
        AttrTarget(_torch.AOT_MODULE, _torch.STAGE2, _compiled.splitting_stage2(stage2))
    ]
    targets += [
        AttrTarget(_torch.AOT_MODULE, name, _compiled.no_autograd_cache)
        for name in _torch.CACHE_SWITCHES
    ]
    module, name = _torch.COMPILE_CHECK
    check = getattr(schedules, name, None)
    if check is not None:
        targets.append(AttrTarget(module, name, _compiled.zero_bubble_compile_check(check)))
    return targets


def _inference_targets(stage: Any, schedules: Any) -> list[Target]:
    """The wrappers that make this torch's stage metadata inference side-effect free."""
    stage_cls = vars(stage.PipelineStage)
    targets: list[Target] = []
    schedule_wide = vars(schedules._PipelineSchedule).get(_SCHEDULE_INFERENCE)
    if schedule_wide is not None:
        targets.append(
            AttrTarget(
                _SCHEDULES,
                f"_PipelineSchedule.{_SCHEDULE_INFERENCE}",
                _inference.around_schedule_inference(schedule_wide),
            )
        )
    for name in _STAGE_INFERENCE:
        method = stage_cls.get(name)
        if method is None:
            continue
        wrapped = _inference.around_stage_inference(method)
        if name == _METADATA_INFERENCE:
            # For a DDP module the inference forward, outside no_sync, leaves the
            # reducer prepared, and gradsafe's W (which fires DDP's hooks) then fails.
            wrapped = _stage.inference_without_ddp_prepare(wrapped)
        targets.append(AttrTarget(_CALLED_FROM, f"PipelineStage.{name}", wrapped))
    to_tensor = stage_cls.get(_FROM_METADATA)
    if to_tensor is not None:
        targets.append(
            AttrTarget(
                _CALLED_FROM,
                f"PipelineStage.{_FROM_METADATA}",
                _inference.zero_filled_inputs(to_tensor),
            )
        )
    return targets


def _scaling_targets(stage: Any, schedules: Any) -> list[Target]:
    """Divide a parameter that several stages of a rank share once per step (hazard H7)."""
    scale_grads = vars(stage._PipelineStageBase).get(_SCALE_GRADS)
    multi = vars(schedules.PipelineScheduleMulti)
    if scale_grads is None or "__init__" not in multi or "step" not in multi:
        return []
    return [
        AttrTarget(
            _SCHEDULES,
            "PipelineScheduleMulti.__init__",
            _scaling.registering_at_init(multi["__init__"]),
        ),
        AttrTarget(
            _SCHEDULES, "PipelineScheduleMulti.step", _scaling.registering_at_step(multi["step"])
        ),
        AttrTarget(
            _CALLED_FROM,
            f"_PipelineStageBase.{_SCALE_GRADS}",
            _scaling.once_per_gradient(scale_grads),
        ),
    ]
