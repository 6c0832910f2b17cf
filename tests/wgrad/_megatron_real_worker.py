"""One gloo rank: megatron-core's real DistributedDataParallel beside MegatronStyleDDP and fp64 autograd.

Run by test_megatron_real.py. argv: rank init_method world_size outdir. Writes to outdir/rank{rank}.pt
``{"import_error": str}`` where megatron-core cannot be imported, else
``{"cases": [...], "probes": {...}, "seconds": float}``.

CPU stand-ins (Megatron's DDP is written for CUDA; these are the only CUDA
calls its data-parallel path makes here):

* ``torch.cuda.current_device`` returns ``"cpu"``: the device of the gradient buffers;
* ``torch.cuda.current_stream`` returns an object whose ``wait_event`` and
  ``wait_stream`` do nothing: ``start_grad_sync`` asks for the stream to wait
  for CUDA-graph events, of which there are none.

``parallel_state.initialize_model_parallel(1, 1)`` over the gloo world makes
every rank one data-parallel replica.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import itertools
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
WIDTH = 8
# The second step is the first whose overlapped reduction starts from the hooks.
STEPS = 2
# The tied cases: a third step checks that nothing of the second leaked into it.
TIED_STEPS = 3
VOCAB = 10


def _example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "fused_linear_example", REPO / "examples" / "fused_linear.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _NoStream:
    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass


def _cpu_stand_ins() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()  # type: ignore[assignment]


class Net(torch.nn.Module):
    """A delayed FusedLinear used twice per microbatch (optionally through a second, tied module), then a plain Linear."""

    def __init__(
        self,
        fused_linear: Any,
        store: Any,
        *,
        fused: bool,
        tied: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.lin = fused_linear.FusedLinear(
            WIDTH,
            WIDTH,
            accumulate_into_main_grad=fused,
            wgrad_store=store,
            dtype=dtype,
        )
        self.lin2 = None
        if tied:  # a second module holding the same weight: Megatron registers it once per module
            self.lin2 = fused_linear.FusedLinear(
                WIDTH,
                WIDTH,
                accumulate_into_main_grad=fused,
                wgrad_store=store,
                dtype=dtype,
            )
            self.lin2.weight = self.lin.weight
        self.out = torch.nn.Linear(WIDTH, 4, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        second = self.lin2 if self.lin2 is not None else self.lin
        return self.out(torch.tanh(second(torch.tanh(self.lin(x)))))

    def set_input_tensor(self, tensor: object) -> None:
        """Megatron's schedules hand a stage its input here; a first stage gets None."""


def _data(step: int, rank: int, mb: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + mb)
    return torch.randn(3, WIDTH, generator=g).to(dtype)


def _schedule(microbatches: int) -> list[tuple[str, int]]:
    """B0 B1 W0 B2 W1 ...: each W one microbatch behind."""
    steps: list[tuple[str, int]] = []
    for i in range(microbatches):
        steps.append(("B", i))
        if i >= 1:
            steps.append(("W", i - 1))
    steps.append(("W", microbatches - 1))
    return steps


