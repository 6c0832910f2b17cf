"""Test utilities for users' own tests.

:func:`emulate_cuda_graphs` runs CUDA-graph code (``torch.cuda.make_graphed_callables``,
``torch.cuda.graph``, ``torch.cuda.CUDAGraph``) on a CPU-only machine with the
static-memory semantics of real CUDA graphs, so graphed training loops can be
tested in CPU CI.
"""

from gradsafe.testing._cuda_emulation import (
    EmulatedCUDAGraph,
    EmulatedEvent,
    EmulatedStream,
    emulate_cuda_graphs,
)
from gradsafe.testing.megatron import GradReadyRegistry, HookCall, MegatronStyleDDP  # noqa: F401

__all__ = ["EmulatedCUDAGraph", "EmulatedEvent", "EmulatedStream", "emulate_cuda_graphs"]
