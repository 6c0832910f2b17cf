"""gradsafe: exact gradients where PyTorch silently corrupts, drops or crashes on them.

Importing gradsafe patches nothing. Use one of:

* ``gradsafe.patch()`` at start-up (until ``gradsafe.unpatch()``),
* ``with gradsafe.patch(): train()`` around the training loop,
* direct imports such as ``from gradsafe.pipelining import stage_backward_weight``.
"""

from gradsafe.patching import (
    PatchConflictWarning,
    PatchHandle,
    PatchState,
    Status,
    get_original,
    is_object_patched,
    patch,
    patch_names,
    status,
    unpatch,
)

__all__ = [
    "PatchConflictWarning",
    "PatchHandle",
    "PatchState",
    "Status",
    "get_original",
    "is_object_patched",
    "patch",
    "patch_names",
    "status",
    "unpatch",
]

__version__ = "0.1.0"
