"""``verify``: gradsafe's and torch's split backward against a fused one, on the caller's own model."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from gradsafe.pipelining import CheckpointedWeights, SplitBackwardError
from gradsafe.pipelining.inspection import current_policy
from gradsafe.verify import _isolate, _run, _uncheckpointed
from gradsafe.verify._report import (
    CRASH,
    EXACT,
    HOOKS,
    REFUSED,
    RIGHT,
    SINGLE_PROCESS,
    WRONG,
    GradRow,
    HookRow,
    Memory,
    OrderResult,
    Timing,
    VerifyReport,
    WorkShare,
)
from gradsafe.verify._run import ORDERS, RunResult, Split

__all__ = ["ORDERS", "verify"]

_SEED = 20240611
# Relative tolerance per dtype: a split sums the same terms in another order.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _gradsafe_split() -> Split:
    """The split under test. Looked up at each run, so a test can put a broken W in its place
    (tests/verify/test_verify.py does) and see the check fail."""
    from gradsafe import pipelining

    return Split(
        pipelining.stage_backward_input, pipelining.stage_backward_weight, pipelining.stage_backward
    )


def _torch_split() -> Split:
    from gradsafe.patching import REGISTRY

    where = "torch.distributed.pipelining._backward"
    # torch's own functions, even while gradsafe.patch("pipelining") is active.
    found = [
        cast(Callable[..., Any], REGISTRY.get_original(where, name))
        for name in ("stage_backward_input", "stage_backward_weight", "stage_backward")
    ]
    return Split(*found)


def verify(
    module: nn.Module | Sequence[nn.Module],
    microbatches: Sequence[Any],
    loss_fn: Callable[[Any, int], torch.Tensor] | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    orders: Sequence[str] = tuple(ORDERS),
    time_backward: bool = False,
    memory: bool = False,
    work: bool = False,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Check, on copies of ``module``, that gradsafe's split backward gives a fused backward's gradients.

    The stage (or the list of stages, run in sequence) is deep-copied and cast
    to ``dtype`` for each run. The reference run does one fused backward per
    stage and microbatch; then gradsafe's B/W and torch's own B/W run in each
    W order of :data:`ORDERS` (as zero-bubble schedules place W). Every
    parameter gradient (accumulated over the microbatches), every stage-input
    gradient, and the calls of every hook, checkpoint recomputation and
    custom-Function backward are compared with the reference.

    Args:
        module: one stage, or a list of stages whose outputs feed the next.
        microbatches: the first stage's positional inputs per microbatch (a
            tuple each; a single tensor is taken as a 1-tuple). Floating
            tensors are cast to ``dtype`` and get gradients.
        loss_fn: ``loss_fn(last_output, microbatch_index)`` -> scalar; by
            default a fixed random projection of every output element to a
            scalar (the last stage then gets seeded random output gradients,
            so a parameter-only output stays one).
        dtype: the dtype the copies run in (float64 separates a wrong
            gradient from rounding best).
        orders: names from :data:`ORDERS`.
        time_backward: also measure each run's backward wall and CPU time: the
            calling thread's, or on a CUDA model the process's (autograd runs
            CUDA nodes on a device thread), with the device synchronised
            around each backward.
        memory: also measure each run's peak live tensor memory (see
            :class:`~gradsafe.verify._report.Memory`); with
            ``time_backward`` it is measured in extra runs, so that the
            counting does not slow the timed ones.
        work: also count each stage's backward matmul FLOPs in B and in W
            (:class:`~gradsafe.verify._report.WorkShare`: W's share, and the
            forwards re-run in backward), and run gradsafe's split once more
            with activation checkpointing turned off, to flag a split whose W
            share is under half that run's; not with ``time_backward`` (the
            counting would slow the timed runs), not on CUDA.
        progress: called with one line per run (the command line prints it).

    Returns:
        A :class:`VerifyReport`. The caller's parameters, buffers, gradients
        and hooks, and the global RNG state (torch's, Python's, NumPy's) are
        left as they were: the stages, ``loss_fn`` and the parameters' hooks
        are copied together, closures included, so hooks and the loss act on
        the copies (as in training); a ``loss_fn``'s own parameters are
        checked with the last stage's.

    Raises:
        ValueError: a copy would still reach one of the caller's tensors (a
            global), a parameter's gradient lives where verify does not
            compare it (delayed weights, ``main_grad``), or a stage gets no
            gradient at all in the fused backward (nothing to compare).
        RuntimeError: the fused reference fails, or two fused runs disagree
            ("the model is not reproducible").
    """
    modules, batches = _checked_arguments(module, microbatches, dtype, orders, memory)
    say = progress or (lambda line: None)

    # Counting memory costs a Python call per operator: never in a timed run.
    count_in_checked_runs = memory and not time_backward

    def one(
        split: Split | None, order: str | None, label: str, count: bool = count_in_checked_runs
    ) -> RunResult:
        say(f"verify: {label} ...")
        return _run.run(
            modules,
            batches,
            loss_fn,
            dtype,
            split,
            order,
            _SEED,
            find_hazards=split is None,
            memory=count,
            work=work,
        )

    if work and (time_backward or any(p.is_cuda for m in modules for p in m.parameters())):
        raise ValueError(
            "verify(work=True) counts FLOPs with a dispatch mode on the calling thread: not in "
            "timed runs (it would slow them) and not on CUDA (autograd runs a CUDA backward on a "
            "thread of its own). Count W's share on a CPU copy, without time_backward."
        )
    with _isolate.python_rng_kept():
        return _verify(one, modules, batches, dtype, orders, time_backward, memory)


