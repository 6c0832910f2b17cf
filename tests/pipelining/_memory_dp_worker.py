"""One of 2 gloo ranks: live storage during B and W of a data-parallel stage, gradsafe vs baselines.

Run by test_pipelining_memory_dp.py. argv: rank init_method outdir. Writes outdir/rank{r}.pt:
``{"points": {case: {point: bytes}}, "grads": {case: [gradients]}, "unsharded": {case:
{point: bytes FSDP2's unsharded parameters hold}}}`` or ``{"crash": ...}``,
a case being ``(wrapper, stage, order, impl)``, ``impl`` one of ``WRAPPERS[wrapper]``.

The stage (Linear + tanh layers, a middle stage: its output gradient comes from
the next stage) is wrapped over both ranks: FSDP2 (``fully_shard``, parameters
really sharded in two), with ``reshard_after_forward=False`` ("fsdp": torch's
split is handed the parameters the graph holds, so it computes every gradient
and the comparison is like for like) or ``True`` ("fsdp resharded",
torchtitan's default for non-last stages: torch's split is handed sharded
parameters the graph does not hold and misses their gradients, so the
baseline is a fused backward of the same stage), or DDP. B and W are called
the way ``stage.py`` calls them (``backward_maybe_with_nosync``), "fused" as
its full backward per microbatch (in B's place; W does nothing): FSDP2's
flags set before each; DDP under ``no_sync`` except the last microbatch's B
and W, before which the reducer is prepared; the stage output kept until its
W, the input gradients until the step ends. Then the step's gradient
reduction as ``stage.py`` ends a step (FSDP2's post-backward with gradient
sync; DDP reduced in its hooks). Both ranks get the same data, so the reduced
gradients equal each rank's own.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tests._rank_worker import run_rank

MICROBATCHES = 3
# (layers, dim, tokens per microbatch): weight gradients dominate, activations dominate.
STAGES = {"weight-dominated": (4, 256, 8), "activation-dominated": (4, 32, 512)}
ORDERS = ("every B, then every W", "B and W per microbatch")
# wrapper -> the backwards measured on it
WRAPPERS = {
    "fsdp": ("fused", "torch", "gradsafe"),
    "fsdp resharded": ("fused", "gradsafe"),
    "ddp": ("torch", "gradsafe"),
}


def _stage(name: str) -> nn.Module:
    layers, dim, _ = STAGES[name]
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())))


def _wrap(module: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    resharded = wrapper == "fsdp resharded"
    fully_shard(module, mesh=init_device_mesh("cpu", (2,)), reshard_after_forward=resharded)
    return module


def _manual_finalization(model: nn.Module) -> bool:
    """Whether this torch's ``stage.py`` finalizes FSDP2's backward by hand (2.15 on).

    Earlier stages mark every backward as not the last one and call each
    parameter group's ``post_backward`` at the end of the step.
    """
    return hasattr(model, "set_manual_backward_finalization")


def _forward_as_stage(wrapper: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One forward as ``stage.py``'s ``forward_maybe_with_nosync`` runs it."""
    if wrapper == "ddp":
        with model.no_sync():  # type: ignore[operator]
            return model(x)
    if _manual_finalization(model):
        model.set_manual_backward_finalization(True)  # type: ignore[operator]
    return model(x)


def _backward_as_stage(wrapper: str, model: nn.Module, last: bool, outputs: Any, run: Any) -> Any:
    """One B or W as ``stage.py``'s ``backward_maybe_with_nosync`` runs it."""
    if wrapper == "ddp":
        if not last:
            with model.no_sync():  # type: ignore[operator]
                return run()
        from torch.nn.parallel.distributed import _find_tensors

        model.reducer.prepare_for_backward(list(_find_tensors(outputs)))  # type: ignore[union-attr, operator]
        return run()
    if not _manual_finalization(model):
        model.set_is_last_backward(False)  # type: ignore[operator]
    model.set_reshard_after_backward(False)  # type: ignore[operator]
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    return run()


