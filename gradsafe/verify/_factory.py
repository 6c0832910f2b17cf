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
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name != missing and not module_name.startswith(f"{missing}."):
            raise  # the module was found; something it imports was not
        raise ModuleNotFoundError(_not_found(module_name, missing), name=missing) from exc
    factory = getattr(module, attr)
    built = factory()
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise TypeError(
            f"{spec} returned {type(built).__name__}; it must return (module_or_stages, "
            "microbatches) or (module_or_stages, microbatches, loss_fn)"
        )
    return built


def _not_found(module_name: str, missing: str) -> str:
    """Where Python looked for ``module_name`` (``missing`` is the part it did not find), and how
    to make it findable."""
    parent, _, last = missing.rpartition(".")
    if parent in sys.modules:  # the package was found, its submodule was not
        where = getattr(sys.modules[parent], "__file__", None) or parent
        return f"no module named {missing!r}: {parent} ({where}) has no module {last!r}"
    looked = [p or os.getcwd() for p in sys.path if p and not p.endswith((".zip", "lib-dynload"))]
    shown = ", ".join(dict.fromkeys(looked[:6]))
    folder = missing.split(".")[0]
    return (
        f"no module named {missing!r}; Python looked in {shown}"
        f"{f' and {len(looked) - 6} more' if len(looked) > 6 else ''} (the working directory "
        f"{os.getcwd()} first). Run from the folder that holds {folder}.py or {folder}/, or add "
        f"that folder to PYTHONPATH: PYTHONPATH=/path/to/that/folder python -m gradsafe verify "
        f"{module_name}:FACTORY"
    )
