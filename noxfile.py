"""CI's sessions: every supported torch release and Python version, the newest torch on the registry, lint, typing with the doctests, and megatron-core's real DDP.

Each test session runs the README's two set-up commands with its torch pinned:
``pip install torch==X . && gradsafe doctor`` (must exit 0), then
``pip install torch==X ".[test]" && pytest`` over the suite that session runs
(``SUITES`` below; CONTRIBUTING.md says why each runs what it runs).

``.ci/run`` runs the sessions in two lanes at once (their ``tags``), one per
core. Every session gets a fresh virtualenv, deleted at its end. The torch
2.13.0 and typing sessions install with pip (the README's commands as written;
pip finds the local CPU build); the others with uv, whose cache keeps the
multi-GB CUDA builds across runs on this machine, so a warm run installs one in
seconds instead of minutes (a cold one downloads it once).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = False

# Every minor release from the declared minimum on: 2.11.0 is the minimum;
# 2.12.1 the newest release where the pipelining (H1) and DTensor (H2) hazards
# are native (its in-place add_ keeps every Partial reduce op, 2.11's only sum
# and avg); 2.13.0 the local CPU build; 2.14.1 moved DTensor strategies into
# single-dim tables; 2.15.0 is the newest release (its Graphed Function takes a
# leading tuple of graphs). All but 2.13.0 are CUDA builds that run on CPU.
# torch 2.10 is not supported: its DTensor adds a scalar to a Partial(sum)
# tensor on every rank and its copy_ redistributes Partial(max), so the H2 fix
# cannot be installed there without changing values (docs/dtensor.md).
#
# What each runs (CONTRIBUTING.md explains it): the whole suite on the oldest,
# the newest and the local build (torchtitan's end-to-end tests, on the newest,
# in a session of their own); on the releases between, the tests marked
# `per_release` (tests/conftest.py's PER_RELEASE: every test whose code path
# probes or branches on the installed torch, the hazard reproductions, the
# doctor).
SUITES = {
    "2.13.0": "all",
    "2.15.0": "all",
    "2.11.0": "all",
    "2.12.1": "per_release",
    "2.14.1": "per_release",
}
TORCH_VERSIONS = list(SUITES)
# The Pythons pyproject.toml declares besides 3.11 (where every torch above
# runs), each with the newest torch built for it (torch 2.15 has no build for
# Python 3.10; 2.14.1 is the newest there): the README's two set-up commands,
# the `per_release` tests and the `torch_independent` ones (they parse
# gradsafe's source with this Python's ast), less the gloo-rank tests, which
# exercise torch's C++ collectives, not the interpreter.
NEWEST_TORCH_FOR = {"3.10": "2.14.1", "3.12": "2.15.0", "3.13": "2.15.0"}

# Two lanes of about equal length, by each session's time in a two-lane run on
# the 2-core machine (2026-12-08, 39.9 min in all): tests 2.15.0 15 min, 2.11.0
# 13, 2.13.0 10, torchtitan 9, python 3.10/3.12/3.13 4 each, 2.12.1 4, 2.14.1 3,
# newest 3, typing 2, megatron 1.
LANE = {
    "2.15.0": "lane-a",
    "2.11.0": "lane-a",
    "3.10": "lane-a",
    "2.13.0": "lane-b",
    "2.12.1": "lane-b",
    "2.14.1": "lane-b",
    "3.12": "lane-b",
    "3.13": "lane-b",
}

# Fewer than this many passed tests fails a session: a suite that collects or
# passes almost nothing (an import error turned into skips) must not look green.
MIN_PASSED = {
    "all": 1200,
    "per_release": 400,
    "python": 300,
    "smoke": 100,
    "torchtitan": 10,
    "megatron": 1,
}
TORCHTITAN_TESTS = (
    "tests/pipelining/test_torchtitan.py",
    "tests/pipelining/test_torchtitan_balance.py",
    "tests/verify/test_verify_torchtitan.py",
)


def _pytest(session: nox.Session, suite: str, env: dict[str, str] | None = None) -> None:
    """pytest over ``suite``'s tests (``SUITES``' names, and the sessions' own selections)."""
    marks = {
        "all": [],
        "per_release": ["-m", "per_release"],
        "python": ["-m", "(per_release or torch_independent) and not distributed"],
        "smoke": ["-m", "smoke"],
        "torchtitan": list(TORCHTITAN_TESTS),
        "megatron": ["tests/wgrad/test_megatron_real.py"],
    }[suite]
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=15",
        f"--min-passed={MIN_PASSED[suite]}",
        *marks,
        *session.posargs,
        env=env or {},
    )


