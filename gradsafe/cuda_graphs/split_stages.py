"""Graphed zero-bubble stages: per (chunk, microbatch) a forward, a B and a W CUDA graph, in one pool.

A zero-bubble schedule splits each stage's backward into B (input gradients)
and W (weight gradients), run at different times, with several microbatches
in flight. Graphing such a stage needs, per chunk and microbatch, three
graphs -- forward, B and W -- whose static memory lives as long as that
microbatch is in flight. Sharing one memory pool lets a graph reuse memory an
earlier-captured graph no longer holds, which is only safe when the graphs
replay in the order they were captured (hazard H5): so the graphs are
captured in a validated :class:`~gradsafe.cuda_graphs.CaptureOrder`, and every
replay is checked against it, refusing any other order before anything runs.

What each graph computes follows the pipelining capability's split backward
(hazard H1): B is gradsafe's ``stage_backward_input`` (the input gradients,
and the gradient arriving at every input-dependent node that consumes a
weight, recorded for W), W turns those recorded gradients into each
parameter's gradient, exactly a fused backward's. No graph touches ``.grad``:
after W's replay its static per-parameter buffers are delivered by one
``torch.autograd.backward`` whose roots are the parameters themselves, so
AccumulateGrad runs once per parameter per W with every hook (H1, H4), and a
buffer that AccumulateGrad or a hook could keep is cloned first (H3). Input
gradients that autograd could keep are cloned likewise.

Nothing here depends on the emulator: warm-up runs on a side stream before
capture, as torch's ``make_graphed_callables`` does, and no value computed
during a capture is read (a real capture records without executing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gradsafe.cuda_graphs._autograd import (
    accumulate_grad_keeps,
    has_tensor_hooks,
    is_accumulate_grad,
    leaf_fate,
)
from gradsafe.cuda_graphs._collector import no_collection_during_capture
from gradsafe.cuda_graphs._structure import (
    arg_tree_leaves,
    has_module_hooks,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
)
from gradsafe.cuda_graphs.capture_order import CaptureEntry, CaptureOrder, EntryKind
from gradsafe.pipelining import WeightGradHandoff, stage_backward_input

__all__ = [
    "GraphedSplitStages",
    "ReplayOrderError",
    "SplitStageState",
    "make_graphed_split_callables",
]


class ReplayOrderError(RuntimeError):
    """A graph was about to replay out of capture order; nothing ran.

    Graphs that share a memory pool may reuse each other's memory in capture
    order, so replaying them in another order can overwrite memory a graph
    still holds (activations or recorded gradients of a microbatch in flight).
    """

    def __init__(self, position: int, expected: CaptureEntry, attempted: str) -> None:
        super().__init__(
            f"replay position {position}: expected {expected}, got {attempted}. The graphs share one "
            "memory pool and were captured in this order, so they must replay in it; another order can "
            "overwrite memory a microbatch in flight still holds. Run the schedule whose CaptureOrder "
            "was given (or capture with the order this schedule runs); after an exception left a step "
            "partway, call restart_step()."
        )
        self.position = position
        self.expected = expected
        self.attempted = attempted


class SplitStageState(enum.Enum):
    """Where a :class:`GraphedSplitStages` is in its life."""

    #: Captured; replays follow the capture order.
    READY = "ready"
    #: A replay raised after its entry was claimed (a gradient hook, a copy): the
    #: step is unfinished and must be restarted with ``restart_step()``.
    BROKEN_STEP = "broken-step"


@dataclasses.dataclass
class _Slot:
    """The graphs and static tensors of one (chunk, microbatch)."""

    chunk: int
    microbatch: int
    static_inputs: tuple[torch.Tensor, ...]
    fwd_graph: Any = None
    dgrad_graph: Any = None
    wgrad_graph: Any = None
    static_outputs: tuple[torch.Tensor, ...] = ()
    output_spec: Any = None
    # None where the output does not require grad.
    static_grad_outputs: tuple[torch.Tensor | None, ...] = ()
    # B's input gradients and W's per-parameter gradients (None: none flows there).
    static_grad_inputs: tuple[torch.Tensor | None, ...] = ()
    static_grad_params: tuple[torch.Tensor | None, ...] = ()
    # Lives from B's capture to W's capture only.
    handoff: WeightGradHandoff | None = None


class _StageFunction(torch.autograd.Function):
    """One microbatch's forward replay; its backward is that microbatch's B replay."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        stages: GraphedSplitStages,
        slot: _Slot,
        anchor: torch.Tensor,
        *inputs: torch.Tensor,
    ) -> Any:
        # ``anchor`` requires grad when the chunk has parameters, so the outputs do
        # (and B runs) even when no input requires grad (a pipeline's first stage).
        ctx.stages, ctx.slot = stages, slot
        outputs = tuple(o.detach() for o in slot.static_outputs)
        ctx.mark_non_differentiable(
            *(o for o, g in zip(outputs, slot.static_grad_outputs) if g is None)
        )
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        stages: GraphedSplitStages = ctx.stages
        slot: _Slot = ctx.slot
        stages._replay_dgrad(slot, grads)
        # Edges: the anchor is tensor argument 0, input i is tensor argument i + 1.
        owned: list[torch.Tensor | None] = []
        for i, static in enumerate(slot.static_grad_inputs):
            if static is None or not ctx.needs_input_grad[3 + i]:
                owned.append(None)
                continue
            if _input_grad_kept(ctx.next_functions[1 + i][0]):
                owned.append(static.clone())
                stages.copies += 1
            else:
                owned.append(static.detach())
        return (None, None, None, *owned)


