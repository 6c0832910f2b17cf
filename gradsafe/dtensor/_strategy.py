"""The sharding strategy gradsafe gives ``aten.new_empty`` and ``aten.new_empty_strided``.

Autograd's layout contract (``clone_obey_contract`` in AccumulateGrad) builds
``.grad`` as ``grad.new_empty_strided(param.size(), param.stride()).copy_(grad)``.
The empty tensor is overwritten at once, so its placements only have to match
the source of that write. If it is given Replicate while the gradient is
Partial, the ``copy_`` all-reduces; if it follows the gradient, the copy is
local. Uninitialised memory has no value to preserve, so following any
placement is exact.
"""

from __future__ import annotations

from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
from torch.distributed.tensor._ops.utils import (
    generate_redistribute_costs,
    is_tensor_evenly_shardable,
)
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from gradsafe.dtensor import _torch

__all__ = ["can_follow", "empty_factory_strategy"]


def _followable(placement: Placement) -> bool:
    # Partial subclasses (_MaskPartial, _NormPartial) carry extra state tied to
    # the op that made them; only plain Partial(reduce_op) is followed.
    return placement.is_shard() or placement.is_replicate() or type(placement) is Partial


def can_follow(op_schema: OpSchema, input_spec: DTensorSpec) -> bool:
    """Whether the new empty tensor may take ``input_spec``'s placements.

    True when the requested shape equals the input's, every placement is a
    Shard, Replicate or plain Partial (any reduce op), and, for
    ``new_empty_strided`` on torch that derives local strides from global ones
    by division, every sharded dimension divides evenly.
    """
    requested = op_schema.args_schema[1]
    if tuple(input_spec.shape) != tuple(requested):  # type: ignore[arg-type]
        return False
    if not all(_followable(p) for p in input_spec.placements):
        return False
    strided = op_schema.op is _torch.EMPTY_FACTORIES[0]
    if strided and input_spec.is_sharded() and not _torch.LOCAL_STRIDES_FOLLOW_LOCAL_SHAPE:
        return is_tensor_evenly_shardable(input_spec.shape, input_spec)
    return True


def empty_factory_strategy(op_schema: OpSchema) -> OpStrategy:
    """Strategy for ``aten.new_empty(_strided)``: follow the input, else Replicate.

    For each placement the input may have, the output takes the same
    placements when :func:`can_follow` allows it and is Replicate otherwise.
    The input is never redistributed (its values are not read), so the op
    itself communicates nothing.
    """
    input_strategy = op_schema.args_schema[0]
    if not isinstance(input_strategy, OpStrategy):
        raise TypeError(
            f"{op_schema.op}: expected the input's OpStrategy as argument 0, got "
            f"{type(input_strategy).__name__}; gradsafe's strategy was called outside "
            "DTensor sharding propagation"
        )
    mesh = input_strategy.mesh
    choices = []
    for candidate in input_strategy.strategies:
        input_spec = candidate.output_spec
        if can_follow(op_schema, input_spec):
            output_spec = DTensorSpec(mesh, input_spec.placements)
        else:
            output_spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim)
        choices.append(
            OpSpec(
                output_specs=output_spec,
                input_specs=(input_spec,),
                redistribute_cost=[generate_redistribute_costs(input_strategy, input_spec)],
            )
        )
    return OpStrategy(choices)
