"""One gloo rank of ``gradsafe verify --schedule`` (started by ``gradsafe.verify._schedule``; the one module of the package that imports ``gradsafe`` itself, because it applies ``gradsafe.patch``).

argv: rank init_method ranks schedule mode(gradsafe|upstream) spec dtype workdir. Builds the
stages with the user's factory, loads the initial state the parent saved, runs one
step of torch's real schedule on the stages this rank holds, and writes
``workdir/{mode}-rank{rank}.pt``: every parameter gradient of those stages, or the crash.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsafe.verify._factory import load_factory
from gradsafe.verify._run import cast_module, projection_loss
from gradsafe.verify._schedule import placement


def apply_gradsafe() -> None:
    """``gradsafe.patch("pipelining")``, or raise: a patch skipped on this torch would leave
    torch's own split in the column that reports gradsafe's."""
    import gradsafe

    gradsafe.patch("pipelining")
    state = gradsafe.status()["pipelining"]
    if state.state != "active":
        raise RuntimeError(
            f"gradsafe.patch('pipelining') is {state.state} on torch {torch.__version__}"
            f"{f' ({state.skipped})' if state.skipped else ''}, so this rank would run torch's own "
            "split under gradsafe's name. Run the single-process `gradsafe verify` (it calls "
            "gradsafe's split directly) and see `gradsafe doctor` for why the patch does not apply."
        )


def main() -> None:
    rank, init_method, ranks = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    schedule, mode, spec, dtype_name, workdir = sys.argv[4:9]
    result: dict[str, Any] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=ranks,
            timeout=timedelta(seconds=60),
        )
        from torch.distributed import pipelining

        if mode == "gradsafe":
            apply_gradsafe()
        dtype = getattr(torch, dtype_name)
        stages, _, *rest = load_factory(spec)
        loss = rest[0] if rest else projection_loss
        saved = torch.load(os.path.join(workdir, "init.pt"), weights_only=False)
        # Cast first: loading copies into the parameters' own dtype, which
        # depends on this process's default dtype.
        for module, state in zip(stages, saved["states"]):
            cast_module(module, dtype).load_state_dict(state)
        indices = placement(schedule, ranks)[rank]
        mine = {i: stages[i] for i in indices}
        for module in mine.values():
            for p in module.parameters():
                p.grad = None
        pipeline_stages = [
            pipelining.PipelineStage(mine[i], i, 2 * ranks, torch.device("cpu")) for i in indices
        ]
        schedule_cls = getattr(pipelining, f"Schedule{schedule}")
        microbatches = saved["microbatches"]
        runner = schedule_cls(
            pipeline_stages,
            n_microbatches=len(microbatches),
            # The target of microbatch k is k: the user's loss_fn(output, k).
            loss_fn=lambda output, target: loss(output, int(target[0])),
        )  # scale_grads left at its default (True), as users run it: H7 shows there
        inputs = _whole_batch(microbatches, dtype)
        kwargs: dict[str, Any] = {}
        if 2 * ranks - 1 in indices:
            kwargs = {"target": torch.arange(len(microbatches)), "losses": []}
        runner.step(*(inputs if 0 in indices else ()), **kwargs)
        result["grads"] = {
            f"{i}.{name}": None if p.grad is None else p.grad.detach().clone()
            for i in indices
            for name, p in mine[i].named_parameters()
            if p.requires_grad
        }
    except Exception as exc:  # reported per rank; the peer must not hang
        result["crash"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    torch.save(result, os.path.join(workdir, f"{mode}-rank{rank}.pt"))
    if "crash" in result:
        os._exit(1)  # close the sockets so the peer fails fast instead of waiting on a recv
    dist.destroy_process_group()


def _whole_batch(microbatches: list[tuple[torch.Tensor, ...]], dtype: torch.dtype) -> list[Any]:
    """The microbatches concatenated along dim 0, floating ones in ``dtype``: the schedule re-splits them."""
    return [
        torch.cat([mb[j] for mb in microbatches]).to(dtype)
        if microbatches[0][j].is_floating_point()
        else torch.cat([mb[j] for mb in microbatches])
        for j in range(len(microbatches[0]))
    ]


if __name__ == "__main__":
    main()
