import importlib
import os
import pkgutil
import sys
import warnings
from collections.abc import Iterator

import _thin
import pytest
import torch

from gradsafe.patching import PatchRegistry


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--thin",
        action="store_true",
        help="run every test function but fewer cases of wide grids and property tests "
        "(tests/_thin.py; CI's sessions between the oldest and newest torch)",
    )
    parser.addoption(
        "--min-passed",
        type=int,
        default=0,
        help="fail the run if fewer tests than this pass (CI: a suite that silently "
        "collects or passes almost nothing must not look green)",
    )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    wanted = session.config.getoption("--min-passed")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if not wanted or reporter is None or exitstatus != 0:
        return
    passed = len(reporter.stats.get("passed", []))
    if passed < wanted:
        reporter.write_line(f"--min-passed={wanted}: only {passed} test(s) passed", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--thin"):
        os.environ[_thin.ENV] = "1"  # read when the test modules (their @settings) are imported


def _thinned(config: pytest.Config, items: list[pytest.Item]) -> None:
    grids: dict[tuple[str, str], list[pytest.Item]] = {}
    for item in items:
        name = getattr(item, "originalname", item.name)
        grids.setdefault((item.nodeid.split("::")[0], name), []).append(item)
    dropped = {
        id(item)
        for cases in grids.values()
        if len(cases) >= _thin.GRID
        for i, item in enumerate(cases)
        if i % _thin.STRIDE
    }
    if dropped:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in dropped])
        items[:] = [i for i in items if id(i) not in dropped]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--thin"):
        _thinned(config, items)
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
