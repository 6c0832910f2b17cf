import importlib
import pkgutil
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch

from gradsafe.patching import PatchRegistry


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run these on a machine with one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cuda_generator_after_a_failed_capture(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a `cuda` test, one empty capture: torch 2.11 leaves the CUDA generator marked as
    capturing when a capture fails, and every later random op then raises "Offset increment
    outside graph capture encountered unexpectedly" (seen on an H200); a successful capture
    clears the mark, so one test's expected refusal does not fail the tests after it."""
    yield
    if "cuda" in request.keywords and torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[PatchRegistry]:
    """A new registry holding gradsafe's patches, nothing planned or applied, as the process's one.

    Every gradsafe module that bound the process's registry by name sees the
    fresh one until the test ends; tests may ``register`` patches of their own.
    """
    import gradsafe
    from gradsafe import capabilities, patching

    # A module first imported during the test would keep the fresh registry: import them all first.
    for info in pkgutil.walk_packages(gradsafe.__path__, "gradsafe."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    fresh = PatchRegistry(
        [c.patch for c in capabilities.CAPABILITIES if c.patch is not None],
        testing=[capabilities.CUDA_GRAPHS_EMULATION],
    )
    process = patching.REGISTRY
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "gradsafe" and getattr(module, "REGISTRY", None) is process:
            monkeypatch.setattr(module, "REGISTRY", fresh)
    yield fresh
    if any(state.active for state in fresh.status().patches):
        raise AssertionError("a test left a patch of the fresh registry applied")
