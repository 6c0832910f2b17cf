"""The torch releases gradsafe supports, named once for every message that cites them."""

from __future__ import annotations

from typing import Final

__all__ = ["SUPPORTED_TORCH"]

#: The supported torch releases, as error messages name them.
SUPPORTED_TORCH: Final = "2.11-2.15"
