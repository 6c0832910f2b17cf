"""Deprecated alias of the Megatron-style DDP test double: import from :mod:`gradsafe.testing`.

``gradsafe.testing.megatron`` named a test double the same as the integration
hook :mod:`gradsafe.wgrad.megatron`. ``HookCall``, ``MegatronStyleDDP`` and
``module_of`` stay in ``gradsafe.testing``; this module warns on import and
is removed in 0.4.0.
"""

import warnings

from gradsafe._shared.deprecation import removal_notice
from gradsafe.testing import HookCall, MegatronStyleDDP, module_of

__all__ = ["HookCall", "MegatronStyleDDP", "module_of"]

warnings.warn(
    "gradsafe.testing.megatron is deprecated: import HookCall, MegatronStyleDDP and module_of "
    f"from gradsafe.testing ({removal_notice()})",
    DeprecationWarning,
    stacklevel=2,
)
