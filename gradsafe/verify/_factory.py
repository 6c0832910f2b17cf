"""``PACKAGE.MODULE:FACTORY``: how ``gradsafe verify`` finds the user's stages and microbatches."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__all__ = ["load_factory"]


def load_factory(spec: str) -> Any:
    """Import ``PACKAGE.MODULE:FACTORY`` and call it: (stages, microbatches[, loss_fn])."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected PACKAGE.MODULE:FACTORY, got {spec!r}")
    if os.getcwd() not in sys.path:  # the console script does not put the working directory there
        sys.path.insert(0, os.getcwd())
    factory = getattr(importlib.import_module(module_name), attr)
    built = factory()
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise TypeError(
            f"{spec} returned {type(built).__name__}; it must return (module_or_stages, "
            "microbatches) or (module_or_stages, microbatches, loss_fn)"
        )
    return built
