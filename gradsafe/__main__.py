"""Command line: ``gradsafe doctor`` and ``gradsafe verify``."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence

# torch warns at import when numpy is missing; numpy is no dependency of torch
# or gradsafe, and nothing the doctor runs needs it. Set before torch is imported.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from gradsafe.capabilities import CAPABILITIES  # noqa: E402  (imports no torch)
from gradsafe.verify import cli as verify_cli  # noqa: E402  (imports no torch)

_CAPABILITIES = tuple(c.name for c in CAPABILITIES)

_DESCRIPTION = (
    "gradsafe makes PyTorch's gradient paths exact where upstream corrupts, drops or "
    "crashes on gradients. 'gradsafe doctor' reproduces each hazard on the installed torch, "
    "without and with gradsafe, and exits 0 only if gradsafe gets every one right."
)


def main(argv: Sequence[str] | None = None) -> int:
    import gradsafe

    parser = argparse.ArgumentParser(
        prog="gradsafe",
        description=_DESCRIPTION,
        epilog="Run without a command, gradsafe prints this help and exits with status 2.",
    )
    parser.add_argument("--version", action="version", version=f"gradsafe {gradsafe.__version__}")
    commands = parser.add_subparsers(dest="command")
    doctor = commands.add_parser(
        "doctor",
        help="reproduce each hazard on the installed torch, without and with gradsafe",
        description="Reproduce each hazard on the installed torch, without and with gradsafe, "
        "and list what gradsafe.patch() replaces on this torch (with --only: the patches of "
        "those capabilities). Exit status 0: gradsafe gets "
        "every row right; 1: some row is wrong or could not be measured.",
    )
    doctor.add_argument(
        "--json",
        action="store_true",
        help="print the full report as JSON (whole cells, every torch slot each patch replaces)",
    )
    doctor.add_argument(
        "--verbose",
        action="store_true",
        help="list every torch slot each patch replaces instead of their count",
    )
    doctor.add_argument(
        "--only",
        action="append",
        default=[],
        choices=_CAPABILITIES,
        metavar="CAPABILITY",
        help=f"run only this capability's rows (repeatable): {', '.join(_CAPABILITIES)}; "
        "wgrad is a library custom kernels call, the others are gradsafe.patch() names",
    )
    verify_cli.add_parser(commands)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse hands a subcommand's unrecognised arguments back to the
        # top-level parser, whose usage line is not the one the user needs.
        commands.choices.get(args.command, parser).error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "verify":
        return verify_cli.run(args)

    from gradsafe import doctor as doctor_module

    report = doctor_module.run(args.only)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(report.render(doctor_module.terminal_width(), verbose=args.verbose))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