def _verify(
    one: Callable[..., RunResult],
    modules: list[nn.Module],
    batches: list[tuple[Any, ...]],
    dtype: torch.dtype,
    orders: Sequence[str],
    time_backward: bool,
    memory: bool,
) -> VerifyReport:
    """``verify``'s runs: the reference twice, then each split in each order."""
    if time_backward:  # first-call costs (allocator, kernels) would otherwise land on the reference
        one(None, None, "fused backward (warm-up for timing)")
    reference = one(None, None, "fused backward (reference)")
    if reference.error is not None:
        raise RuntimeError(
            f"the fused reference backward failed ({reference.where}): {reference.error!r}; "
            "verify needs a model whose ordinary backward runs."
        ) from reference.error
    _refuse_nothing_to_compare(reference, len(modules))
    _refuse_unreproducible(
        reference, one(None, None, "fused backward again (reproducible?)"), dtype
    )
    runs: dict[str, dict[str, RunResult]] = {"gradsafe": {}, "upstream": {}}
    for order in orders:
        runs["gradsafe"][order] = one(_gradsafe_split(), order, f"gradsafe's split, {order}")
        runs["upstream"][order] = one(_torch_split(), order, f"torch's split, {order}")
    peaks = None
    if memory:
        peaks = _measure_peaks(one, orders) if time_backward else _peaks(reference, runs)
    report = _report(
        reference, runs, tuple(orders), dtype, len(modules), len(batches), time_backward
    )
    work = None
    if reference.flops is not None:
        work = _work(reference, runs, len(modules), _uncheckpointed_run(one, orders[0]))
    return dataclasses.replace(report, memory=peaks, work=work)


def _uncheckpointed_run(one: Callable[..., RunResult], order: str) -> RunResult | str:
    """gradsafe's split with activation checkpointing turned off (the reference of the W-share
    flag), or why it was not measured."""
    names = _uncheckpointed.globals_to_replace()
    if isinstance(names, str):
        return names
    label = f"gradsafe's split, {order}, checkpointing off (W share reference)"
    with _uncheckpointed.checkpointing_off(names):
        run = one(_gradsafe_split(), order, label, False)
    if run.error is not None:
        return f"the run without checkpointing failed ({run.where}): {run.error!r}"
    return run


def _work(
    reference: RunResult,
    runs: dict[str, dict[str, RunResult]],
    stages: int,
    uncheckpointed: RunResult | str,
) -> dict[str, dict[str, tuple[WorkShare, ...]]]:
    """Per implementation and order (fused: "fused"; the run without checkpointing:
    "uncheckpointed"), each stage's B and W FLOPs and re-runs, the splits' against the
    uncheckpointed W share. Crashed runs are left out."""
    table = {"fused": {"fused": reference}} | runs
    plain: tuple[WorkShare | str, ...]
    if isinstance(uncheckpointed, str):
        plain = (uncheckpointed,) * stages
    else:
        table["uncheckpointed"] = {next(iter(runs["gradsafe"])): uncheckpointed}  # first order's
        plain = tuple(_stage_work(uncheckpointed, s, stages) for s in range(stages))
    return {
        impl: {
            order: tuple(
                _stage_work(run, s, stages, plain[s] if impl in runs else None)
                for s in range(stages)
            )
            for order, run in per.items()
            if run.error is None and run.flops is not None
        }
        for impl, per in table.items()
    }


