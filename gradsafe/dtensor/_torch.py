"""What ``gradsafe.dtensor`` needs from the installed torch, probed in this one place.

DTensor's sharding propagator keeps two strategy tables: ``op_strategy_funcs``
(whole-mesh strategies) and, on newer torch, ``op_single_dim_strategy_funcs``
(per-mesh-dimension strategies), which it consults *first*. Results are
memoised in a per-thread Python LRU cache and, on torch with the C++ dispatch
fast path, in a per-thread native cache. Everything version-dependent about
those pieces is answered here by looking at what exists, never at
``torch.__version__``.
"""

from __future__ import annotations

import inspect
from collections.abc import MutableMapping
from typing import Final, Hashable

import torch
from torch._ops import OpOverload
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor._utils import compute_local_stride

__all__ = [
    "EMPTY_FACTORIES",
    "LOCAL_STRIDES_FOLLOW_LOCAL_SHAPE",
    "clear_sharding_caches",
    "op_strategy_table",
    "propagator",
    "schema_info",
    "single_dim_strategy_table",
]

_aten = torch.ops.aten

#: The uninitialised factories whose strategy gradsafe replaces. Initialised
#: ones (new_zeros/new_ones/new_full) must stay Replicate for Partial inputs:
#: a Partial tensor of ones reduces to world_size.
EMPTY_FACTORIES: Final[tuple[OpOverload, ...]] = (
    _aten.new_empty_strided.default,
    _aten.new_empty.default,
)

#: Whether DTensor derives a shard's local strides from its local shape.
#: Older torch divides the global strides by the mesh size, which is only
#: right for evenly sharded dimensions; there an unevenly sharded
#: ``new_empty_strided`` output would get overlapping local strides.
LOCAL_STRIDES_FOLLOW_LOCAL_SHAPE: Final[bool] = (
    "local_shape" in inspect.signature(compute_local_stride).parameters
)


def propagator() -> ShardingPropagator:
    """The sharding propagator every DTensor operation goes through."""
    return DTensor._op_dispatcher.sharding_propagator


def op_strategy_table() -> MutableMapping[Hashable, object]:
    """``op -> strategy(OpSchema) -> OpStrategy``, consulted after the single-dim table."""
    return propagator().op_strategy_funcs  # type: ignore[return-value]


def single_dim_strategy_table() -> MutableMapping[Hashable, object] | None:
    """``op -> single-dim strategy``, or None on torch without that table."""
    return getattr(propagator(), "op_single_dim_strategy_funcs", None)


def schema_info(op: OpOverload) -> RuntimeSchemaInfo | None:
    """Which non-tensor arguments key the sharding cache for ``op`` (as dispatch looks it up)."""
    prop = propagator()
    found = prop.op_to_schema_info.get(op)
    if found is None:
        found = getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op)
    return found


def clear_sharding_caches() -> None:
    """Forget memoised sharding decisions so that a changed strategy takes effect.

    Clears the calling thread's Python LRU cache and native fast-path cache.
    Does what ``torch.distributed.tensor.debug._clear_sharding_prop_cache``
    does without importing that package, which needs numpy (not a torch
    dependency).
    """
    propagator().propagate_op_sharding.cache_clear()  # type: ignore[attr-defined]
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
