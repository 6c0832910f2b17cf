"""Deprecated alias of the Megatron-style DDP test double: import from :mod:`gradsafe.testing`.

``gradsafe.testing.megatron`` named a test double the same as the integration
hook :mod:`gradsafe.wgrad.megatron`. ``HookCall``, ``MegatronStyleDDP`` and
``module_of`` stay in ``gradsafe.testing``; this module warns on import and
is kept for one minor release.
"""

import warnings

from gradsafe.testing import HookCall, MegatronStyleDDP, module_of

__all__ = ["HookCall", "MegatronStyleDDP", "module_of"]

warnings.warn(
    "gradsafe.testing.megatron is deprecated and is kept for one minor release only: "
    "import HookCall, MegatronStyleDDP and module_of from gradsafe.testing",
    DeprecationWarning,
    stacklevel=2,
)
