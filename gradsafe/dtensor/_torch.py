"""Every private piece of torch that ``gradsafe.dtensor`` touches, in this one module.

DTensor's sharding propagator keeps two strategy tables: ``op_strategy_funcs``
(whole-mesh strategies) and, on newer torch, ``op_single_dim_strategy_funcs``
(per-mesh-dimension strategies), which it consults *first*. Results are
memoised per thread, in a Python LRU cache and, on torch with the C++
dispatch fast path, in a native cache. Everything version-dependent about
those pieces is answered here by looking at what exists, never at
``torch.__version__``. So are the other private pieces gradsafe.dtensor
uses: autograd's engine entry, the fake process group's store and the
dispatch-mode base class. The other modules of the package use only public
torch names and what this module exports.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Hashable

import torch
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import (
    generate_redistribute_costs,
    is_tensor_evenly_shardable,
)
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor._utils import compute_local_stride
from torch.distributed.tensor.placement_types import Placement, Replicate
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "BACKWARD_ENTRY",
    "EMPTY_FACTORIES",
    "LOCAL_STRIDES_FOLLOW_LOCAL_SHAPE",
    "EmptyFactoryStrategy",
    "FactoryRequest",
    "TorchDispatchMode",
    "clear_sharding_caches",
    "engine_run_backward",
    "fake_store",
    "op_strategy_table",
    "probe_mesh",
    "probe_propagation",
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


#: (module, attribute) through which ``backward()`` and ``torch.autograd.grad``
#: start the autograd engine; an alias of :func:`engine_run_backward`.
BACKWARD_ENTRY: Final = ("torch.autograd", "_engine_run_backward")


def engine_run_backward(*args: Any, **kwargs: Any) -> Any:
    """Start the autograd engine, as ``backward()`` does after checking its arguments."""
    return torch.autograd.graph._engine_run_backward(*args, **kwargs)


def fake_store() -> FakeStore:
    """The store of torch's in-process fake process group (nothing communicates)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _propagator() -> ShardingPropagator:
    return DTensor._op_dispatcher.sharding_propagator


def op_strategy_table() -> MutableMapping[Hashable, object]:
    """``op -> strategy(OpSchema) -> OpStrategy``, consulted after the single-dim table."""
    return _propagator().op_strategy_funcs  # type: ignore[return-value]


def single_dim_strategy_table() -> MutableMapping[Hashable, object] | None:
    """``op -> single-dim strategy``, or None on torch without that table."""
    return getattr(_propagator(), "op_single_dim_strategy_funcs", None)


def clear_sharding_caches() -> None:
    """Forget the calling thread's memoised sharding decisions.

    Clears the Python LRU cache and the native fast-path cache. Does what
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` does without
    importing that package, which needs numpy (not a torch dependency).
    Other threads' caches are out of reach: torch keeps them thread-local.
    """
    _propagator().propagate_op_sharding.cache_clear()  # type: ignore[attr-defined]
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()


def probe_mesh(shape: Sequence[int]) -> DeviceMesh:
    """A mesh of rank 0 that owns no process group (nothing can communicate through it).

    The rank tensor is built on the CPU explicitly, so the mesh is the same
    under ``with torch.device("meta")``, ``no_grad`` and ``inference_mode``.
    """
    ranks = torch.arange(math.prod(shape), device="cpu").reshape(tuple(shape))
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)


def _spec(mesh: DeviceMesh, placements: tuple[Placement, ...], shape: Sequence[int]) -> DTensorSpec:
    contiguous = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    meta = TensorMeta(torch.Size(shape), contiguous, torch.float32)
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def _schema_info(op: OpOverload) -> RuntimeSchemaInfo | None:
    # Which non-tensor arguments key the sharding cache for ``op``, as dispatch looks it up.
    prop = _propagator()
    found = prop.op_to_schema_info.get(op)
    if found is None:
        found = getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op)
    return found


def probe_propagation(
    op: OpOverload,
    mesh: DeviceMesh,
    shape: Sequence[int],
    placements: Sequence[tuple[Placement, ...]],
    extra: Sequence[object] = (),
) -> tuple[tuple[Placement, ...], bool]:
    """Output placements of ``op`` and whether it would communicate, from the live propagator.

    ``placements`` gives one tensor argument of ``shape`` per entry; ``extra``
    follows them. Runs the uncached path, so no cache is read or filled.
    """
    args = tuple(_spec(mesh, p, shape) for p in placements) + tuple(extra)
    schema = OpSchema(op, args, {}, schema_info=_schema_info(op))
    sharding = _propagator().propagate_op_sharding_non_cached(schema)
    spec: object = sharding.output_spec
    if not isinstance(spec, DTensorSpec):
        raise TypeError(f"{op} returned {spec!r}; gradsafe probes only single-tensor ops")
    # A redistribution only because shape arguments were localised is no communication.
    communicates = sharding.needs_redistribute and not sharding.use_val_from_redistribute_schema
    return spec.placements, communicates


@dataclasses.dataclass(frozen=True)
class FactoryRequest:
    """One ``new_empty(_strided)`` call as a strategy sees it (public types only)."""

    strided: bool
    input_shape: tuple[int, ...]
    requested_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    #: Every sharded dimension divides evenly over its mesh dimensions.
    evenly_sharded: bool


@dataclasses.dataclass(frozen=True)
class EmptyFactoryStrategy:
    """An op strategy for ``new_empty(_strided)``: ``choose`` says which placements the output takes.

    For each placement the input may have, the output takes
    ``choose(request)``'s placements, or Replicate when it returns None. The
    input is never redistributed (its values are not read), so the op itself
    communicates nothing.
    """

    choose: Callable[[FactoryRequest], tuple[Placement, ...] | None]

    def __call__(self, op_schema: OpSchema) -> OpStrategy:
        input_strategy = op_schema.args_schema[0]
        requested = op_schema.args_schema[1]
        if not isinstance(input_strategy, OpStrategy) or not isinstance(requested, Sequence):
            raise TypeError(
                f"{op_schema.op}: expected the input's OpStrategy and a shape as arguments, got "
                f"{type(input_strategy).__name__} and {type(requested).__name__}; gradsafe's "
                "strategy was called outside DTensor sharding propagation"
            )
        mesh = input_strategy.mesh
        choices = []
        for candidate in input_strategy.strategies:
            input_spec = candidate.output_spec
            request = FactoryRequest(
                strided=op_schema.op is EMPTY_FACTORIES[0],
                input_shape=tuple(input_spec.shape),
                requested_shape=tuple(int(n) for n in requested),  # type: ignore[call-overload]
                placements=tuple(input_spec.placements),
                evenly_sharded=is_tensor_evenly_shardable(input_spec.shape, input_spec),
            )
            chosen = self.choose(request)
            placements = chosen if chosen is not None else (Replicate(),) * mesh.ndim
            choices.append(
                OpSpec(
                    output_specs=DTensorSpec(mesh, placements),
                    input_specs=(input_spec,),
                    redistribute_cost=[generate_redistribute_costs(input_strategy, input_spec)],
                )
            )
        return OpStrategy(choices)
