"""What gradsafe's own tools read of a stage's graph and of torch's state, named for them.

The ``gradsafe verify`` tool (:mod:`gradsafe.verify`) is a client of this
package, not part of it: it reads the stage graph's structure (to name the H1
variants a graph holds), the hooks torch keeps on tensors, nodes and modules
(to count their calls), the compiled regions a B ran whole (to say why W
is empty), and a few helpers for torch's state. This module is
the one place it reaches into pipelining for them. It is provisional: these
names follow gradsafe's internals and are not covered by the deprecation
policy.
"""

from gradsafe.pipelining._compiled import watching_unsplit
from gradsafe.pipelining._graph import StageGraph, analyze
from gradsafe.pipelining._policy import current_policy
from gradsafe.pipelining._torch import (
    apply_to_tensors,
    device_probes_answer,
    is_python_node,
    module_backward_hook_dicts,
    multi_grad_hook_codes,
    tensor_hook_dicts,
)

__all__ = [
    "StageGraph",
    "analyze",
    "apply_to_tensors",
    "current_policy",
    "device_probes_answer",
    "is_python_node",
    "module_backward_hook_dicts",
    "multi_grad_hook_codes",
    "tensor_hook_dicts",
    "watching_unsplit",
]
