"""Launching gloo worker processes on 127.0.0.1 for the distributed tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port, *args, str(out)],
            env=worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(ranks)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=timeout)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{what} run did not finish in {timeout:.0f} s")
    results = []
    for r in range(ranks):
        path = out / f"rank{r}.pt"
        assert path.exists(), f"rank {r} wrote nothing:\n{logs[r][-3000:]}"
        results.append(torch.load(path, weights_only=False))
    for res in results:
        crash = str(res.get("crash", ""))
        if "Pair is not connected" in crash and "_initialize_stages" in crash:
            pytest.skip(f"this torch cannot run {what} on gloo: {crash[:200]}")
    return results
