"""Split backward for pipeline schedules that equals a fused backward on any graph.

``stage_backward_input`` (B) computes only the stage inputs' gradients and
returns a :class:`WeightGradHandoff`; ``stage_backward_weight`` (W) consumes it
and delivers every parameter's gradient through autograd's AccumulateGrad, so
parameter hooks fire once per W. ``gradsafe.patch("pipelining")`` installs the
three functions where ``torch.distributed.pipelining`` looks them up.
"""

from gradsafe.pipelining._backward import (
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)
from gradsafe.pipelining._handoff import HandoffState, SplitBackwardError, WeightGradHandoff

__all__ = [
    "HandoffState",
    "SplitBackwardError",
    "WeightGradHandoff",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
]
