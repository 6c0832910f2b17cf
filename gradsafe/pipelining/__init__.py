"""Split backward for pipeline schedules that equals a fused backward on any graph.

``stage_backward_input`` (B) computes only the stage inputs' gradients and
returns a :class:`WeightGradHandoff`; ``stage_backward_weight`` (W) consumes it
and delivers every parameter's gradient through autograd's AccumulateGrad, so
parameter hooks fire once per W. ``gradsafe.patch("pipelining")`` installs the
three functions where ``torch.distributed.pipelining`` looks them up, and
the fixes to torch's schedule classes kept in :mod:`gradsafe.pipelining.schedule`
(stage metadata inference without side effects, H6; a weight several stages
of a rank share scaled once, H7; the stage call sites W needs changed).
:func:`verify` checks, on copies of a user's own stages, that the split gives
a fused backward's gradients (and shows what torch's own split gives).
"""

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
from gradsafe.pipelining._verify import ORDERS, verify
from gradsafe.pipelining._verify_report import VerifyReport
from gradsafe.pipelining.schedule._inference import MetadataInferenceError

__all__ = [
    "ORDERS",
    "GradientEdgeRootError",
    "GradientTypeError",
    "HandoffState",
    "MetadataInferenceError",
    "SplitBackwardError",
    "VerifyReport",
    "WeightGradHandoff",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
    "verify",
]
