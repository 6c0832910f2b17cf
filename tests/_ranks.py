"""Launching gloo worker processes on 127.0.0.1 for the distributed tests."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free now: only for clients that rendezvous by ``env://`` (torchtitan)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous(directory: Path) -> str:
    """A gloo ``init_method`` in ``directory``: a file, so no free TCP port is raced for.

    A port picked here and bound by rank 0 seconds later (after its torch import)
    can be taken meanwhile by a test run beside this one (CI runs two sessions at
    once); gloo's own connections bind ephemeral ports, which never collide.
    """
    return f"file://{directory.resolve() / 'rendezvous'}"


def worker_env() -> dict[str, str]:
    """The environment a worker needs: gradsafe importable, one thread per rank (2 cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["GLOO_SOCKET_IFNAME"] = "lo"  # connect the ranks over 127.0.0.1, whatever the hostname says
    return env


# What every rank imports: loaded once, in this test process's forkserver, so that each rank
# (a fork of it) starts in milliseconds instead of importing torch again (seconds of CPU each,
# twice that for a CUDA build: most of the gloo tests' time before this).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "torch.distributed.fsdp",
    "torch.utils.checkpoint",
    "gradsafe",
    "gradsafe.pipelining",
    "gradsafe.wgrad",
]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def start_forkserver() -> multiprocessing.context.BaseContext:
    """The forkserver context the ranks start from, its server started with the workers'
    environment (OMP_NUM_THREADS is read when torch's OpenMP loads, in the preload)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    with _environ(worker_env()):
        multiprocessing.forkserver.ensure_running()
    return context


def _run_script(script: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """A rank: ``script`` run as ``__main__`` with ``argv``, its output into ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path[:0] = [os.path.dirname(script), str(REPO)]
    runpy.run_path(script, run_name="__main__")


def run_ranks(
    script: Path,
    args: list[str],
    ranks: int,
    out: Path,
    what: str,
    timeout: float = 180,
    tcp: bool = False,
) -> list[dict[str, object]]:
    """Run ``script RANK RENDEZVOUS *args OUT`` on ``ranks`` processes; return each rank's ``OUT/rank{r}.pt``.

    ``RENDEZVOUS`` is a file ``init_method`` (see ``rendezvous``), or with
    ``tcp`` a free port, for a client that joins by ``env://`` itself.

    A run that cannot start because torch's stage initialisation sends to the
    rank's own other stage over gloo (torch 2.11, V-shaped schedules) skips.
    """
    port = str(free_port()) if tcp else rendezvous(out)
    context = start_forkserver()
    logs = [out / f"rank{r}.log" for r in range(ranks)]
    procs = [
        context.Process(  # type: ignore[attr-defined]
            target=_run_script,
            args=(str(script), [str(r), port, *args, str(out)], worker_env(), str(logs[r])),
        )
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    if any(proc.is_alive() for proc in procs):
        for proc in procs:
            proc.kill()
            proc.join()
        pytest.fail(f"{what} run did not finish in {timeout:.0f} s")
    results = []
    for r in range(ranks):
        path = out / f"rank{r}.pt"
        log = logs[r].read_text(errors="replace") if logs[r].exists() else ""
        assert path.exists(), f"rank {r} wrote nothing:\n{log[-3000:]}"
        results.append(torch.load(path, weights_only=False))
    for res in results:
        crash = str(res.get("crash", ""))
        if "Pair is not connected" in crash and "_initialize_stages" in crash:
            pytest.skip(f"this torch cannot run {what} on gloo: {crash[:200]}")
    return results
