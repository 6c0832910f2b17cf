"""benchmarks/ modules the tests share with the benchmark scripts (benchmarks/ is not a package)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, loaded by path once per process (as ``<name>_bench``)."""
    key = f"{name}_bench"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {BENCHMARKS / f'{name}.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module
