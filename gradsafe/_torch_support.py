"""The torch releases gradsafe supports and was tested on, named once for every message that cites them."""

from __future__ import annotations

import re
from typing import Final

__all__ = ["NEWEST_TESTED_TORCH", "SUPPORTED_TORCH", "newer_than_tested"]

#: The oldest supported torch release (major, minor).
OLDEST_SUPPORTED_TORCH: Final = (2, 11)
#: The newest torch release gradsafe's CI tested (major, minor): the tested set runs from
#: :data:`OLDEST_SUPPORTED_TORCH` to this one. Raise it when CI gains the next release.
NEWEST_TESTED_TORCH: Final = (2, 15)
#: The supported torch releases, as error messages name them.
SUPPORTED_TORCH: Final = (
    f"{OLDEST_SUPPORTED_TORCH[0]}.{OLDEST_SUPPORTED_TORCH[1]}"
    f"-{NEWEST_TESTED_TORCH[0]}.{NEWEST_TESTED_TORCH[1]}"
)

_RELEASE = re.compile(r"(\d+)\.(\d+)")


def newer_than_tested(version: str) -> bool:
    """Whether torch ``version`` (``torch.__version__``: ``2.16.0+cu128``, ``2.16.0.dev20261201``)
    is a release after :data:`NEWEST_TESTED_TORCH`; False for a version it cannot read.

    For what the doctor says only: gradsafe decides its paths by probing behaviour, never
    by version numbers.
    """
    found = _RELEASE.match(version)
    return found is not None and (int(found[1]), int(found[2])) > NEWEST_TESTED_TORCH
