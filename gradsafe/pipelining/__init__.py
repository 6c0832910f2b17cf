"""Split backward for pipeline schedules that equals a fused backward on any graph.

``stage_backward_input`` (B) computes only the stage inputs' gradients and
returns a :class:`WeightGradHandoff`; ``stage_backward_weight`` (W) consumes it
and delivers every parameter's gradient through autograd's AccumulateGrad, so
parameter hooks fire once per W. ``gradsafe.patch("pipelining")`` installs the
three functions where ``torch.distributed.pipelining`` looks them up, and
the fixes to torch's schedule classes kept in :mod:`gradsafe.pipelining.schedule`
(stage metadata inference without side effects, H6; a weight several stages
of a rank share scaled once, H7; the stage call sites W needs changed).
The tool that checks this split on a user's own stages is
:mod:`gradsafe.verify` (``gradsafe.pipelining.verify``, ``ORDERS`` and
``VerifyReport`` still resolve there, with a ``DeprecationWarning``, until
0.4.0).
"""

from typing import Any

from gradsafe.pipelining._backward import (
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)
from gradsafe.pipelining._handoff import (
    GradientEdgeRootError,
    GradientTypeError,
    HandoffState,
    SplitBackwardError,
    WeightGradHandoff,
)
from gradsafe.pipelining._policy import CheckpointedWeights, checkpointed_weights
from gradsafe.pipelining.schedule._inference import MetadataInferenceError

__all__ = [
    "CheckpointedWeights",
    "GradientEdgeRootError",
    "GradientTypeError",
    "HandoffState",
    "MetadataInferenceError",
    "SplitBackwardError",
    "WeightGradHandoff",
    "checkpointed_weights",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
]

# Moved to gradsafe.verify (a tool on top of this package, which must not import it).
_MOVED_TO_VERIFY = ("ORDERS", "VerifyReport", "verify")


def __getattr__(name: str) -> Any:
    if name not in _MOVED_TO_VERIFY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    import gradsafe.verify
    from gradsafe._shared.deprecation import removal_notice

    warnings.warn(
        f"gradsafe.pipelining.{name} moved: use `from gradsafe.verify import {name}` "
        f"({removal_notice()}).",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(gradsafe.verify, name)
