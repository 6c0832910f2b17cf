"""Print how many stage graphs of the pipelining zoo torch's own split backward gets right.

Usage (from the repository root): ``python tools/zoo_upstream.py [-v]``.

Runs every case of ``tests/pipelining/test_pipelining_zoo.py`` through the
same check as the test (B then W against one fused fp64 backward, by
``tests/pipelining/conftest.py:check_split``), once with the installed torch's
unpatched ``stage_backward_input``/``stage_backward_weight`` and once with
gradsafe's, and prints ``N of M pass on torch X``: the figure
docs/pipelining.md quotes. ``-v`` names each case that fails and why.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "pipelining")]

import conftest  # noqa: E402  (tests/pipelining/conftest.py: check_split)
import test_pipelining_zoo as zoo  # noqa: E402
import torch  # noqa: E402

from gradsafe.pipelining import stage_backward_input, stage_backward_weight  # noqa: E402
from gradsafe.pipelining._torch import split_backward_module  # noqa: E402

Split = tuple[Callable[..., Any], Callable[..., Any]]


def run(split: Split) -> list[tuple[str, str | None]]:
    """(case id, None if it passes else the first line of its failure), per zoo case."""
    results = []
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the zoo's autouse fixture does
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's split warns on some cases; the verdict counts
            for param in zoo.CASES:
                make, loss = param.values
                try:
                    conftest.check_split(make, loss=loss, split=split)
                    results.append((str(param.id), None))
                except Exception as exc:  # a crash is a failure, as in the test
                    first = next((line for line in str(exc).splitlines() if line.strip()), "")
                    results.append((str(param.id), f"{type(exc).__name__}: {first[:150]}"))
    finally:
        torch.set_default_dtype(previous)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="name each failing case")
    args = parser.parse_args()
    upstream = split_backward_module()  # not patched: this process never calls gradsafe.patch()
    splits: dict[str, Split] = {
        "torch's own split": (upstream.stage_backward_input, upstream.stage_backward_weight),
        "gradsafe's split": (stage_backward_input, stage_backward_weight),
    }
    for name, split in splits.items():
        results = run(split)
        passed = sum(failure is None for _, failure in results)
        print(f"{name}: {passed} of {len(results)} pass on torch {torch.__version__}")
        if args.verbose:
            for case, failure in results:
                if failure is not None:
                    print(f"  {case}: {failure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