def _done(session: nox.Session) -> None:
    shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@nox.session(python="3.11")
@nox.parametrize("torch", TORCH_VERSIONS, tags=[[LANE[t]] for t in TORCH_VERSIONS])
def tests(session: nox.Session, torch: str) -> None:
    install = session.install
    if torch == "2.13.0":
        # The README's commands as written, with pip: it takes the local CPU build.
        session.install("pip")
        install = lambda *args: session.run("python", "-m", "pip", "install", "-q", *args)  # noqa: E731
    install(f"torch=={torch}", ".")
    session.run("gradsafe", "doctor")
    install(f"torch=={torch}", ".[test]")
    # The C++-extension test compiles for about a minute: once, on the local CPU build.
    env = {"GRADSAFE_BUILD_EXTENSIONS": "1"} if torch == "2.13.0" else {}
    _pytest(session, SUITES[torch], env)
    _done(session)


@nox.session
@nox.parametrize("python", list(NEWEST_TORCH_FOR), tags=[[LANE[p]] for p in NEWEST_TORCH_FOR])
def python(session: nox.Session) -> None:
    torch = NEWEST_TORCH_FOR[str(session.python)]
    session.install(f"torch=={torch}", ".")
    session.run("gradsafe", "doctor")
    session.install(f"torch=={torch}", ".[test]")
    _pytest(session, "python")
    _done(session)


@nox.session(python="3.11", tags=["lane-b"])
def torchtitan(session: nox.Session) -> None:
    """torchtitan 0.3.0's real trainer (needs torch >= 2.14), end to end, on the newest release.

    Its own session, in the other lane from ``tests(torch='2.15.0')`` (which
    skips these tests, the extra not installed there): the two together are the
    whole suite on 2.15.0, run in half the time.
    """
    torch = "2.15.0"
    session.install(f"torch=={torch}", ".[test,torchtitan]")
    _pytest(session, "torchtitan")
    _done(session)


@nox.session(python="3.11", tags=["lane-a"])
def newest(session: nox.Session) -> None:
    """The newest torch the registry has, the day it is published: the doctor and the smoke suite.

    Unpinned and resolved afresh each run, so a new torch release is exercised
    by the next CI run without a change here; ``gradsafe doctor`` says when it is
    newer than every release above and which probes passed. The smoke suite
    (tests marked ``smoke``) is the hazard reproductions and one exactness check
    per capability.
    """
    session.install("--refresh-package", "torch", "--upgrade", "torch", ".")
    session.run(
        "python", "-c", "import torch; print('newest torch on the registry:', torch.__version__)"
    )
    session.run("gradsafe", "doctor")
    session.install(".[test]")
    _pytest(session, "smoke")
    _done(session)


@nox.session(python="3.11", tags=["lane-b"], venv_backend="venv")
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    _done(session)


def _python_for_megatron() -> str:
    """Python 3.12 (megatron-core needs >= 3.12): on PATH, else pyenv's newest 3.12.x."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    pyenv = sorted(root.glob("3.12.*/bin/python3.12"))
    # pyenv puts a python3.12 shim on PATH that fails unless 3.12 is selected: prefer the real one.
    return str(pyenv[-1]) if pyenv else "3.12"


@nox.session(python=_python_for_megatron(), tags=["lane-a"])
def megatron(session: nox.Session) -> None:
    """megatron-core 0.19.2's real DistributedDataParallel under docs/wgrad.md's recipe.

    Python 3.12, torch 2.15.0: the README's two set-up commands (doctor
    included), with megatron-core from the ``megatron`` extra, then only the
    test that needs it (every other session runs the rest, emulation included).
    """
    torch = "2.15.0"
    session.install(f"torch=={torch}", ".")
    session.run("gradsafe", "doctor")
    session.install(f"torch=={torch}", ".[test,megatron]")
    _pytest(session, "megatron")
    _done(session)


@nox.session(python="3.11", tags=["lane-a"], venv_backend="venv")
def typing(session: nox.Session) -> None:
    session.install("torch==2.13.0", ".", "mypy", "pytest")
    session.run("mypy", "--ignore-missing-imports", "-p", "gradsafe")
    # The docstrings' Example:: blocks, run against the installed package (pytest
    # exits 5, failing the session, if it collects none).
    session.run(
        "pytest", "-q", "-p", "no:cacheprovider", "--doctest-modules", "--pyargs", "gradsafe"
    )
    _done(session)