def _input_grad_kept(node: Any) -> bool:
    """Whether autograd or a user could keep the gradient handed to ``node`` past the next replay."""
    if node is None:
        return False
    if not is_accumulate_grad(node):
        # A non-leaf's producer may keep it or pass it through into a leaf's .grad.
        return True
    leaf = node.variable
    fate = leaf_fate(node)
    if fate == "discarded":
        return False
    if fate == "captured":
        return True  # torch.autograd.grad returns it to the caller
    return accumulate_grad_keeps(leaf)


class GraphedSplitStages:
    """The graphed chunks of one pipeline rank and the replay order they share.

    Made by :func:`make_graphed_split_callables`. ``callables[c]`` is chunk
    ``c``'s module with its ``forward`` replaced: each call replays the
    forward graph of the microbatch the order names next, and the returned
    outputs' backward replays that microbatch's B graph (input gradients only).
    :meth:`backward_weight` replays the W graph the order names next and
    delivers the weight gradients through AccumulateGrad.
    """

    def __init__(
        self,
        order: CaptureOrder,
        modules: Sequence[torch.nn.Module],
        params: Sequence[tuple[torch.Tensor, ...]],
        slots: dict[tuple[int, int], _Slot],
        anchors: Sequence[torch.Tensor],
    ) -> None:
        self.order = order
        self.callables: tuple[torch.nn.Module, ...] = tuple(modules)
        self._params = tuple(params)
        self._slots = slots
        self._anchors = tuple(anchors)
        self._position = 0
        self._state = SplitStageState.READY
        #: Gradients cloned out of static buffers so far (input and parameter gradients).
        self.copies = 0
        # Per chunk, the microbatch of its most recent B replay (for dw_builder).
        self._last_dgrad: dict[int, int] = {}

    # -- the replay order ----------------------------------------------------------------

    @property
    def position(self) -> int:
        """Index into ``order`` of the next graph to replay (0 at the start of a step)."""
        return self._position

    @property
    def state(self) -> SplitStageState:
        return self._state

    @property
    def next_entry(self) -> CaptureEntry:
        return self.order.entries[self._position]

    def restart_step(self) -> None:
        """Start the next replay at the order's first entry, abandoning an unfinished step.

        Safe for the pool: the new step rewrites every graph's memory in
        capture order before reading it. Gradients already delivered by the
        abandoned step's W replays stay in ``.grad``.
        """
        self._position = 0
        self._last_dgrad.clear()
        self._state = SplitStageState.READY

    def _take(self, kind: EntryKind, chunk: int, microbatch: int | None) -> CaptureEntry:
        """Claim the next entry if it is ``kind`` of ``chunk`` (and ``microbatch``, if given)."""
        if self._state is SplitStageState.BROKEN_STEP:
            raise RuntimeError(
                "GraphedSplitStages: an earlier replay of this step raised after its graph ran; "
                "call restart_step() and run the step again from its first forward."
            )
        expected = self.next_entry
        if (
            expected.kind is not kind
            or expected.chunk != chunk
            or (microbatch is not None and expected.microbatch != microbatch)
        ):
            mb = "mb?" if microbatch is None else f"mb{microbatch}"
            raise ReplayOrderError(self._position, expected, f"{kind.value}(c{chunk},{mb})")
        self._position = (self._position + 1) % len(self.order.entries)
        return expected

    # -- replays -------------------------------------------------------------------------

    def _forward(self, chunk: int, args: tuple[Any, ...]) -> Any:
        flat = arg_tree_leaves(*args)
        statics = self._slots[(chunk, self.order.microbatches(chunk)[0])].static_inputs
        if len(flat) != len(statics) or any(
            not isinstance(v, torch.Tensor) or v.shape != s.shape or v.dtype != s.dtype
            for v, s in zip(flat, statics)
        ):
            raise TypeError(
                f"graphed chunk {chunk} takes tensors shaped like its sample_args "
                f"{[(tuple(s.shape), s.dtype) for s in statics]}, got "
                f"{[(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in flat]}"
            )
        entry = self._take(EntryKind.FORWARD, chunk, None)
        slot = self._slots[(chunk, entry.microbatch)]
        with self._step_breaks_on_error():
            with torch.no_grad():
                for static, value in zip(slot.static_inputs, flat):
                    if static.data_ptr() != value.data_ptr():
                        static.copy_(value)
            slot.fwd_graph.replay()
            outputs = _StageFunction.apply(self, slot, self._anchors[chunk], *flat)
        return tree_unflatten(list(outputs), slot.output_spec)

    def _replay_dgrad(self, slot: _Slot, grads: Sequence[torch.Tensor | None]) -> None:
        self._take(EntryKind.DGRAD, slot.chunk, slot.microbatch)
        with self._step_breaks_on_error():
            for static, grad in zip(slot.static_grad_outputs, grads):
                if static is None:
                    continue
                if grad is None:
                    static.zero_()
                elif grad.data_ptr() != static.data_ptr():
                    static.copy_(grad)
            slot.dgrad_graph.replay()
        self._last_dgrad[slot.chunk] = slot.microbatch

    @contextlib.contextmanager
    def _step_breaks_on_error(self) -> Iterator[None]:
        """An error after an entry was claimed leaves the step unfinished: refuse until restart_step()."""
        try:
            yield
        except BaseException:
            self._state = SplitStageState.BROKEN_STEP
            raise

    def backward_weight(self, chunk: int) -> None:
        """W of ``chunk``: replay the W graph the order names next and accumulate the weight gradients.

        The gradients reach ``.grad`` through one ``torch.autograd.backward``
        rooted at the parameters, so tensor hooks, post-accumulate-grad hooks
        and AccumulateGrad node hooks fire exactly once per parameter.

        Raises:
            ReplayOrderError: the order's next entry is not a W of ``chunk``.
        """
        entry = self._take(EntryKind.WGRAD, chunk, None)
        self._run_wgrad(self._slots[(chunk, entry.microbatch)])

    def dw_builder(self, chunk: int) -> Callable[[], Callable[[], None]]:
        """``PipelineStage(..., dw_builder=stages.dw_builder(c))`` for a ``torch.distributed.pipelining`` stage.

        The stage calls the builder right after its B and the runner it
        returns at W time; the runner replays W of the microbatch whose B ran
        last for ``chunk`` (and is refused if the order names another).
        """

        def build() -> Callable[[], None]:
            microbatch = self._last_dgrad.get(chunk)
            if microbatch is None:
                raise RuntimeError(
                    f"GraphedSplitStages.dw_builder: chunk {chunk} has no B replay to build a W for; "
                    "the stage's backward did not run through the graphed outputs"
                )

            def run() -> None:
                self._take(EntryKind.WGRAD, chunk, microbatch)
                self._run_wgrad(self._slots[(chunk, microbatch)])

            return run

        return build

    def _run_wgrad(self, slot: _Slot) -> None:
        with self._step_breaks_on_error():
            slot.wgrad_graph.replay()
            roots: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            for p, static in zip(self._params[slot.chunk], slot.static_grad_params):
                if static is None:
                    continue
                if accumulate_grad_keeps(p):
                    grads.append(static.clone())
                    self.copies += 1
                else:
                    grads.append(static)
                roots.append(p)
            if roots:
                # Roots are the parameters' AccumulateGrad nodes: one engine run, each once.
                torch.autograd.backward(roots, grads)


