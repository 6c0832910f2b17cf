"""Run torch's own pipelining tests without and with ``gradsafe.patch()`` and print pytest's summary of each.

Usage: ``python tools/torch_pipelining_tests.py DIR [TEST ...]`` where DIR holds
copies of PyTorch's ``test/distributed/pipelining`` files (``test_schedule.py``,
``test_backward.py``, the ``model_registry.py`` they import, ``artifacts/``);
TESTs default to ``test_schedule.py test_backward.py``. Needs ``expecttest``
(torch's test utilities import it). torch's tests are not part of this
repository: fetch them from the PyTorch release matching the installed torch.
The patched run applies every patch before pytest imports the tests (they
import torch's split functions by name).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_RUN = (
    "import sys, pytest\n"
    "if sys.argv[1] == 'patched':\n"
    "    import gradsafe\n"
    "    gradsafe.patch()\n"
    "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rfE', *sys.argv[2:]]))\n"
)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    directory = Path(sys.argv[1])
    tests = sys.argv[2:] or ["test_schedule.py", "test_backward.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    import torch

    print(f"torch {torch.__version__}, tests from {directory}")
    for mode in ("upstream", "patched"):
        proc = subprocess.run(
            [sys.executable, "-c", _RUN, mode, *tests],
            cwd=directory,
            env=env,
            capture_output=True,
            text=True,
        )
        for line in proc.stdout.splitlines():
            if line.startswith(("FAILED", "SUBFAILED", "ERROR")) or " passed" in line:
                print(f"{mode}: {line[:160]}")


if __name__ == "__main__":
    main()