def _stage_work(
    run: RunResult, stage: int, stages: int, uncheckpointed: WorkShare | str | None = None
) -> WorkShare:
    """One stage's work in ``run``; a split's compared with ``uncheckpointed`` (that stage
    without checkpointing, or why it was not measured)."""

    def of(counts: dict[tuple[str, int], int] | None, *kinds: str) -> int:
        return sum((counts or {}).get((kind, stage), 0) for kind in kinds)

    b, w = of(run.flops, "B"), of(run.flops, "W", "BW")
    b_again, w_again = of(run.recomputed_flops, "B"), of(run.recomputed_flops, "W", "BW")
    own = (
        (lambda where: True)
        if stages == 1
        else (lambda where: where == str(stage) or where.startswith(f"{stage}."))
    )
    recomputed = sum(
        count
        for label, count in run.counts.items()
        if label.startswith("forward of ")
        and label.endswith(" recomputed in backward")
        and own(label.removeprefix("forward of ").removesuffix(" recomputed in backward"))
    )
    share = w / (b + w) if b + w else None
    gradients = b + w - b_again - w_again
    measured = WorkShare(
        stage,
        b,
        w,
        share,
        recomputed,
        b_recomputed_flops=b_again,
        w_recomputed_flops=w_again,
        w_share_of_gradients=(w - w_again) / gradients if gradients else None,
        unsplit_compiled=run.unsplit_compiled.get(stage, 0),
    )
    if uncheckpointed is None:
        return measured
    if isinstance(uncheckpointed, str):
        return dataclasses.replace(measured, not_measured=uncheckpointed)
    plain = uncheckpointed.w_share
    low = share is not None and plain is not None and plain > 0 and share < 0.5 * plain
    return dataclasses.replace(measured, uncheckpointed_w_share=plain, w_share_low=low)


def _refuse_nothing_to_compare(reference: RunResult, stages: int) -> None:
    """Raise if some stage gets no gradient at all in the fused run: every split would then
    compare None with None and pass, whatever it does."""
    for stage in range(stages):
        prefix = f"{stage}." if stages > 1 else ""
        mine = [g for n, g in reference.params.items() if n.startswith(prefix)]
        mine += [g for n, g in reference.inputs.items() if n.startswith(f"stage {stage} input")]
        moved = any(n.startswith(f"value of {prefix}") for n in reference.values)
        if moved or any(g is not None for g in mine):
            continue
        if stage == 0 < stages - 1 and not mine:  # a fused first stage without parameters
            continue
        raise ValueError(
            f"nothing to compare on stage {stage}: the fused backward gives none of its "
            f"{len(mine)} parameter and input gradient(s) a value, so every split would pass "
            "unchecked. Its output reaches none of them: the stage returns None, a number or "
            "a tensor detached from its parameters, or its parameters do not require grad. Return "
            "the output tensor(s) the next stage (or the loss) uses."
        )


def _refuse_unreproducible(first: RunResult, second: RunResult, dtype: torch.dtype) -> None:
    """Raise if two fused runs from the same seed disagree: then no split can be judged by them."""
    if second.error is not None:
        raise RuntimeError(
            f"the model is not reproducible: its fused backward ran once and then failed "
            f"({second.where}): {second.error!r}"
        ) from second.error
    first_values = {**first.params, **first.inputs, **first.values}
    second_values = {**second.params, **second.inputs, **second.values}
    for name in dict.fromkeys([*first_values, *second_values]):
        err, ok = _run.compare(first_values.get(name), second_values.get(name), _TOLERANCE[dtype])
        if not ok:
            raise RuntimeError(
                f"the model is not reproducible: two fused backwards from the same seed give "
                f"{name} {err if isinstance(err, str) else f'{err:.3g} relative'} apart, so no "
                "split can be judged against them. verify seeds torch's RNG for each run; the "
                "usual causes are draws from Python's `random` or NumPy's RNG, a global counter "
                "the forward reads (a step number, a cache), or a nondeterministic kernel "
                "(torch.use_deterministic_algorithms(True) finds those). Make the forward "
                "depend on torch's RNG only, or fix it, for the check."
            )


