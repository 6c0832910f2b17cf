"""Command line: ``gradsafe verify PACKAGE.MODULE:FACTORY`` (imports torch only when run)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradsafe.verify import VerifyReport

__all__ = ["add_parser", "run"]

_DTYPES = ("float64", "float32", "bfloat16")
_ORDERS = ("w-after-b", "w-reversed", "w-lag-3")  # gradsafe.verify.ORDERS, without torch
_SCHEDULES = ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble", "Interleaved1F1B")

EXACT, NOT_EXACT, REFUSED = 0, 1, 2


def add_parser(commands: Any) -> None:
    verify = commands.add_parser(
        "verify",
        help="check on your own model that gradsafe's split backward equals a fused backward",
        description="Build your stages with FACTORY, a zero-argument callable returning "
        "(module_or_stages, microbatches) or (module_or_stages, microbatches, loss_fn), and "
        "compare gradsafe's and torch's split backward (B/W in the W orders zero-bubble "
        "schedules use) with a fused backward on copies of them. Exit status 0: gradsafe is "
        "exact; 1: it is not (a gradsafe bug, the table says where); 2: gradsafe refuses to "
        "split this model (the reason is printed), the arguments are wrong, or the model could "
        "not be built, run, reproduced (two fused runs disagree) or isolated from your own. "
        "Runs with one intra-op thread unless OMP_NUM_THREADS is set.",
    )
    verify.add_argument("factory", metavar="PACKAGE.MODULE:FACTORY", nargs="?")
    verify.add_argument(
        "--orders",
        default=",".join(_ORDERS),
        help=f"comma-separated W orders (default: all): {', '.join(_ORDERS)}",
    )
    verify.add_argument(
        "--dtype", choices=_DTYPES, default="float64", help="dtype of the copies (default float64)"
    )
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_measurements(verify)
    verify.add_argument(
        "--schedule",
        choices=_SCHEDULES,
        help="instead, run torch's real PipelineStage and Schedule<NAME> on local gloo ranks, "
        "with and without gradsafe.patch('pipelining'), against one process (FACTORY must "
        "return 2 stages per rank: 2 for --ranks 1, the two stages of one rank of a V; V-shaped "
        "placement for ZBV and DualPipeV, a loop for the interleaved schedules)",
    )
    verify.add_argument(
        "--torchtitan",
        metavar="MODEL[:CONFIG]",
        help="instead of FACTORY, build torchtitan.models.MODEL's config CONFIG (default "
        "MODEL_debugmodel) from torchtitan's config registry, cut to one layer per stage, split "
        "into the stages torchtitan's pipeline makes for --schedule on --ranks ranks, with the "
        "config's activation checkpointing, and verify them in one process (needs --schedule)",
    )
    verify.add_argument(
        "--ranks",
        type=int,
        choices=(1, 2, 4),
        default=2,
        help="gloo ranks for --schedule, two stages each (default 2)",
    )
    verify.add_argument(
        "--traceback",
        action="store_true",
        help="on an error from the factory or the model, print its full traceback",
    )


def _add_measurements(parser: Any) -> None:
    """The options that measure the single-process runs besides comparing them."""
    parser.add_argument(
        "--time", action="store_true", help="also time each run's backward (wall and thread CPU)"
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also measure each run's peak live tensor memory (counted on CPU too) against fused",
    )
    parser.add_argument(
        "--work",
        action="store_true",
        help="also count each stage's backward matmul FLOPs in B and W: W's share, and the "
        "forwards re-run in backward (not with --time)",
    )


def run(args: argparse.Namespace) -> int:
    problem = _argument_problem(args)  # before importing torch (and torchtitan): seconds
    if problem is not None:
        print(f"gradsafe verify: {problem}", file=sys.stderr)
        return REFUSED
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        # verify runs many small ops several times over: intra-op threads only
        # spin on them (a 12-block d=128 model: 14 s with one thread, 100 s
        # with two on a loaded 2-core machine). OMP_NUM_THREADS overrides.
        torch.set_num_threads(1)
    # With --json, stdout is the report alone: what the factory or the model prints goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with quiet:
            if args.schedule and args.torchtitan is None:
                report = _schedule_report(args)
            else:
                report = _report(args)
    except Exception as exc:  # the user's factory or model: report, exit 2
        _print_error(exc, args.traceback)
        return REFUSED
    # The hint for H6 and H7 names the command that checks them on this factory.
    report = dataclasses.replace(report, factory=args.factory)
    _print_report(report.to_json() if args.json else report, args.json)
    if report.ok:
        return EXACT
    return REFUSED if report.refused_only else NOT_EXACT


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments alone, found without importing torch."""
    if (args.factory is None) == (args.torchtitan is None):
        return "give either FACTORY or --torchtitan MODEL[:CONFIG]"
    if args.torchtitan is not None and args.schedule is None:
        return "--torchtitan needs --schedule NAME (the stages depend on it)"
    if args.torchtitan is not None and importlib.util.find_spec("torchtitan") is None:
        return (
            "--torchtitan needs torchtitan, which is not installed here: "
            'pip install "gradsafe[torchtitan]"'
        )
    if args.factory is not None:
        module_name, sep, attr = args.factory.partition(":")
        if not sep or not module_name or not attr:
            return f"expected PACKAGE.MODULE:FACTORY, got {args.factory!r}"
    measured = [f"--{name}" for name in ("time", "memory", "work") if getattr(args, name)]
    if measured and args.schedule and args.torchtitan is None:
        return (
            f"{' and '.join(measured)} measure the single-process runs; --schedule with a "
            "FACTORY runs torch's schedule on gloo ranks and measures none of them: drop "
            f"{' and '.join(measured)}, or run without --schedule"
        )
    if args.time and args.work:
        return "--work counts FLOPs in every run: not in timed runs (it would slow them); drop --time or --work"
    unknown = [o for o in args.orders.split(",") if o and o not in _ORDERS]
    if unknown or not any(args.orders.split(",")):
        return f"unknown W order(s) {unknown} in --orders; choose from {', '.join(_ORDERS)}"
    return None


def _report(args: argparse.Namespace) -> VerifyReport:
    import torch

    from gradsafe.verify import verify
    from gradsafe.verify._factory import load_factory

    if args.torchtitan is not None:
        from gradsafe.verify._torchtitan import build_stages

        module, microbatches, *rest = build_stages(args.torchtitan, args.schedule, args.ranks)
    else:
        module, microbatches, *rest = load_factory(args.factory)
    return verify(
        module,
        microbatches,
        rest[0] if rest else None,
        dtype=getattr(torch, args.dtype),
        orders=[o for o in args.orders.split(",") if o],
        time_backward=args.time,
        memory=args.memory,
        work=args.work,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )


def _schedule_report(args: argparse.Namespace) -> VerifyReport:
    import torch

    from gradsafe.verify._schedule import verify_schedule

    return verify_schedule(
        args.factory,
        args.schedule,
        args.ranks,
        getattr(torch, args.dtype),
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )


def _print_error(exc: BaseException, full: bool) -> None:
    if full:
        traceback.print_exception(exc, file=sys.stderr)
        return
    print(f"gradsafe verify: {type(exc).__name__}: {exc}", file=sys.stderr)
    print("(run with --traceback to see where it was raised)", file=sys.stderr)


def _print_report(report: Any, as_json: bool) -> None:
    """Print, and stop quietly when the reader has gone (``gradsafe verify --json | head``)."""
    try:
        print(json.dumps(report, indent=2) if as_json else report, flush=True)
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at devnull so that raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