def _end_step(wrapper: str, model: nn.Module) -> None:
    """What ``stage.py`` does once every W has run: FSDP2's reduce-scatter (DDP reduced in its hooks)."""
    if wrapper == "ddp":
        return
    from torch.distributed.fsdp import fully_shard

    model.set_reshard_after_backward(True)  # type: ignore[operator]
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    if _manual_finalization(model):
        model.finalize_backward(async_op=True).wait()  # type: ignore[operator]
        model.set_manual_backward_finalization(False)  # type: ignore[operator]
        return
    model.set_is_last_backward(True)  # type: ignore[operator]
    state = fully_shard.state(model)  # type: ignore[attr-defined]
    for each in state._state_ctx.all_states:
        for group in getattr(each, "_fsdp_param_groups", None) or [each._fsdp_param_group]:
            group.post_backward()
    state._root_post_backward_final_callback()


@contextlib.contextmanager
def _all_gather_buffers_die_when_fsdp_drops_them() -> Iterator[list[Any]]:
    """While inside, FSDP2's flat all-gather buffer is freed before the stage goes on.

    gloo's worker thread holds a finished collective's tensors until it takes
    its next task; on a loaded machine that was, by chance, after the next W
    (1028 KiB held through B0 and W0 in 1 run of 8 on one rank; likewise
    DDP's initial broadcast into B0's peak, see ``_settle``). Each
    ``wait_for_unshard`` therefore waits until the thread has let go of the
    buffer FSDP2 just dropped; one FSDP2 keeps for the next forward's overlap
    goes on the yielded list, for the caller to wait on once FSDP2 drops it.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.multiprocessing.reductions import StorageWeakRef

    kept: list[Any] = []
    original = FSDPParamGroup.wait_for_unshard

    def wait_for_unshard(self: Any) -> None:
        result = self._all_gather_result
        if result is None:
            return original(self)
        ref = StorageWeakRef(result.all_gather_output.untyped_storage())
        del result
        original(self)
        state = self.comm_ctx.all_gather_state
        saved = state is not None and state.all_gather_result.all_gather_output
        if saved is not False and StorageWeakRef(saved.untyped_storage()) == ref:
            kept.append(ref)
        else:
            _wait_freed([ref])

    FSDPParamGroup.wait_for_unshard = wait_for_unshard  # type: ignore[method-assign]
    try:
        yield kept
    finally:
        FSDPParamGroup.wait_for_unshard = original  # type: ignore[method-assign]


def _wait_freed(refs: list[Any]) -> None:
    deadline = time.monotonic() + 30
    while not all(ref.expired() for ref in refs):
        if time.monotonic() > deadline:
            raise RuntimeError(
                "an FSDP2 all-gather buffer was still alive 30 s after FSDP2 dropped it"
            )
        time.sleep(0.001)
    refs.clear()


def _settle(live: Any) -> None:
    """Waits until gloo's worker threads have let go of the tensors of finished collectives.

    No handle shows when they do: the count must hold still for 100 ms (at most 10 s).
    """
    deadline, still_since, last = time.monotonic() + 10, time.monotonic(), live.live()
    while time.monotonic() - still_since < 0.1 and time.monotonic() < deadline:
        time.sleep(0.005)
        now = live.live()
        if now != last:
            still_since, last = time.monotonic(), now


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        g = p.grad
        full = getattr(g, "full_tensor", None)
        out.append((full() if full is not None else g).detach().clone())
    return out


def _fused_b(outputs: Any, grads: Any, inputs: Any, weights: Any) -> Any:
    """``stage.py``'s full backward (``stage_backward``) where B runs; its W does nothing."""
    from torch.distributed.pipelining._backward import stage_backward

    return stage_backward(outputs, grads, inputs), None