def _checked_arguments(
    module: nn.Module | Sequence[nn.Module],
    microbatches: Sequence[Any],
    dtype: torch.dtype,
    orders: Sequence[str],
    memory: bool,
) -> tuple[list[nn.Module], list[tuple[Any, ...]]]:
    """``verify``'s stages and microbatches as lists, or the error that names what to pass instead."""
    modules = [module] if isinstance(module, nn.Module) else list(module)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("module must be an nn.Module or a non-empty sequence of them (the stages).")
    unknown = [o for o in orders if o not in ORDERS]
    if unknown or not orders:
        raise ValueError(f"unknown W order(s) {unknown}; choose from {list(ORDERS)}.")
    if dtype not in _TOLERANCE:
        raise ValueError(f"dtype must be one of {list(_TOLERANCE)}, got {dtype}.")
    _run.refuse_gradients_kept_elsewhere(modules)
    if isinstance(microbatches, torch.Tensor):  # iterating it would make each row a microbatch
        raise TypeError(
            f"microbatches is one tensor of shape {tuple(microbatches.shape)}; pass a list of "
            "microbatches, each a tuple of the first stage's inputs (e.g. [(x,)] for one)."
        )
    batches = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in microbatches]
    if not batches:
        raise ValueError("microbatches is empty: pass at least one microbatch.")
    if memory and any(p.is_cuda for m in modules for p in m.parameters()):
        raise ValueError(
            "verify(memory=True) counts tensor storage with a dispatch mode on the calling "
            "thread, and autograd runs a CUDA backward on a device thread of its own, so the "
            "count would leave out the backward's memory. Verify memory on a CPU copy of the "
            "model, or read torch.cuda.max_memory_allocated around your own steps."
        )
    return modules, batches


def _peaks(
    reference: RunResult, runs: dict[str, dict[str, RunResult]]
) -> dict[str, dict[str, Memory]]:
    def of(run: RunResult) -> Memory | None:
        return None if run.error is not None or run.peak_bytes is None else Memory(run.peak_bytes)

    table: dict[str, dict[str, Memory | None]] = {"fused": {"fused": of(reference)}}
    table |= {impl: {o: of(r) for o, r in per.items()} for impl, per in runs.items()}
    return {impl: {o: m for o, m in per.items() if m is not None} for impl, per in table.items()}


def _measure_peaks(
    one: Callable[..., RunResult], orders: Sequence[str]
) -> dict[str, dict[str, Memory]]:
    reference = one(None, None, "fused backward (memory)", True)
    runs = {
        impl: {o: one(make(), o, f"{name}, {o} (memory)", True) for o in orders}
        for impl, name, make in (
            ("gradsafe", "gradsafe's split", _gradsafe_split),
            ("upstream", "torch's split", _torch_split),
        )
    }
    return _peaks(reference, runs)


def _report(
    reference: RunResult,
    runs: dict[str, dict[str, RunResult]],
    orders: tuple[str, ...],
    dtype: torch.dtype,
    stages: int,
    microbatches: int,
    timed: bool,
) -> VerifyReport:
    tol = _TOLERANCE[dtype]
    rows, oks = _grad_rows(reference, runs, tol)
    verdicts: dict[str, dict[str, OrderResult]] = {}
    refused = None
    for impl, per in runs.items():
        verdicts[impl] = {}
        for order, res in per.items():
            verdicts[impl][order] = _order_result(impl, order, res, reference, oks)
            if impl == "gradsafe" and isinstance(res.error, SplitBackwardError) and refused is None:
                refused = str(res.error)
    timing = None
    if timed:
        timing = {"fused": {"fused": Timing(*reference.timing)}} | {
            impl: {o: Timing(*r.timing) for o, r in per.items() if r.error is None}
            for impl, per in runs.items()
        }
    return VerifyReport(
        mode=SINGLE_PROCESS,
        torch_version=torch.__version__,
        dtype=str(dtype).removeprefix("torch."),
        stages=stages,
        microbatches=microbatches,
        checks=orders,
        tolerance=tol,
        gradsafe=verdicts["gradsafe"],
        upstream=verdicts["upstream"],
        grads=rows,
        hooks=_hook_rows(reference, runs),
        hazards={name: tuple(sorted(params)) for name, params in sorted(reference.hazards.items())},
        refused=refused,
        timing=timing,
    )


Oks = dict[str, dict[str, dict[str, bool | None]]]  # gradient -> implementation -> order -> ok


