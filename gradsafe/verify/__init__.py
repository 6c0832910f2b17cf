"""``gradsafe verify``: gradsafe's and torch's split backward against a fused one, on a user's own stages.

A client of the core, not part of it: :func:`verify` runs copies of the
caller's stages with gradsafe's B/W (``gradsafe.pipelining``), torch's own and
a fused backward, and returns a :class:`VerifyReport`;
``python -m gradsafe verify`` is its command line, which can also run torch's
real schedules on local gloo ranks (``--schedule``) and torchtitan's models
(``--torchtitan``). :func:`assert_split_exact` (also :func:`gradsafe.testing.assert_split_exact`) is
the same check as an assertion. Importing ``gradsafe.pipelining`` does not import this
package.

Importing this package imports no torch (the command line's ``--help`` and
argument checks run without it): :func:`verify` and :data:`ORDERS` are loaded
on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradsafe.verify._report import GradRow, HookRow, Memory, OrderResult, Timing, VerifyReport

if TYPE_CHECKING:
    from gradsafe.verify._api import ORDERS, verify
    from gradsafe.verify._split_exact import assert_split_exact

__all__ = [
    "ORDERS",
    "GradRow",
    "HookRow",
    "Memory",
    "OrderResult",
    "Timing",
    "VerifyReport",
    "assert_split_exact",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name == "assert_split_exact":
        from gradsafe.verify import _split_exact

        return _split_exact.assert_split_exact
    if name not in ("ORDERS", "verify"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from gradsafe.verify import _api

    return getattr(_api, name)
