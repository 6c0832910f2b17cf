"""Test utilities for users' own tests.

* :func:`emulate_cuda_graphs` runs CUDA-graph code (``torch.cuda.make_graphed_callables``,
  ``torch.cuda.graph``, ``torch.cuda.CUDAGraph``) on a CPU-only machine with the
  static-memory semantics and the strictness of real CUDA graphs, so graphed
  training loops can be tested in CPU CI.
* :class:`MegatronStyleDDP` registers Megatron-core's per-parameter
  gradient hooks (``main_grad`` accumulation, ``grad_added_to_main_grad``,
  ``.grad`` cleared, delayed parameters routed through their module) on a
  model, so a custom kernel's weight-gradient return can be tested against
  them without Megatron.
* :func:`assert_split_exact` asserts that gradsafe's split backward (the B/W
  of zero-bubble schedules) gives a fused backward's gradients on a model.
* :class:`LiveStorage` counts the tensor storage alive operator by operator
  (and its peak), on any device, so memory conditions can be tested.
* :class:`MatmulFlops` counts the FLOPs of matmuls, convolutions and attention
  per phase (B, W) where ``FlopCounterMode`` cannot run: around a split
  backward and a checkpoint's recomputation.
"""

from gradsafe._shared.flops import MatmulFlops
from gradsafe._shared.live_storage import LiveStorage
from gradsafe._shared.megatron_ddp import HookCall, MegatronStyleDDP
from gradsafe.testing._cuda_emulation import (
    EmulatedCUDAGraph,
    EmulatedEvent,
    EmulatedStream,
    emulate_cuda_graphs,
)
from gradsafe.verify import assert_split_exact
from gradsafe.wgrad.megatron import module_of

__all__ = [
    "EmulatedCUDAGraph",
    "EmulatedEvent",
    "EmulatedStream",
    "HookCall",
    "LiveStorage",
    "MatmulFlops",
    "MegatronStyleDDP",
    "assert_split_exact",
    "emulate_cuda_graphs",
    "module_of",
]
