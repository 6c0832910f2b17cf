"""The CUDA-graph capture order each rank of a zero-bubble schedule needs (hazard H5).

For ``ScheduleZBVZeroBubble`` and ``ScheduleInterleavedZeroBubble`` on 2 and 4
ranks (2 stages per rank, 2 microbatches per rank), prints per rank the
capture order :class:`gradsafe.cuda_graphs.CaptureOrder` derives from the
schedule's action list (no process group, no GPU), and side by side what
TransformerEngine's ``_order`` list makes of the same order written by hand
(``c``, ``-c``, ``-c-0.5``): whether its count-only validation (modelled)
accepts it, how many wgrad entries its index arithmetic (modelled) matches
to a different microbatch than the schedule runs, and whether gradsafe's
``from_te_order`` parses that list. ``to_te_order`` either converts the
derived order exactly or refuses it with the rule it breaks.

Run: ``PYTHONPATH=. python benchmarks/cuda_graphs_capture_order.py``
"""

from __future__ import annotations

import platform

import torch
from torch.distributed.pipelining import schedules

from gradsafe.cuda_graphs._capture_order_hazards import te_capture, te_count_check, te_wgrad_matches
from gradsafe.cuda_graphs.capture_order import CaptureOrder, CaptureOrderError, EntryKind

SCHEDULES = (schedules.ScheduleZBVZeroBubble, schedules.ScheduleInterleavedZeroBubble)
RANKS = (2, 4)


def hand_written_te(order: CaptureOrder) -> list[float]:
    sign = {EntryKind.FORWARD: 1, EntryKind.DGRAD: -1, EntryKind.WGRAD: -1}
    half = {EntryKind.FORWARD: 0, EntryKind.DGRAD: 0, EntryKind.WGRAD: -0.5}
    return [sign[e.kind] * (e.chunk + 1) + half[e.kind] for e in order]


def _fmt(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


def report(schedule_cls: type, ranks: int) -> None:
    microbatches = 2 * ranks
    print(f"\n== {schedule_cls.__name__}, {ranks} ranks, {microbatches} microbatches")
    for rank in range(ranks):
        order = CaptureOrder.from_schedule_class(
            schedule_cls, rank=rank, ranks=ranks, microbatches=microbatches
        )
        wgrads = [(e.chunk, e.microbatch) for e in order if e.kind is EntryKind.WGRAD]
        floats = hand_written_te(order)
        te_verdict = "accepts" if te_count_check(floats) is None else "refuses"
        te_matched = [(c - 1, mb) for _, c, mb in te_wgrad_matches(floats)]
        wrong = sum(a != b for a, b in zip(te_matched, wgrads))
        captured = te_capture(floats)
        capture = (
            "captures every graph"
            if captured.error is None
            else f"capture fails at position {captured.position} ({captured.error.split('.')[0]})"
        )
        try:
            CaptureOrder.from_te_order(floats)
            parsed = "parses it"
        except CaptureOrderError as exc:
            parsed = f"refuses it at position {exc.position} [{exc.rule.value}]"
        try:
            exact = "to_te_order: " + " ".join(_fmt(v) for v in order.to_te_order().order)
        except CaptureOrderError as exc:
            exact = f"to_te_order refused: {exc}"
        chunks = ", ".join(f"c{i}=stage {s}" for i, s in enumerate(order.stage_indices))
        print(f"rank {rank} ({chunks}): {len(order)} graphs")
        print(f"  {order}")
        print(f"  hand-written TE list: {' '.join(_fmt(v) for v in floats)}")
        print(
            f"    TE (modelled): count check {te_verdict}, wgrad entries matched to another "
            f"microbatch {wrong}/{len(wgrads)}, {capture} | gradsafe from_te_order {parsed}"
        )
        print(f"  {exact}")


def main() -> None:
    print(
        f"torch {torch.__version__}, {platform.machine()}, {platform.processor() or 'cpu'}, "
        "no process group, no GPU"
    )
    for schedule_cls in SCHEDULES:
        for ranks in RANKS:
            report(schedule_cls, ranks)


if __name__ == "__main__":
    main()