def _unsharded_bytes(model: nn.Module) -> int:
    """Bytes FSDP2's unsharded parameters hold now (0 once resharded; 0 for DDP)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(model, FSDPModule):
        return 0
    state = fully_shard.state(model)  # type: ignore[attr-defined]
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    return sum(
        fsdp_param._unsharded_param.untyped_storage().nbytes()
        for group in groups
        for fsdp_param in group.fsdp_params
    )


def measure(
    wrapper: str, stage: str, order: str, impl: str
) -> tuple[dict[str, int], list[Any], dict[str, int]]:
    from torch.distributed.pipelining import _backward as torch_split

    from gradsafe.pipelining import stage_backward_input, stage_backward_weight
    from gradsafe.testing import LiveStorage

    b, w = {
        "gradsafe": (stage_backward_input, stage_backward_weight),
        "torch": (torch_split.stage_backward_input, torch_split.stage_backward_weight),
        "fused": (_fused_b, lambda weights, handoff: None),
    }[impl]
    module = _stage(stage)
    _, dim, tokens = STAGES[stage]
    torch.manual_seed(1)  # the same data on both ranks
    xs = [torch.randn(tokens, dim, requires_grad=True) for _ in range(MICROBATCHES)]
    gs = [torch.randn(tokens, dim) for _ in range(MICROBATCHES)]
    if order == ORDERS[0]:
        steps = [("B", i) for i in range(MICROBATCHES)] + [("W", i) for i in range(MICROBATCHES)]
    else:
        steps = [(kind, i) for i in range(MICROBATCHES) for kind in "BW"]
    last = MICROBATCHES - 1
    points: dict[str, int] = {}
    existing = [*module.parameters(), *xs, *gs]
    with _all_gather_buffers_die_when_fsdp_drops_them() as kept, LiveStorage(existing) as live:
        # Wrapped inside: what the wrapper allocates (FSDP2's shards, DDP's buckets, which only
        # gradsafe's W writes into: torch's W fires no hooks) is counted from the start in both.
        model = _wrap(module, wrapper)
        outs: list[Any] = [_forward_as_stage(wrapper, model, x) for x in xs]
        # Garbage the wrapping left (DDP's init) would otherwise die whenever the cyclic
        # collector next runs, in either run's B (gradsafe pauses the collector in B and W).
        gc.collect()
        _wait_freed(kept)  # the forwards' all-gather buffers, dropped by the root's post-forward
        _settle(live)  # DDP's initial broadcast
        live.mark()
        gathered = {"before B0": _unsharded_bytes(model)}
        handoffs: list[Any] = [None] * MICROBATCHES
        input_grads = []  # torch's stage keeps them (bwd_cache) until they are sent
        for kind, i in steps:
            if kind == "B":

                def run_b(i: int = i) -> Any:
                    return b([outs[i]], [gs[i]], [xs[i]], model.parameters())

                dinputs, handoffs[i] = _backward_as_stage(wrapper, model, i == last, outs[i], run_b)
                input_grads.append(dinputs)
            else:

                def run_w(i: int = i) -> Any:
                    return w(model.parameters(), handoffs[i])

                _backward_as_stage(wrapper, model, i == last, outs[i], run_w)
                handoffs[i] = outs[i] = None  # the schedule pops its backward_state entry
            points[f"peak during {kind}{i}"] = live.peak_since_mark
            points[f"after {kind}{i}"] = live.mark()
            gathered[f"after {kind}{i}"] = _unsharded_bytes(model)
        _end_step(wrapper, model)
        points["peak during the reduction"] = live.peak_since_mark
        # FSDP2's reduction leaves a reference cycle holding a gradient-sized buffer, in both
        # runs; when the collector frees it is chance. Read what is still referenced.
        gc.collect()
        _settle(live)  # FSDP2's reduce-scatter
        points["after the reduction"] = live.mark()
        points["peak of the step"] = max(v for k, v in points.items() if k.startswith("peak"))
        gathered["after the reduction"] = _unsharded_bytes(model)
    return points, _grads(model), gathered


def main() -> None:
    rank, init_method, outdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]

    def body() -> dict[str, Any]:
        result: dict[str, Any] = {"points": {}, "grads": {}, "unsharded": {}}
        for wrapper, impls in WRAPPERS.items():
            for stage in STAGES:
                for order in ORDERS:
                    for impl in impls:
                        case = (wrapper, stage, order, impl)
                        points, grads, gathered = measure(*case)
                        result["points"][case], result["grads"][case] = points, grads
                        result["unsharded"][case] = gathered
        return result

    run_rank(rank, init_method, outdir, body)


if __name__ == "__main__":
    main()
