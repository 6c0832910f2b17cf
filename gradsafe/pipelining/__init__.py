"""Split backward for pipeline schedules that equals a fused backward on any graph.

``stage_backward_input`` (B) computes only the stage inputs' gradients and
returns a :class:`WeightGradHandoff`; ``stage_backward_weight`` (W) consumes it
and delivers every parameter's gradient through autograd's AccumulateGrad, so
parameter hooks fire once per W. ``gradsafe.patch("pipelining")`` installs the
three functions where ``torch.distributed.pipelining`` looks them up.
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
from gradsafe.pipelining._inference import MetadataInferenceError
from gradsafe.pipelining._policy import CheckpointedWeights, checkpointed_weights
from gradsafe.pipelining._verify import ORDERS, verify
from gradsafe.pipelining._verify_report import VerifyReport

__all__ = [
    "ORDERS",
    "CheckpointedWeights",
    "GradientEdgeRootError",
    "GradientTypeError",
    "HandoffState",
    "MetadataInferenceError",
    "SplitBackwardError",
    "VerifyReport",
    "WeightGradHandoff",
    "checkpointed_weights",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
    "verify",
]
