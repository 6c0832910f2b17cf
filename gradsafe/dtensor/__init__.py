"""DTensor-aware layout contract for autograd gradients.

When AccumulateGrad cannot steal an incoming gradient (its strides differ
from the parameter's, something else references it, or ``create_graph=True``)
it builds ``.grad`` as ``grad.new_empty_strided(param.size(), param.stride())
.copy_(grad)``. On torch whose DTensor strategy gives that empty tensor
Replicate placements (up to 2.12), a Partial gradient is all-reduced by the
``copy_``: one unwanted collective per backward and a Replicate ``.grad``
where Partial was produced. ``gradsafe.patch("dtensor")`` gives ``new_empty``
and ``new_empty_strided`` torch 2.13's semantics there (see docs/dtensor.md
for exactly what changes).

Example::

    import gradsafe
    gradsafe.patch("dtensor")  # or: with gradsafe.patch("dtensor"): train()
"""

from gradsafe.dtensor._patch import StaleShardingCacheWarning
from gradsafe.dtensor._probe import ProbeFailure, ProbeResult, probe_propagator
from gradsafe.dtensor._strategy import FollowRule

__all__ = [
    "FollowRule",
    "ProbeFailure",
    "ProbeResult",
    "StaleShardingCacheWarning",
    "probe_propagator",
]