def _reference(
    state: dict[str, torch.Tensor],
    step: int,
    world: int,
    microbatches: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Plain fp64 autograd: each rank's microbatch sum, averaged over ranks (what the reduction gives)."""
    params = {
        k: state[k].double().requires_grad_() for k in ("lin.weight", "out.weight", "out.bias")
    }
    w, wo, bo = params.values()
    for rank in range(world):
        for mb in range(microbatches):
            x = _data(step, rank, mb, dtype).double()
            (torch.tanh(torch.tanh(x @ w.t()) @ w.t()) @ wo.t() + bo).pow(2).sum().backward()
    return {name: p.grad / world for name, p in params.items()}  # type: ignore[operator]


def _run(
    ddp: Any,
    store: Any,
    net: Net,
    no_sync: Any,
    microbatches: int,
    step: int,
    rank: int,
    dtype: torch.dtype,
) -> None:
    """One step: passes of every microbatch but the last inside no_sync, as Megatron's schedules do."""
    pending: dict[int, Any] = {}
    for phase, mb in _schedule(microbatches):
        ctx = no_sync() if mb < microbatches - 1 else contextlib.nullcontext()
        with ctx:
            if phase == "B":
                ddp(_data(step, rank, mb, dtype)).pow(2).sum().backward()
                pending[mb] = store.seal()
            else:
                pending.pop(mb).run()


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (the type is what is compared)
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    return "ok"


def _case(
    fused_linear: Any,
    world: int,
    rank: int,
    *,
    overlap: bool,
    dtype: torch.dtype,
    fp32_reduce: bool,
    fused: bool,
    microbatches: int,
    tied: bool,
    delay: bool,
) -> dict[str, Any]:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.transformer import TransformerConfig

    from gradsafe.testing import MegatronStyleDDP
    from gradsafe.wgrad import WeightGradStore

    torch.manual_seed(7)
    real_store, emu_store = WeightGradStore(), WeightGradStore()
    real_net = Net(fused_linear, real_store, fused=fused, tied=tied, dtype=dtype)
    emu_net = Net(fused_linear, emu_store, fused=fused, tied=tied, dtype=dtype)
    emu_net.load_state_dict(real_net.state_dict())
    state = {k: v.clone() for k, v in real_net.state_dict().items()}
    config = {
        "overlap_grad_reduce": overlap,
        "grad_reduce_in_fp32": fp32_reduce,
        "delay_wgrad_compute": delay,
    }
    real = DistributedDataParallel(
        TransformerConfig(num_layers=1, hidden_size=WIDTH, num_attention_heads=1),
        DistributedDataParallelConfig(**config),
        real_net,
    )
    emu = MegatronStyleDDP(emu_net, **config)
    # The same model without delay (plain autograd wgrad) under the same real DDP.
    base_net = Net(fused_linear, None, fused=False, tied=tied, dtype=dtype)
    base_net.load_state_dict(real_net.state_dict())
    base = DistributedDataParallel(
        TransformerConfig(num_layers=1, hidden_size=WIDTH, num_attention_heads=1),
        DistributedDataParallelConfig(**config),
        base_net,
    )
    found: dict[str, Any] = {
        "real": [],
        "emu": [],
        "real_vs_emu": [],
        "real_vs_undelayed": [],
        "outcome": [],
    }
    found["dtypes"] = (
        real_net.lin.weight.main_grad.dtype,
        emu_net.lin.weight.main_grad.dtype,
    )
    for step in range(STEPS):
        ref = _reference(state, step, world, microbatches, dtype)

        def real_step(step: int = step) -> None:
            real.zero_grad_buffer()
            _run(
                real,
                real_store,
                real_net,
                real.no_sync,
                microbatches,
                step,
                rank,
                dtype,
            )
            real.finish_grad_sync()

        def emu_step(step: int = step) -> None:
            emu.zero_grad_buffer()
            _run(
                emu_net,
                emu_store,
                emu_net,
                contextlib.nullcontext,
                microbatches,
                step,
                rank,
                dtype,
            )
            emu.finish_grad_sync()  # Megatron's reduction: scale by 1/world, then sum

        found["outcome"].append((_outcome(real_step), _outcome(emu_step)))
        if found["outcome"][-1] != ("ok", "ok"):
            break
        for which, net in (("real", real_net), ("emu", emu_net)):
            errs = [
                ((p.main_grad.double() - ref[name]).abs().max() / ref[name].abs().max()).item()
                for name, p in net.named_parameters()
                if name in ref
            ]
            found[which].append(max(errs))
            if any(p.grad is not None for p in net.parameters()):
                # A gradient left in .grad never reaches main_grad.
                found[which][-1] = float("inf")
        base.zero_grad_buffer()
        _run(base, WeightGradStore(), base_net, base.no_sync, microbatches, step, rank, dtype)
        base.finish_grad_sync()
        found["real_vs_undelayed"].append(
            max(
                (a.main_grad.double() - b.main_grad.double()).abs().max().item()
                for a, b in zip(real_net.parameters(), base_net.parameters())
            )
        )
        found["real_vs_emu"].append(
            max(
                (a.main_grad.double() - b.main_grad.double()).abs().max().item()
                for a, b in zip(real_net.parameters(), emu_net.parameters())
            )
        )
    return found


class TiedNet(torch.nn.Module):
    """The two stages one ZBV rank holds: an embedding (plain autograd) tied to a delayed FusedLinear head."""

    def __init__(self, fused_linear: Any, store: Any, *, fused: bool) -> None:
        super().__init__()
        self.head = fused_linear.FusedLinear(
            WIDTH, VOCAB, accumulate_into_main_grad=fused, wgrad_store=store
        )
        self.mid = torch.nn.Linear(WIDTH, WIDTH)

    def first(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(torch.nn.functional.embedding(tokens, self.head.weight)))

    def last(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h).pow(2).sum()


def _tokens(step: int, rank: int, mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + mb)
    return torch.randint(0, VOCAB, (3,), generator=g)


def _tied_order(kind: str, microbatches: int) -> list[tuple[str, int]]:
    """L: last stage B, W: its W, F: first stage backward. ZBV: L W F per microbatch; lagged: W and F one behind."""
    if kind == "zbv":
        return [(k, i) for i in range(microbatches) for k in "LWF"]
    order = [("L", 0)]
    for i in range(1, microbatches):
        order += [("L", i), ("W", i - 1), ("F", i - 1)]
    return order + [("W", microbatches - 1), ("F", microbatches - 1)]


def _tied_case(
    fused_linear: Any, world: int, rank: int, *, overlap: bool, fused: bool, order: str
) -> dict[str, Any]:
    """The tied embedding's gradient of the last microbatch reaches .grad after the head's last W (ZBV)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.transformer import TransformerConfig

    from gradsafe.testing import MegatronStyleDDP
    from gradsafe.wgrad import WeightGradStore

    torch.manual_seed(11)
    stores = (WeightGradStore(), WeightGradStore())
    nets = (
        TiedNet(fused_linear, stores[0], fused=fused),
        TiedNet(fused_linear, stores[1], fused=fused),
    )
    nets[1].load_state_dict(nets[0].state_dict())
    state = {k: v.double() for k, v in nets[0].state_dict().items()}
    config = {
        "overlap_grad_reduce": overlap,
        "grad_reduce_in_fp32": True,
        "delay_wgrad_compute": True,
    }
    real = DistributedDataParallel(
        TransformerConfig(num_layers=1, hidden_size=WIDTH, num_attention_heads=1),
        DistributedDataParallelConfig(**config),
        nets[0],
    )
    emu = MegatronStyleDDP(nets[1], **config)
    found: dict[str, Any] = {"real": [], "real_vs_emu": [], "outcome": []}
    microbatches = 3
    for step in range(TIED_STEPS):
        params = {k: v.clone().requires_grad_() for k, v in state.items()}
        for r in range(world):
            for mb in range(microbatches):
                hidden = torch.nn.functional.embedding(_tokens(step, r, mb), params["head.weight"])
                hidden = torch.tanh(hidden @ params["mid.weight"].t() + params["mid.bias"])
                (hidden @ params["head.weight"].t()).pow(2).sum().backward()
        ref = {k: p.grad / world for k, p in params.items()}  # type: ignore[operator]

        def one_step(net: TiedNet, store: Any, no_sync: Any, step: int = step) -> None:
            first, boundary, pending = {}, {}, {}
            for kind, mb in _tied_order(order, microbatches):
                with no_sync() if mb < microbatches - 1 else contextlib.nullcontext():
                    if kind == "L":
                        first[mb] = net.first(_tokens(step, rank, mb))
                        boundary[mb] = first[mb].detach().requires_grad_()
                        net.last(boundary[mb]).backward()
                        pending[mb] = store.seal()
                    elif kind == "W":
                        pending.pop(mb).run()
                    else:
                        first.pop(mb).backward(boundary.pop(mb).grad)

        def real_step() -> None:
            real.zero_grad_buffer()
            one_step(nets[0], stores[0], real.no_sync)
            real.finish_grad_sync()

        def emu_step() -> None:
            emu.zero_grad_buffer()
            one_step(nets[1], stores[1], contextlib.nullcontext)
            emu.finish_grad_sync()

        found["outcome"].append((_outcome(real_step), _outcome(emu_step)))
        if found["outcome"][-1] != ("ok", "ok"):
            break
        named = dict(nets[0].named_parameters())
        err = max(
            ((named[k].main_grad.double() - g).abs().max() / g.abs().max()).item()
            for k, g in ref.items()
        )
        left = any(p.grad is not None for net in nets for p in net.parameters())
        found["real"].append(float("inf") if left else err)
        found["real_vs_emu"].append(
            max(
                (a.main_grad - b.main_grad).abs().max().item()
                for a, b in zip(nets[0].parameters(), nets[1].parameters())
            )
        )
    return found


def _probes(fused_linear: Any) -> dict[str, tuple[object, object]]:
    """zero_grad_buffer and zero_out_wgrad, real beside the emulation (plain parameters)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.transformer import TransformerConfig

    from gradsafe.testing import MegatronStyleDDP

    torch.manual_seed(3)
    nets = [torch.nn.Linear(WIDTH, 4), torch.nn.Linear(WIDTH, 4)]
    nets[1].load_state_dict(nets[0].state_dict())
    ddps = [
        DistributedDataParallel(
            TransformerConfig(num_layers=1, hidden_size=WIDTH, num_attention_heads=1),
            DistributedDataParallelConfig(),
            nets[0],
        ),
        MegatronStyleDDP(nets[1]),
    ]
    probes: dict[str, list[object]] = {
        "stale .grad kept": [],
        "zero_out_wgrad adds": [],
    }
    for net, ddp in zip(nets, ddps):
        net.weight.grad = torch.ones_like(net.weight)
        net.weight.grad_added_to_main_grad = True
        ddp.zero_grad_buffer()
        probes["stale .grad kept"].append(net.weight.grad is not None)
        net.weight.grad = None
        net.weight.grad_added_to_main_grad = True
        net.weight.zero_out_wgrad = True
        net(torch.ones(2, WIDTH)).sum().backward()
        probes["zero_out_wgrad adds"].append(net.weight.main_grad.abs().sum().item())
    probes["capture window"] = _capture_window(fused_linear)
    return {k: (v[0], v[1]) for k, v in probes.items()}


def _capture_window(fused_linear: Any) -> list[object]:
    """An undelayed gradient no W awaits, inside Megatron's CUDA-graph capture window (TE's warm-up).

    Megatron's hooks return at once there; gradsafe's route must leave .grad
    as it is and raise nothing. Returns, real then emulated: (outcome, .grad kept, main_grad untouched).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.transformer import TransformerConfig, cuda_graphs

    from gradsafe.testing import MegatronStyleDDP
    from gradsafe.wgrad import WeightGradStore

    found: list[object] = []
    for real in (True, False):
        net = TiedNet(fused_linear, WeightGradStore(), fused=False)
        config = {"overlap_grad_reduce": True, "delay_wgrad_compute": True}
        if real:
            DistributedDataParallel(
                TransformerConfig(num_layers=1, hidden_size=WIDTH, num_attention_heads=1),
                DistributedDataParallelConfig(**config),
                net,
            )
            cuda_graphs._set_capture_start()
            window: Any = contextlib.ExitStack()
            window.callback(cuda_graphs._set_capture_end)
        else:
            window = MegatronStyleDDP(net, **config).graph_capture()
        with window:
            outcome = _outcome(lambda net=net: net.first(torch.tensor([1, 2])).sum().backward())
        weight = net.head.weight
        found.append((outcome, weight.grad is not None, not weight.main_grad.any()))
    return found


class _CpuZeros:
    """``torch`` for megatron-core's schedules, whose token counter is ``torch.zeros(..., device="cuda")``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: object = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, **kwargs)


def _real_ddp(net: torch.nn.Module, **config: Any) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    return DistributedDataParallel(
        TransformerConfig(num_layers=1, hidden_size=WIDTH, num_attention_heads=1),
        DistributedDataParallelConfig(**config),
        net,
    )


def _lifecycle_case(
    fused_linear: Any, world: int, rank: int, *, item: str, real: bool, overlap: bool, fused: bool
) -> dict[str, Any]:
    """Items 1-4 of issue 30 under a guarded DDP (real or emulated): the refusal, and main_grad untouched by it.

    Three microbatches, each W one behind, as in the recipe; what goes wrong:
    ``w_after_reduction``: the last W left for after ``finish_grad_sync``;
    ``zero_between_b_and_w``: ``zero_grad_buffer()`` after the last B, before its W;
    ``forgotten_w`` / ``dropped_w``: the last W never run (held, or dropped unrun).
    ``unguarded``: the first, without the guard: how far off main_grad ends.
    """
    from gradsafe.testing import MegatronStyleDDP
    from gradsafe.wgrad import WeightGradStore, guard_ddp_step

    torch.manual_seed(5)
    store = WeightGradStore()
    net = Net(fused_linear, store, fused=fused, tied=False, dtype=torch.float32)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    config = {
        "overlap_grad_reduce": overlap,
        "grad_reduce_in_fp32": True,
        "delay_wgrad_compute": True,
    }
    ddp = _real_ddp(net, **config) if real else MegatronStyleDDP(net, **config)
    guard = None if item == "unguarded" else guard_ddp_step(ddp)
    no_sync = ddp.no_sync if real else contextlib.nullcontext
    microbatches = 3
    ddp.zero_grad_buffer()
    pending: dict[int, Any] = {}
    for phase, mb in _schedule(microbatches)[:-1]:  # all but the last W
        with no_sync() if mb < microbatches - 1 else contextlib.nullcontext():
            if phase == "B":
                (ddp if real else net)(_data(0, rank, mb, torch.float32)).pow(2).sum().backward()
                pending[mb] = store.seal()
            else:
                pending.pop(mb).run()
    last = pending.pop(microbatches - 1)
    before = [p.main_grad.clone() for p in net.parameters()]
    found: dict[str, Any] = {}
    if item in ("w_after_reduction", "unguarded"):
        found["refusal"] = _outcome(ddp.finish_grad_sync)
    elif item == "zero_between_b_and_w":
        found["refusal"] = _outcome(ddp.zero_grad_buffer)
    else:
        if item == "dropped_w":
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                del last
                gc.collect()
        found["refusal"] = _outcome(ddp.finish_grad_sync)
    found["unchanged"] = all(torch.equal(b, p.main_grad) for b, p in zip(before, net.parameters()))
    if item == "unguarded":  # what the refusal prevents: the W after the reduction
        last.run()
        ref = _reference(state, 0, world, microbatches, torch.float32)
        found["error"] = max(
            ((p.main_grad.double() - ref[name]).abs().max() / ref[name].abs().max()).item()
            for name, p in net.named_parameters()
            if name in ref
        )
        gathered = [torch.zeros_like(net.lin.weight.main_grad) for _ in range(world)]
        dist.all_gather(gathered, net.lin.weight.main_grad)
        found["ranks_disagree"] = max((g - gathered[0]).abs().max().item() for g in gathered)
    elif item != "dropped_w":
        last.run()  # the fix: W before the reduction, which then goes through
        found["after_fix"] = _outcome(ddp.finish_grad_sync)
    if guard is not None:
        guard.remove()
    return found


def _abandon_case(
    fused_linear: Any,
    world: int,
    rank: int,
    *,
    real: bool,
    overlap: bool,
    at_step: int,
    bucket_size: int | None = None,
) -> dict[str, Any]:
    """Issue 36 item 4: a step's last W dropped, the step abandoned as docs/wgrad.md says, then two clean steps.

    ``at_step`` clean steps run first (0: the abandoned step is the DDP's
    first, whose readiness counts Megatron records under ``overlap_grad_reduce``).
    Returns the outcome of ``zero_grad_buffer()`` in the recovery and each
    clean step's main_grad error against fp64 autograd. ``bucket_size``
    (real DDP): small, each parameter gets its own bucket group, so the
    complete ones start their reduction from the hooks in the abandoned step.
    """
    from gradsafe.testing import MegatronStyleDDP
    from gradsafe.wgrad import WeightGradStore, guard_ddp_step

    torch.manual_seed(5)
    store = WeightGradStore()
    net = Net(fused_linear, store, fused=False, tied=False, dtype=torch.float32)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    config = {"overlap_grad_reduce": overlap, "grad_reduce_in_fp32": True}
    if bucket_size is not None:
        config["bucket_size"] = bucket_size
    ddp = _real_ddp(net, delay_wgrad_compute=True, **config) if real else None
    ddp = ddp or MegatronStyleDDP(net, delay_wgrad_compute=True, **config)
    guard = guard_ddp_step(ddp)
    no_sync = ddp.no_sync if real else contextlib.nullcontext
    microbatches = 3
    found: dict[str, Any] = {"recovery": None, "errors": []}

    def passes(step: int, *, drop_last: bool) -> None:
        pending: dict[int, Any] = {}
        for phase, mb in _schedule(microbatches)[: -1 if drop_last else None]:
            with no_sync() if mb < microbatches - 1 else contextlib.nullcontext():
                if phase == "B":
                    (ddp if real else net)(_data(step, rank, mb, torch.float32)).pow(
                        2
                    ).sum().backward()
                    pending[mb] = store.seal()
                else:
                    pending.pop(mb).run()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            pending.clear()  # the dropped last W, if any
            gc.collect()

    for step in range(at_step + 3):
        if step != at_step + 1:  # the recovery zeroed the buffers already
            ddp.zero_grad_buffer()
        if step == at_step:
            passes(step, drop_last=True)
            found["refused"] = _outcome(ddp.finish_grad_sync)
            for p in net.parameters():  # abandon the step, as the refusal says
                p.grad = None
            found["recovery"] = _outcome(ddp.zero_grad_buffer)
            continue
        passes(step, drop_last=False)
        outcome = _outcome(ddp.finish_grad_sync)
        if outcome != "ok":
            found["errors"].append(outcome)
            break
        ref = _reference(state, step, world, microbatches, torch.float32)
        found["errors"].append(
            max(
                ((p.main_grad.double() - ref[n]).abs().max() / ref[n].abs().max()).item()
                for n, p in net.named_parameters()
            )
        )
    guard.remove()
    return found


class _DelayedAffine(torch.autograd.Function):
    """``x @ w.T + b``, both gradients delayed (fused into main_grad or not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: Any, b: Any, store: Any, fused: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w, ctx.b, ctx.store, ctx.fused = w, b, store, fused
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        for param, wgrad in ((ctx.w, g.t() @ x), (ctx.b, g.sum(0))):

            def compute(main_grad: Any, wgrad: torch.Tensor = wgrad) -> Any:
                if main_grad is None:
                    return wgrad
                main_grad.add_(wgrad)
                return None

            ctx.store.record(param, compute, accumulate_into_main_grad=ctx.fused)
        return g @ ctx.w, None, None, None, None


class _TwoDelayed(torch.nn.Module):
    """docs/wgrad.md's module recipe over a weight and a delayed bias (both marked): one module, two delayed parameters."""

    def __init__(self, store: Any, fused: bool) -> None:
        super().__init__()
        from gradsafe.wgrad import mark_delayed_wgrad

        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))
        self.bias = torch.nn.Parameter(torch.randn(WIDTH))
        mark_delayed_wgrad(self.weight)
        mark_delayed_wgrad(self.bias)
        self.store, self.fused = store, fused

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Any) -> None:
        from gradsafe.wgrad import register_megatron_hook

        register_megatron_hook(self.store, self.weight, hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DelayedAffine.apply(x, self.weight, self.bias, self.store, self.fused)


def _two_delayed() -> dict[str, Any]:
    """A real DDP whose module holds two delayed parameters: guard_ddp_step refuses it; unguarded, W does, before writing."""
    from gradsafe.wgrad import WeightGradStore, guard_ddp_step

    found: dict[str, Any] = {}
    for overlap, fused in itertools.product((False, True), (False, True)):
        store = WeightGradStore()
        net = _TwoDelayed(store, fused)
        ddp = _real_ddp(
            net, overlap_grad_reduce=overlap, delay_wgrad_compute=True, grad_reduce_in_fp32=True
        )
        guarded = _outcome(lambda ddp=ddp: guard_ddp_step(ddp))
        ddp.zero_grad_buffer()
        ddp(torch.randn(3, WIDTH)).pow(2).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the refused pass, dropped unrun
            at_w = _outcome(store.seal().run)
        untouched = all(not p.main_grad.any() and p.grad is None for p in net.parameters())
        found[f"overlap={overlap} fused={fused}"] = (guarded, at_w, untouched)
    return found


def _schedule_case(
    fused_linear: Any,
    world: int,
    rank: int,
    *,
    schedule: str,
    overlap: bool,
    fused: bool,
    w_where: str,
) -> dict[str, Any]:
    """docs/wgrad.md's recipe for Megatron-core's own schedules: every W in a finalize_model_grads_func wrapper.

    ``w_where``: ``"finalize"`` (the recipe) or ``"after"`` (after
    forward_backward_func returns: the guarded reduction inside refuses).
    Two steps of 3 microbatches, guarded real DDP; main_grad against fp64 autograd.
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules

    from gradsafe.wgrad import WeightGradStore, guard_ddp_step

    schedules.torch = _CpuZeros()  # type: ignore[assignment]
    torch.manual_seed(9)
    store = WeightGradStore()
    net = Net(fused_linear, store, fused=fused, tied=False, dtype=torch.float32)
    net.model_type = ModelType.encoder_or_decoder  # what the schedules ask a model
    state = {k: v.clone() for k, v in net.state_dict().items()}
    ddp = _real_ddp(
        net, overlap_grad_reduce=overlap, grad_reduce_in_fp32=True, delay_wgrad_compute=True
    )
    guard = guard_ddp_step(ddp)
    config = ddp.config

    def finalize_with_w(model: list[Any], *args: Any, **kwargs: Any) -> None:
        if w_where == "finalize":
            store.seal().run()  # every W of the step, before the reduction
        finalize_model_grads(model, *args, **kwargs)

    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_with_w
    func = getattr(schedules, schedule)
    microbatches = 3
    found: dict[str, Any] = {"outcome": [], "real": []}
    for step in range(2):
        batches = iter([_data(step, rank, mb, torch.float32) for mb in range(microbatches)])

        def forward_step(data_iterator: Any, model: Any) -> Any:
            out = model(next(data_iterator))
            return out, lambda o: (o.pow(2).sum(), {"loss": o.detach()})

        def run_step(batches: Any = batches) -> None:
            ddp.zero_grad_buffer()
            func(
                forward_step_func=forward_step,
                data_iterator=batches,
                model=[ddp],
                num_microbatches=microbatches,
                seq_length=3,
                micro_batch_size=3,
            )

        found["outcome"].append(_outcome(run_step))
        if found["outcome"][-1] != "ok":
            break
        ref = _reference(state, step, world, microbatches, torch.float32)
        errs = [
            (
                (p.main_grad.double() - ref[name] / microbatches).abs().max()
                / ref[name].abs().max()
            ).item()
            for name, p in net.named_parameters()
        ]
        left = any(p.grad is not None for p in net.parameters())
        found["real"].append(float("inf") if left else max(errs))
    guard.remove()
    return found


def _lifecycle(fused_linear: Any, world: int, rank: int) -> dict[str, Any]:
    items = ("w_after_reduction", "zero_between_b_and_w", "forgotten_w", "dropped_w", "unguarded")
    found: dict[str, Any] = {
        "items": [
            (
                {"item": item, "real": real, "overlap": overlap, "fused": fused},
                _lifecycle_case(
                    fused_linear, world, rank, item=item, real=real, overlap=overlap, fused=fused
                ),
            )
            for item, real, overlap, fused in itertools.product(
                items, (True, False), (False, True), (False, True)
            )
        ],
        "two_delayed": _two_delayed(),
        "abandon": [
            (
                {"real": real, "overlap": overlap, "at_step": at_step},
                _abandon_case(
                    fused_linear, world, rank, real=real, overlap=overlap, at_step=at_step
                ),
            )
            for real, overlap, at_step in itertools.product((True, False), (False, True), (0, 1))
        ]
        + [
            (
                {"real": True, "overlap": True, "at_step": at_step, "bucket_size": 1},
                _abandon_case(
                    fused_linear,
                    world,
                    rank,
                    real=True,
                    overlap=True,
                    at_step=at_step,
                    bucket_size=1,
                ),
            )
            for at_step in (0, 1)
        ],
        "schedules": [
            (
                {"schedule": schedule, "overlap": overlap, "fused": fused, "w_where": w_where},
                _schedule_case(
                    fused_linear,
                    world,
                    rank,
                    schedule=schedule,
                    overlap=overlap,
                    fused=fused,
                    w_where=w_where,
                ),
            )
            for schedule, overlap, fused, w_where in itertools.product(
                (
                    "forward_backward_no_pipelining",
                    "forward_backward_pipelining_without_interleaving",
                ),
                (False, True),
                (False, True),
                ("finalize", "after"),
            )
        ],
    }
    return found


def main() -> None:
    rank, init_method, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    outfile = Path(sys.argv[4]) / f"rank{rank}.pt"
    sys.path.insert(0, str(REPO))
    try:
        import megatron.core.distributed  # noqa: F401
        from megatron.core import parallel_state
    except Exception as exc:  # noqa: BLE001 (an import that fails in any way: the test skips with this reason)
        torch.save({"import_error": f"{type(exc).__name__}: {exc}"}, outfile)
        return
    start = time.perf_counter()
    found: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        _cpu_stand_ins()
        parallel_state.initialize_model_parallel(1, 1)
        fused_linear = _example()
        cases = []
        grid = itertools.product(
            (False, True),
            (torch.float32, torch.bfloat16),
            (False, True),
            (False, True),
            (1, 2, 3, 4),
        )
        for overlap, dtype, fp32_reduce, fused, microbatches in grid:
            key = {
                "overlap": overlap,
                "dtype": dtype,
                "fp32_reduce": fp32_reduce,
                "fused": fused,
                "microbatches": microbatches,
                "tied": False,
                "delay": True,
            }
            cases.append((key, _case(fused_linear, world, rank, **key)))
        for overlap, fused in itertools.product((False, True), (False, True)):
            # A weight tied across two modules; and the recipe without delay_wgrad_compute.
            for tied, delay in ((True, True), (False, False)):
                key = {
                    "overlap": overlap,
                    "dtype": torch.float32,
                    "fp32_reduce": True,
                    "fused": fused,
                    "microbatches": 4,
                    "tied": tied,
                    "delay": delay,
                }
                cases.append((key, _case(fused_linear, world, rank, **key)))
        found["cases"] = cases
        found["tied_cases"] = [
            (key, _tied_case(fused_linear, world, rank, **key))
            for key in (
                {"overlap": overlap, "fused": fused, "order": order}
                for overlap, fused, order in itertools.product(
                    (False, True), (False, True), ("zbv", "lagged")
                )
            )
        ]
        found["probes"] = _probes(fused_linear)
        found["lifecycle"] = _lifecycle(fused_linear, world, rank)
    except Exception:  # noqa: BLE001 (reported to the test, which fails with it)
        found["crash"] = traceback.format_exc()
    found["seconds"] = time.perf_counter() - start
    torch.save(found, outfile)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
