"""gradsafe: exact gradients where PyTorch silently corrupts, drops or crashes on them.

Importing gradsafe patches nothing (and imports no capability code). Use one of:

* ``gradsafe.patch()`` at start-up (until ``gradsafe.unpatch()``),
* ``with gradsafe.patch(): train()`` around the training loop,
* direct imports such as ``from gradsafe.pipelining import stage_backward_weight``.

Every function here is a method of :data:`REGISTRY`, the process's one
:class:`~gradsafe.patching.PatchRegistry` (created in :mod:`gradsafe.patching`),
whose patches are listed and registered in :mod:`gradsafe.capabilities`.
"""

from __future__ import annotations

from gradsafe.capabilities import PatchName  # importing the table registers every patch
from gradsafe.patching import REGISTRY, PatchConflictWarning, PatchHandle, PatchState, Status

__all__ = [
    "PatchConflictWarning",
    "PatchHandle",
    "PatchName",
    "PatchState",
    "REGISTRY",
    "Status",
    "get_original",
    "is_object_patched",
    "patch",
    "patch_names",
    "status",
    "unpatch",
]

__version__ = "0.2.0"


def patch(*names: PatchName) -> PatchHandle:
    """Apply the named patches (none named: all) and return a handle; see :meth:`PatchRegistry.patch`.

    Example::

        >>> import gradsafe
        >>> with gradsafe.patch("pipelining") as handle:  # torch's functions back on exit
        ...     print(handle.names)
        ('pipelining',)
        >>> gradsafe.status()["pipelining"].refcount
        0
    """
    return REGISTRY.patch(*names)


def unpatch(*names: PatchName) -> None:
    """Undo this thread's newest bare ``patch()`` per name; see :meth:`PatchRegistry.unpatch`."""
    REGISTRY.unpatch(*names)


def status() -> Status:
    """Where every patch stands, without probing anything; see :meth:`PatchRegistry.status`."""
    return REGISTRY.status()


def patch_names() -> tuple[str, ...]:
    """The names :func:`patch` accepts."""
    return REGISTRY.names()


def get_original(module: str, attr: str) -> object:
    """torch's object behind a slot gradsafe replaced; see :meth:`PatchRegistry.get_original`."""
    return REGISTRY.get_original(module, attr)


def is_object_patched(module: str, attr: str) -> bool:
    """Whether ``module.attr`` holds a gradsafe replacement; see :meth:`PatchRegistry.is_object_patched`."""
    return REGISTRY.is_object_patched(module, attr)
