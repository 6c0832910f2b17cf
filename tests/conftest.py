import importlib
import os
import pkgutil
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch

from gradsafe.patching import PatchRegistry


def pytest_addoption(parser: pytest.Parser) -> None:
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


# The test modules CI runs on every torch release and Python (marker ``per_release``;
# noxfile.py's SUITES): those whose code path probes or branches on the installed torch
# (the probes and their drift fallbacks, the patch targets, the compiled split's AOTAutograd
# hooks, DTensor's factory and strategy tables, the graphed Function's signature, the
# schedule's metadata inference), the hazard reproductions, and the doctor. Every other
# test runs on the oldest, the newest and the local torch build.
PER_RELEASE = frozenset(
    {
        "test_doctor.py",
        "test_doctor_probes.py",
        "test_patching.py",
        "pipelining/test_pipelining_autograd_drift.py",
        "pipelining/test_pipelining_checkpoint_drift.py",
        "pipelining/test_pipelining_compiled_split.py",
        "pipelining/test_pipelining_inference.py",
        "pipelining/test_pipelining_patch_probe.py",
        "pipelining/test_pipelining_scaling.py",
        "pipelining/test_pipelining_torch_crashes.py",
        "pipelining/test_pipelining_zoo.py",
        "dtensor/test_dtensor_contexts.py",
        "dtensor/test_dtensor_doctor_row.py",
        "dtensor/test_dtensor_factory_semantics.py",
        "dtensor/test_dtensor_hazard_repro.py",
        "dtensor/test_dtensor_mixed_reduce_ops.py",
        "dtensor/test_dtensor_strategy_unit.py",
        "cuda_graphs/test_cuda_graphs_double_backward.py",
        "cuda_graphs/test_cuda_graphs_probe.py",
        "cuda_graphs/test_cuda_graphs_te.py",
        "cuda_graphs/test_graphed_split_stages.py",
        "wgrad/test_wgrad_graph_task_drift.py",
        "wgrad/test_wgrad_hazards.py",
        "wgrad/test_wgrad_renamed_names.py",
    }
)


def _mark_per_release(items: list[pytest.Item]) -> None:
    tests = os.path.dirname(__file__)
    for item in items:
        if os.path.relpath(item.path, tests).replace(os.sep, "/") in PER_RELEASE:
            item.add_marker(pytest.mark.per_release)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_per_release(items)
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
