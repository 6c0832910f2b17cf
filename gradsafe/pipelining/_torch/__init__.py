"""Every use of torch internals by gradsafe's split backward, in one place.

Public autograd API (``Node.next_functions``, ``register_prehook``,
``GradientEdge``, ``Node.metadata``) is used everywhere; what is private or
undocumented lives here, so a torch release that changes it breaks one module
and :func:`missing_feature` reports it before the patch is applied:

- ``Node._input_metadata``: the shape/dtype/device each node input expects;
- calling a built-in node directly (``node(*grads)``): runs its backward
  formula without the engine, so no hooks run and nothing flows into other
  nodes;
- ``RemovableHandle.hooks_dict_ref``: a node's Python post hooks, all in one
  dict (whether a user registered any besides gradsafe's);
- the closures ``register_multi_grad_hook`` registers as tensor hooks (which
  tensors one registration spans, its mode, and mode ``"any"``'s per-backward
  record of whether it fired, stood in for while W delivers);
- ``Variable._execution_engine.run_backward``: the engine's entry point,
  called directly for each component W delivers; and
  ``torch.autograd.graph._engine_run_backward``, what ``autograd.grad`` ends
  in, called by B directly where ``autograd.grad``'s argument handling would
  change nothing (:func:`captured_grads`);
- ``torch._C._FunctionBase``: tells custom-Function nodes from built-in ones;
  its C ``apply`` is what ``Function.apply``'s Python wrapper (before 2.14)
  ends in, called directly where the wrapper would change nothing
  (:func:`apply_function`, with ``torch._C._are_functorch_transforms_active``
  and ``torch._C._functorch.is_functorch_wrapped_tensor``);
  ``Node.name()`` tells C++ custom Functions (``CppNode<...>``) and ``CopySlices``;
- ``AccumulateGrad.variable``: the leaf a gradient accumulator writes to
  (``torch._C._functions.AccumulateGrad``: the accumulators' class);
- ``Tensor._is_view``: views cannot be detached in place;
- ``SavedTensor.unpack_hook`` (via a node's ``_raw_saved_*``): whether a
  built-in node's saved tensors come back through saved-tensor hooks
  (activation checkpointing), so calling it again would unpack them again;
  unpacking one (``_saved_*``) tells whether they were freed;
- ``Tensor._backward_hooks``: the dict a leaf's tensor hooks are read from at
  call time, replaced by an empty stand-in while a gradient is captured at
  that leaf;
- ``Tensor._version``: a parameter changed in place during stage metadata
  inference (refused: it cannot be undone); a gradient W reads changed in
  place between its arrival in B and W (refused before W changes anything);
- ``Tensor._post_accumulate_grad_hooks`` and ``nn.Module``'s backward-hook
  dicts (per module and the module-global ones): silenced while a stage's
  metadata inference runs;
- AOTAutograd's forward-class ``metadata.bw_donated_idxs`` and ``compiled_bw``:
  a compiled block whose backward was already compiled donating saved
  buffers (refused before B runs anything);
- the text of the engine's ``RuntimeError`` messages (torch raises no typed
  error for donated buffers or a mode-``"all"`` multi-grad hook):
  :func:`engine_error` reads it;
- ``torch.utils.checkpoint.GraphExecGroup``: makes B and W one checkpoint
  group, so a checkpointed region recomputes once across both;
  ``torch.utils.checkpoint._Holder`` and its ``handles`` dict (reached
  through ``SavedTensor.data``): a checkpointed node's saved tensors unpack
  once in B and once more in W from the one recomputation;
  their behaviour is probed once per process (:func:`unpack_twice_unsupported`,
  :func:`recompute_alike_unsupported`); where it differs, the policy runs as
  ``IN_B``;
- torch bugs a split's weight-only call of a built-in node reaches (GroupNorm's
  weight-only backward on a channels_last input segfaults on 2.13): probed once
  per process in a subprocess, where a crash cannot take the caller down;
- ``Variable._execution_engine.queue_callback`` and ``torch._C._current_autograd_node``:
  end-of-backward callbacks queued by hooks in W's weight-only pass are held
  for W's delivery pass, and ``Variable._execution_engine.run_backward``: a
  backward run inside stage metadata inference is kept off the parameters
  (the engine object is swapped for a forwarding proxy while either runs);
- FSDP2's per-module state (``FSDPParam.sharded_param`` and its unsharded
  parameter): which parameter autograd saw for the sharded one a caller passes;
- ``torch.distributed.pipelining._backward``, where torch's split functions
  live (the hazard reproductions call whichever is installed there), and the
  schedules' ``_Action`` (parsing an action's string form, for capture orders);
- for :mod:`gradsafe.verify`: ``nn.Module._apply`` to cast floating and complex tensors of
  a copy apart (``Module.to`` casts complex buffers to real); torch's device
  probes ``torch._utils._get_available_device_type`` / ``_get_device_module``,
  which torchtitan reads once at import to pick its device.

By topic, one module each: :mod:`._checkpoint` (checkpoint holders), :mod:`._nodes` (node kinds, input metadata,
saved tensors, direct calls), :mod:`._hooks` (hook dicts), :mod:`._leaf_hooks` (a leaf's hooks
silenced at B's capture), :mod:`._multi_grad_hooks` (``register_multi_grad_hook``'s
registrations), :mod:`._engine`
(the engine's entry points, callbacks, the checkpoint group, its errors),
:mod:`._state` (RNG, FSDP2, modules' tensors, device probes) and :mod:`._probe`
(:func:`missing_feature`). Everything is imported from this package.
"""

from __future__ import annotations

# Each topic module's __all__ is the package's surface: listed once, there.
from gradsafe.pipelining._torch import (
    _aot,
    _checkpoint,
    _engine,
    _hooks,
    _leaf_hooks,
    _multi_grad_hooks,
    _nodes,
    _probe,
    _state,
)
from gradsafe.pipelining._torch._aot import *  # noqa: F403
from gradsafe.pipelining._torch._checkpoint import *  # noqa: F403
from gradsafe.pipelining._torch._engine import *  # noqa: F403
from gradsafe.pipelining._torch._hooks import *  # noqa: F403
from gradsafe.pipelining._torch._leaf_hooks import *  # noqa: F403
from gradsafe.pipelining._torch._multi_grad_hooks import *  # noqa: F403
from gradsafe.pipelining._torch._nodes import *  # noqa: F403
from gradsafe.pipelining._torch._probe import *  # noqa: F403
from gradsafe.pipelining._torch._state import *  # noqa: F403

__all__: list[str] = []
__all__ += _aot.__all__
__all__ += _checkpoint.__all__
__all__ += _engine.__all__
__all__ += _hooks.__all__
__all__ += _leaf_hooks.__all__
__all__ += _multi_grad_hooks.__all__
__all__ += _nodes.__all__
__all__ += _probe.__all__
__all__ += _state.__all__