def _backward_input(
    slot: _Slot, params: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradHandoff]:
    """B on the slot's static tensors: gradsafe's split B (input grads, W's records)."""
    outputs = [o for o, g in zip(slot.static_outputs, slot.static_grad_outputs) if g is not None]
    grads = [g for g in slot.static_grad_outputs if g is not None]
    dinputs, handoff = stage_backward_input(outputs, grads, slot.static_inputs, params)
    # B also accumulates into leaf inputs' .grad (as a fused backward would); the
    # graphed callable returns input gradients through autograd instead.
    for t in slot.static_inputs:
        t.grad = None
    return dinputs, handoff


def _check_inputs(chunk: int, module: Any, args: Any) -> tuple[torch.Tensor, ...]:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"make_graphed_split_callables: chunk {chunk} is {type(module).__name__}; each chunk must "
            "be an nn.Module (its parameters are what W delivers to)"
        )
    if has_module_hooks(module):
        raise ValueError(
            f"make_graphed_split_callables: chunk {chunk} has module hooks; they would run only "
            "during capture. Register them after graphing."
        )
    for p in module.parameters():
        if has_tensor_hooks(p):
            raise ValueError(
                f"make_graphed_split_callables: a parameter of chunk {chunk} has a tensor hook "
                "(register_hook); it would run during warm-up and capture (W computes parameter "
                "gradients there). Register parameter hooks after graphing: they then fire once "
                "per W replay."
            )
    if any(b.requires_grad for b in module.buffers()):
        raise ValueError(
            f"make_graphed_split_callables: chunk {chunk} has a buffer that requires grad"
        )
    flat = tuple(arg_tree_leaves(*args))
    if not all(isinstance(a, torch.Tensor) for a in flat):
        raise TypeError(
            f"make_graphed_split_callables: sample_args of chunk {chunk} must be tensors only"
        )
    return flat


