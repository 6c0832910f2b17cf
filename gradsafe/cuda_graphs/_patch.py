"""The ``cuda_graphs`` patch: every slot it replaces, listed in one place."""

from gradsafe.patching import Patch, Skip

PATCH = Patch(
    name="cuda_graphs",
    summary="not implemented yet",
    plan=lambda: Skip("not implemented yet"),
)
