"""One test session per supported torch release and Python version, lint, a type check with the doctests, and megatron-core's real DDP (CI runs them all).

Each session runs the README's two set-up commands with that torch pinned:
``pip install torch==X . && gradsafe doctor`` (must exit 0), then
``pip install torch==X ".[test]" && pytest``.

torch is first fetched into a wheelhouse kept across runs on this machine
(``GRADSAFE_WHEELHOUSE``, default ``~/.cache/gradsafe-ci/wheels``) and
installed from there, so only the first run pays for the multi-GB CUDA
builds; every session still gets a fresh virtualenv, which is deleted at the
end of the session to keep the disk in check.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False

# Every minor release from the declared minimum on: 2.11.0 is the minimum;
# 2.12.1 the newest release where the pipelining (H1) and DTensor (H2) hazards
# are native (its in-place add_ keeps every Partial reduce op, 2.11's only sum
# and avg); 2.13.0 the local CPU build; 2.14.1 moved DTensor strategies into
# single-dim tables; 2.15.0 is the newest release (its Graphed Function takes a
# leading tuple of graphs). All but 2.13.0 are CUDA builds that run on CPU.
# Every session runs the whole suite, gloo tests included: behaviour differs
# between each of these releases. torch 2.10 is not
# supported: its DTensor adds a scalar to a Partial(sum) tensor on every rank
# and its copy_ redistributes Partial(max), so the H2 fix cannot be installed
# there without changing values (docs/dtensor.md).
TORCH_VERSIONS = ["2.13.0", "2.15.0", "2.11.0", "2.12.1", "2.14.1"]
# The Pythons pyproject.toml declares besides 3.11 (where every torch above
# runs), each with the newest torch built for it (torch 2.15 has no build for
# Python 3.10; 2.14.1 is the newest there): the README's two set-up commands
# and the suite without the gloo-rank tests, which exercise torch's C++
# collectives, not the interpreter, and run in the sessions above.
NEWEST_TORCH_FOR = {"3.10": "2.14.1", "3.12": "2.15.0", "3.13": "2.15.0"}

WHEELHOUSE = Path(
    os.environ.get("GRADSAFE_WHEELHOUSE", Path.home() / ".cache" / "gradsafe-ci" / "wheels")
)


def _install_torch(session: nox.Session, torch: str) -> None:
    wheels = WHEELHOUSE / torch
    wheels.mkdir(parents=True, exist_ok=True)
    # A no-op when every wheel is already there; fills the wheelhouse otherwise.
    session.run("python", "-m", "pip", "download", "-q", "-d", str(wheels), f"torch=={torch}")
    session.install("--no-index", "--find-links", str(wheels), f"torch=={torch}")


@nox.session(python="3.11")
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    _install_torch(session, torch)
    # The README's two set-up commands, with this session's torch.
    session.install(f"torch=={torch}", ".")
    session.run("gradsafe", "doctor")
    session.install(f"torch=={torch}", ".[test]")
    if torch == "2.15.0":  # torchtitan 0.3.0 needs torch >= 2.14: its ZBV trainer, end to end
        session.install(f"torch=={torch}", ".[test,torchtitan]")
    # The C++-extension test compiles for about a minute: once, on the local CPU build.
    env = {"GRADSAFE_BUILD_EXTENSIONS": "1"} if torch == "2.13.0" else {}
    session.run("pytest", "-q", "-p", "no:cacheprovider", *session.posargs, env=env)
    shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@nox.session(python=list(NEWEST_TORCH_FOR))
def python(session: nox.Session) -> None:
    torch = NEWEST_TORCH_FOR[str(session.python)]
    _install_torch(session, torch)
    session.install(f"torch=={torch}", ".")
    session.run("gradsafe", "doctor")
    session.install(f"torch=={torch}", ".[test]")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "-m", "not distributed", *session.posargs)
    shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def _python_for_megatron() -> str:
    """Python 3.12 (megatron-core needs >= 3.12): on PATH, else pyenv's newest 3.12.x."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    pyenv = sorted(root.glob("3.12.*/bin/python3.12"))
    # pyenv puts a python3.12 shim on PATH that fails unless 3.12 is selected: prefer the real one.
    return str(pyenv[-1]) if pyenv else "3.12"


@nox.session(python=_python_for_megatron())
def megatron(session: nox.Session) -> None:
    """megatron-core 0.19.2's real DistributedDataParallel under docs/wgrad.md's recipe.

    Python 3.12, torch 2.15.0: the README's two set-up commands (doctor
    included), with megatron-core from the ``megatron`` extra, then only the
    test that needs it (every other session runs the rest, emulation included).
    Measured on a loaded 2-core CPU machine: about 5 min, of which 3 install
    torch from the wheelhouse, 1 the two commands and megatron-core, and
    0.5-1 the test (20 s CPU: three processes importing megatron-core).
    """
    torch = "2.15.0"
    _install_torch(session, torch)
    session.install(f"torch=={torch}", ".")
    session.run("gradsafe", "doctor")
    session.install(f"torch=={torch}", ".[test,megatron]")
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/wgrad/test_megatron_real.py",
        *session.posargs,
    )
    shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@nox.session(python="3.11")
def typing(session: nox.Session) -> None:
    session.install("torch==2.13.0", ".", "mypy", "pytest")
    session.run("mypy", "--ignore-missing-imports", "-p", "gradsafe")
    # The docstrings' Example:: blocks, run against the installed package (pytest
    # exits 5, failing the session, if it collects none).
    session.run(
        "pytest", "-q", "-p", "no:cacheprovider", "--doctest-modules", "--pyargs", "gradsafe"
    )
    shutil.rmtree(session.virtualenv.location, ignore_errors=True)
