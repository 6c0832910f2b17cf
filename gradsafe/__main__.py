"""Command line: ``gradsafe doctor [--json]`` and ``gradsafe status``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsafe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser(
        "doctor", help="reproduce each hazard on the installed torch, without and with gradsafe"
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--only", action="append", default=[], metavar="CAPABILITY",
        help="run only this capability's rows (repeatable)",
    )
    commands.add_parser("status", help="print which patches apply to the installed torch")
    args = parser.parse_args(argv)

    if args.command == "status":
        import gradsafe

        print(gradsafe.status())
        return 0

    from gradsafe import doctor as doctor_module

    report = doctor_module.run(args.only)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