def _grad_rows(
    reference: RunResult, runs: dict[str, dict[str, RunResult]], tol: float
) -> tuple[tuple[GradRow, ...], Oks]:
    """One row per parameter, parameter move and stage input (the worst over microbatches);
    and, per gradient of each microbatch, whether each run got it right."""
    moves = _changed_values(reference, runs)
    wanted = {**reference.params, **reference.inputs, **moves}
    errors: dict[str, dict[str, dict[str, float | str | None]]] = {n: {} for n in wanted}
    oks: Oks = {n: {} for n in wanted}
    for impl, per in runs.items():
        for order, res in per.items():
            moved = {k: res.values.get(k, torch.zeros_like(v)) for k, v in moves.items()}
            got = {**res.params, **res.inputs, **moved}
            for name, want in wanted.items():
                err, ok = (
                    (None, None)
                    if res.error is not None
                    else _run.compare(want, got.get(name), tol)
                )
                errors[name].setdefault(impl, {})[order] = err
                oks[name].setdefault(impl, {})[order] = ok
    merged: dict[str, list[str]] = {}
    for name in wanted:
        merged.setdefault(name.split(", microbatch")[0], []).append(name)
    rows: list[GradRow] = []
    for row_name, names in merged.items():
        row_errors: dict[str, dict[str, float | str | None]] = {}
        row_oks: dict[str, dict[str, bool | None]] = {}
        for impl, per in runs.items():
            for order in per:
                values = [errors[n][impl][order] for n in names]
                flags = [oks[n][impl][order] for n in names]
                row_errors.setdefault(impl, {})[order] = _worst_of(values)
                row_oks.setdefault(impl, {})[order] = None if None in flags else all(flags)
        present = [t for t in (wanted[n] for n in names) if t is not None]
        maxima = [float(t.abs().max()) if t.numel() else 0.0 for t in map(_dense, present)]
        rows.append(
            GradRow(
                row_name,
                reference.shapes[names[0]],
                max(maxima) if maxima else None,
                row_errors,
                row_oks,
            )
        )
    return tuple(rows), oks


def _hook_rows(reference: RunResult, runs: dict[str, dict[str, RunResult]]) -> tuple[HookRow, ...]:
    labels = sorted(
        set(reference.counts).union(*(r.counts for per in runs.values() for r in per.values()))
    )
    return tuple(
        HookRow(
            label,
            reference.counts[label],
            {
                impl: {o: None if r.error else r.counts[label] for o, r in per.items()}
                for impl, per in runs.items()
            },
        )
        for label in labels
    )


def _changed_values(
    reference: RunResult, runs: dict[str, dict[str, RunResult]]
) -> dict[str, torch.Tensor]:
    """Fused's parameter moves (zeros where it moved none) that some run left otherwise: a
    hook stepping the parameters in backward (an optimizer step in backward)."""
    done = [r for per in runs.values() for r in per.values() if r.error is None]
    changed: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(k for r in (reference, *done) for k in r.values):
        some = next(r.values[key] for r in (reference, *done) if key in r.values)
        want = reference.values.get(key, torch.zeros_like(some))
        if any(not torch.equal(r.values.get(key, torch.zeros_like(some)), want) for r in done):
            changed[key] = want
    return changed


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a form with ``abs().max()``: a sparse gradient dense."""
    return t.to_dense()


def _worst_of(values: list[float | str | None]) -> float | str | None:
    if None in values:
        return None
    if "None pattern" in values:
        return "None pattern"
    return max(v for v in values if isinstance(v, float))


def _chosen_recompute(
    label: str, counts: collections.Counter[str], reference: collections.Counter[str]
) -> bool:
    """A region's forward re-run in gradsafe's W as well as in B, as the policy in force
    (``CheckpointedWeights.RECOMPUTE_IN_W``) chooses: up to twice the fused count."""
    return (
        current_policy() is CheckpointedWeights.RECOMPUTE_IN_W
        and label.endswith(" recomputed in backward")
        and reference[label] <= counts[label] <= 2 * reference[label]
    )


def _order_result(
    impl: str, order: str, res: RunResult, reference: RunResult, oks: Oks
) -> OrderResult:
    """One implementation's verdict in one order (the report renders it: ``_report._cell``)."""
    if res.error is not None:
        kind = (
            REFUSED if impl == "gradsafe" and isinstance(res.error, SplitBackwardError) else CRASH
        )
        return OrderResult(
            kind, message=f"{type(res.error).__name__}: {res.error}", where=res.where
        )
    wrong = tuple(
        dict.fromkeys(
            name.split(", microbatch")[0] for name, per in oks.items() if per[impl][order] is False
        )
    )
    counts: collections.Counter[str] = res.counts
    hooks = tuple(
        sorted(
            label
            for label in set(counts) | set(reference.counts)
            if counts[label] != reference.counts[label]
            and not (impl == "gradsafe" and _chosen_recompute(label, counts, reference.counts))
        )
    )
    if wrong:
        return OrderResult(WRONG, wrong, hooks)
    if hooks:
        return OrderResult(HOOKS if impl == "upstream" else WRONG, (), hooks)
    return OrderResult(EXACT if impl == "gradsafe" else RIGHT)
