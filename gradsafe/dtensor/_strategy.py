"""Which placements gradsafe lets ``new_empty`` / ``new_empty_strided`` keep.

Autograd's layout contract (``clone_obey_contract`` in AccumulateGrad) builds
``.grad`` as ``grad.new_empty_strided(param.size(), param.stride()).copy_(grad)``.
If that empty tensor is Replicate while the gradient is Partial, the
``copy_`` all-reduces; if it keeps the gradient's placements, the copy is
local. The rule here is torch 2.13's strategy for these two ops (pytorch
#180511): keep the input's placements when the shape is unchanged, Partial
included. It applies to every caller, not only autograd, because the
propagator caches one decision per operator schema and cannot tell callers
apart. Where the input has a sharded dimension, torch 2.11 already keeps its
placements (whatever its other dimensions hold) and so does this rule. For
inputs that are only Replicate and Partial, two limits keep the rule from
breaking what the installed torch does:

* a ``Partial`` reduce op is kept only if the installed torch can add a
  Partial gradient of that op into it in place, which is what
  AccumulateGrad does next (torch 2.11 cannot for max/min: keeping them
  would turn 2.11's working accumulation into an error);
* Partial subclasses (``_MaskPartial``, ``_NormPartial``) carry state tied to
  the op that made them and are not kept (torch 2.13 keeps them).

``new_empty_strided`` of an unevenly sharded input stays Replicate on torch
that divides global strides to get local ones (the local strides would
overlap), as torch 2.11 itself does.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Partial, Placement

from gradsafe.dtensor._torch import FactoryRequest

__all__ = ["FollowRule"]


@dataclasses.dataclass(frozen=True)
class FollowRule:
    """Decides the output placements of ``new_empty(_strided)`` (None: Replicate).

    ``partial_reduce_ops``: the reduce ops whose plain ``Partial`` is kept.
    ``uneven_strided``: whether ``new_empty_strided`` may keep an unevenly
    sharded input's placements.
    """

    partial_reduce_ops: frozenset[str]
    uneven_strided: bool

    def keeps(self, placement: Placement) -> bool:
        """Whether an output of an input without sharded dimensions may take ``placement``."""
        if placement.is_replicate():
            return True
        return type(placement) is Partial and placement.reduce_op in self.partial_reduce_ops

    def __call__(self, request: FactoryRequest) -> tuple[Placement, ...] | None:
        if request.input_shape != request.requested_shape:
            return None
        if any(p.is_shard() for p in request.placements):
            if request.strided and not request.evenly_sharded and not self.uneven_strided:
                return None
            return request.placements
        if all(self.keeps(p) for p in request.placements):
            return request.placements
        return None
