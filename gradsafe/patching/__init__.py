"""Explicit, reversible, reference-counted monkeypatching of torch.

Split like gevent's ``monkey`` package, one concern per module:

* :mod:`~gradsafe.patching._targets` — a :class:`Target` is one slot (a
  module attribute or a table entry) and the object gradsafe puts there; a
  :class:`Patch` is one capability's set of slots: its ``plan`` probes the
  installed torch (features, never version numbers) and returns the targets
  or a :class:`Skip` with the reason;
* :mod:`~gradsafe.patching._status` — what :meth:`PatchRegistry.status`
  reports, read without side effects;
* :mod:`~gradsafe.patching._handle` — the :class:`PatchHandle` ``patch()``
  returns; it reaches the registry only through :class:`References`;
* :mod:`~gradsafe.patching._registry` — a :class:`PatchRegistry` owns every
  patch's reference count and undo records, like pytest's ``MonkeyPatch``
  owns its undo stack.

:data:`REGISTRY` is the process's one registry. It is created here, empty, and
filled by :mod:`gradsafe.capabilities` (imported by ``import gradsafe``);
``gradsafe.patch()``, ``unpatch()``, ``status()``, ``get_original()`` and
``is_object_patched()`` are its methods.

A plan is computed once per process (it depends only on the installed torch)
and always under plain tensor semantics: grad mode on, no inference mode, CPU
as default device, whatever the caller's context.
"""

from __future__ import annotations

from typing import Final

from gradsafe.patching._handle import PatchHandle, References
from gradsafe.patching._registry import PatchConflictWarning, PatchRegistry
from gradsafe.patching._status import PatchState, Status, TargetState
from gradsafe.patching._targets import MISSING, AttrTarget, ItemTarget, Patch, Plan, Skip, Target

__all__ = [
    "AttrTarget",
    "ItemTarget",
    "MISSING",
    "Patch",
    "PatchConflictWarning",
    "PatchHandle",
    "PatchRegistry",
    "PatchState",
    "Plan",
    "REGISTRY",
    "References",
    "Skip",
    "Status",
    "Target",
    "TargetState",
]

#: The process's one patch registry; :mod:`gradsafe.capabilities` registers every patch.
REGISTRY: Final = PatchRegistry()
