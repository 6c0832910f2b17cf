"""Print the README's compatibility table from ``gradsafe doctor --json`` run on several torch installs.

Usage: ``python tools/compat_table.py PYTHON [PYTHON ...]`` where each PYTHON is an
interpreter with a torch installed, one venv per torch release, e.g.
``python tools/compat_table.py .venv211/bin/python .venv/bin/python`` after
``python -m venv .venv211 && .venv211/bin/pip install torch==2.11.0 -e .``
(nox deletes its session venvs); gradsafe is taken from this checkout.
Every cell is what that interpreter's doctor measured. Without an interpreter
it prints its usage and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def doctor(python: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [python, "-m", "gradsafe", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return json.loads(proc.stdout)


def verdict(outcome: dict[str, object]) -> str:
    correct = outcome["correct"]
    detail = str(outcome["detail"])
    if correct is True:
        return "right"
    if correct is None:
        return "n/a"
    return "crash" if detail.startswith("crash") else "WRONG"


def main(pythons: list[str]) -> None:
    reports = [doctor(p) for p in pythons]
    versions = [str(r["torch"]).split("+")[0] for r in reports]
    rows = {
        row["hazard"]: row
        for report in reports
        for row in report["rows"]  # type: ignore[index]
    }
    print("| capability | hazard | " + " | ".join(f"torch {v}" for v in versions) + " |")
    print("|---|---" + "|---" * len(versions) + "|")
    for hazard, first in rows.items():
        modelled = first["upstream_source"] != "installed torch"
        cells = []
        for report in reports:
            found = [r for r in report["rows"] if r["hazard"] == hazard]  # type: ignore[index]
            cells.append(
                f"{verdict(found[0]['upstream'])} → {verdict(found[0]['gradsafe'])}"
                if found
                else "–"
            )
        name = f"{hazard} (upstream modelled)" if modelled else hazard
        print(f"| {first['capability']} | {name} | " + " | ".join(cells) + " |")
    print()
    print("Each cell: the installed torch's result → gradsafe's result, from `gradsafe doctor`.")


def parse_args(argv: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(
        prog="python tools/compat_table.py",
        description="Print the README's compatibility table: one column per PYTHON, each an "
        "interpreter with a torch installed (gradsafe is taken from this checkout).",
    )
    parser.add_argument("pythons", metavar="PYTHON", nargs="+")
    return list(parser.parse_args(argv).pythons)


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
