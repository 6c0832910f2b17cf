"""DTensor-aware layout contract for autograd gradients.

When AccumulateGrad cannot steal an incoming gradient (its strides differ
from the parameter's, something else references it, or ``create_graph=True``)
it builds ``.grad`` as ``grad.new_empty_strided(param.size(), param.stride())
.copy_(grad)``. On torch whose DTensor strategy gives that empty tensor
Replicate placements, a Partial gradient is all-reduced by the ``copy_``: one
unwanted collective per backward and a Replicate ``.grad`` where Partial was
produced. ``gradsafe.patch("dtensor")`` makes ``new_empty`` and
``new_empty_strided`` keep the input's placements when the shape is unchanged.

Example::

    import gradsafe
    gradsafe.patch("dtensor")  # or: with gradsafe.patch("dtensor"): train()
"""

from gradsafe.dtensor._probe import ProbeResult, probe_propagator
from gradsafe.dtensor._strategy import can_follow, empty_factory_strategy

__all__ = ["ProbeResult", "can_follow", "empty_factory_strategy", "probe_propagator"]
