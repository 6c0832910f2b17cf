"""CI's thinned suite (``pytest --thin``): fewer repetitions of one code path, every test still run.

The releases between the oldest and the newest torch, and the Pythons besides
3.11, run the suite thinned (noxfile.py's SUITES): a parametrized test with
``GRID`` or more cases keeps every ``STRIDE``-th case (its first always), and a
property test draws ``examples(n)`` examples instead of ``n``. Every test
function still runs there; the full grids run on torch 2.11, 2.13 and 2.15.
"""

from __future__ import annotations

import os

GRID = 8
STRIDE = 4
ENV = "GRADSAFE_THIN"


def thin() -> bool:
    return os.environ.get(ENV) == "1"


def examples(n: int) -> int:
    """Hypothesis ``max_examples``: ``n``, or a quarter of it (at least 5) in a thinned run."""
    return max(5, n // STRIDE) if thin() else n