def make_graphed_split_callables(
    callables: Sequence[torch.nn.Module],
    sample_args: Sequence[tuple[Any, ...]],
    order: CaptureOrder,
    *,
    num_warmup_iters: int = 3,
    pool: Any = None,
) -> GraphedSplitStages:
    """Capture forward, B and W graphs of every (chunk, microbatch) in ``order``, sharing one pool.

    Args:
        callables: one ``nn.Module`` per chunk (chunk ``c`` of ``order`` is
            ``callables[c]``; a pipeline rank's stages in ascending stage index,
            as ``CaptureOrder.from_schedule`` numbers them).
        sample_args: per chunk, a tuple of tensors shaped like one microbatch's
            inputs (their ``requires_grad`` flags decide which input gradients
            B computes). Each microbatch gets its own static copy.
        order: every chunk must delay its wgrad (each dgrad has a wgrad entry).
        num_warmup_iters: eager forward + B + W runs per chunk on a side stream
            before capture (lazy initialisation must not end up in a graph).
        pool: a ``torch.cuda.graph_pool_handle()`` to share; default: a new one.

    Returns:
        A :class:`GraphedSplitStages`; ``callables`` are the same modules with
        ``forward`` replaced (the eager forward runs when the module's
        training flag differs from the one it was graphed in).

    Raises:
        ValueError: a chunk without delayed wgrad, chunks not ``0..len(callables)-1``,
            hooks present at capture time.

    Example::

        >>> import torch
        >>> from gradsafe.cuda_graphs import CaptureEntry, CaptureOrder, make_graphed_split_callables
        >>> from gradsafe.testing import emulate_cuda_graphs
        >>> F, B, W = CaptureEntry.forward, CaptureEntry.dgrad, CaptureEntry.wgrad
        >>> with emulate_cuda_graphs():  # a CPU stand-in; on a GPU: CUDA module and tensors
        ...     stage = torch.nn.Linear(2, 2)
        ...     sample = (torch.ones(3, 2, requires_grad=True),)
        ...     stages = make_graphed_split_callables([stage], [sample], CaptureOrder([F(0, 0), B(0, 0), W(0, 0)]))
        ...     x = torch.full((3, 2), 2.0, requires_grad=True)
        ...     (dx,) = torch.autograd.grad(stages.callables[0](x).sum(), [x])  # F, then B
        ...     print(stage.weight.grad)  # W has not run yet
        ...     stages.backward_weight(0)
        None
        >>> stage.weight.grad
        tensor([[6., 6.],
                [6., 6.]])
    """
    # Over 60 lines only by its docstring (arguments and an example); the
    # steps are the functions it calls.
    modules = list(callables)
    _check_arguments(modules, sample_args, order)
    flat_samples = [_check_inputs(c, m, a) for c, (m, a) in enumerate(zip(modules, sample_args))]
    params = [tuple(m.parameters()) for m in modules]

    def static_copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(t.requires_grad)

    slots: dict[tuple[int, int], _Slot] = {}
    for c in order.chunks:
        for m in order.microbatches(c):
            slots[(c, m)] = _Slot(c, m, tuple(static_copy(t) for t in flat_samples[c]))
    anchors = [
        torch.zeros(
            (),
            device=(flat_samples[c] or params[c])[0].device,
            requires_grad=any(p.requires_grad for p in params[c]),
        )
        for c in order.chunks
    ]
    training = [m.training for m in modules]
    with no_collection_during_capture():
        _warm_up(modules, params, slots, order, num_warmup_iters)
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        _capture(modules, params, slots, order, pool)

    stages = GraphedSplitStages(order, modules, params, slots, anchors)
    for c, module in enumerate(modules):
        module.forward = _graphed_forward(stages, c, module, training[c], module.forward)  # type: ignore[method-assign]
    return stages


def _check_arguments(
    modules: Sequence[torch.nn.Module], sample_args: Sequence[tuple[Any, ...]], order: CaptureOrder
) -> None:
    """Refuse an order or samples that do not match the callables (before anything runs)."""
    if len(sample_args) != len(modules):
        raise ValueError(
            f"make_graphed_split_callables: {len(modules)} callables but {len(sample_args)} sample_args"
        )
    if order.chunks != tuple(range(len(modules))):
        raise ValueError(
            f"make_graphed_split_callables: the order's chunks {list(order.chunks)} must be "
            f"0..{len(modules) - 1}, one per callable"
        )
    undelayed = sorted(set(order.chunks) - order.delayed_wgrad_chunks)
    if undelayed:
        raise ValueError(
            f"make_graphed_split_callables: chunks {undelayed} have no wgrad entries; every chunk's "
            "weight gradients are their own W graph here (derive the order from a zero-bubble "
            "schedule, or add a wgrad after each dgrad)"
        )
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_split_callables does not support autocast caching; set cache_enabled=False"
        )


def _warm_up(
    modules: Sequence[torch.nn.Module],
    params: Sequence[tuple[torch.Tensor, ...]],
    slots: dict[tuple[int, int], _Slot],
    order: CaptureOrder,
    num_warmup_iters: int,
) -> None:
    """The same forward, B and W as the graphs, eagerly, on a side stream."""
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for c in order.chunks:
            warm = slots[(c, order.microbatches(c)[0])]
            for _ in range(num_warmup_iters):
                outputs = tuple(tree_leaves(modules[c](*warm.static_inputs)))
                trial = dataclasses.replace(
                    warm,
                    static_outputs=outputs,
                    static_grad_outputs=tuple(
                        torch.zeros_like(o) if o.requires_grad else None for o in outputs
                    ),
                )
                _, handoff = _backward_input(trial, params[c])
                handoff.weight_grads(params[c])
                del outputs, trial, handoff
    torch.cuda.synchronize()


def _capture(
    modules: Sequence[torch.nn.Module],
    params: Sequence[tuple[torch.Tensor, ...]],
    slots: dict[tuple[int, int], _Slot],
    order: CaptureOrder,
    pool: Any,
) -> None:
    """Capture every entry of ``order`` in its order, into the slots, sharing ``pool``."""
    for entry in order.entries:
        slot = slots[(entry.chunk, entry.microbatch)]
        ps = params[entry.chunk]
        if entry.kind is EntryKind.FORWARD:
            slot.fwd_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(slot.fwd_graph, pool=pool):
                out = modules[entry.chunk](*slot.static_inputs)
            flat_out, slot.output_spec = tree_flatten(out)
            slot.static_outputs = tuple(flat_out)
            # Outside the pool: written by the caller before each B replay.
            slot.static_grad_outputs = tuple(
                torch.zeros_like(o) if o.requires_grad else None for o in slot.static_outputs
            )
        elif entry.kind is EntryKind.DGRAD:
            slot.dgrad_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(slot.dgrad_graph, pool=pool):
                slot.static_grad_inputs, slot.handoff = _backward_input(slot, ps)
        else:
            slot.wgrad_graph = torch.cuda.CUDAGraph()
            pending, slot.handoff = slot.handoff, None
            if pending is None:  # CaptureOrder puts each wgrad after its dgrad
                raise RuntimeError(f"internal: {entry} captured before its dgrad")
            with torch.cuda.graph(slot.wgrad_graph, pool=pool):
                slot.static_grad_params = pending.weight_grads(ps)
            del pending
            # The microbatch's autograd graph (activations, B's records) is dead after
            # W: let later captures in the pool reuse its memory, as the replay
            # order allows.
            slot.static_outputs = tuple(o.detach() for o in slot.static_outputs)


def _graphed_forward(
    stages: GraphedSplitStages,
    chunk: int,
    module: torch.nn.Module,
    training: bool,
    eager: Callable[..., Any],
) -> Callable[..., Any]:
    def forward(*args: Any) -> Any:
        if module.training != training:
            return eager(*args)
        return stages._forward(chunk, args)

    return forward
