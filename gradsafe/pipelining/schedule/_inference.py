"""Stage metadata inference without side effects (hazard H6; the patch registry installs it).

Before the first microbatch of a schedule's first step, torch infers each
stage's input/output metadata by running the stage: torch 2.13+ runs every
stage forward with gradients enabled and, on the last stage, the user's
``loss_fn`` and a backward to the stage inputs; the inputs of non-first stages
are ``torch.empty`` (uninitialised memory). torch 2.11 runs the forwards only,
under ``no_grad`` on zeros. A ``loss_fn`` that runs a backward inside itself
(a chunked or fused cross-entropy loss) then accumulates a gradient computed
from garbage into the parameters' ``.grad`` before training starts, and
parameter hooks (optimizer-in-backward, gradient reducers) fire for it; a
train-mode forward updates BatchNorm statistics; dropout draws from the RNG.
And a ``torch.compile``'d block whose first backward is the inference's (which
frees its graph) has that backward compiled donating its saved buffers, so
no later backward can keep the graph: a zero-bubble schedule's first B
through the block is refused (torch raises "compiled with non-empty donated
buffers").

gradsafe makes the inference an observer: inputs built from metadata are
zeros, and an :class:`InferenceSnapshot` taken before the first stage runs puts
back after the last one every parameter's ``.grad`` (the same tensor object)
and ``main_grad``, every module buffer, the weights ``nn.Embedding(max_norm=...)``
renormalises in its forward, and the CPU (and initialised CUDA) RNG state, while
parameter and module backward hooks are silenced and a backward run inside the
inference (the loss's) is kept off the parameters, so no parameter's
``AccumulateGrad`` node, nor any of its hooks, runs. Under a schedule that
splits backwards (or a stage's own inference), torch's backward to the stage
inputs keeps its graph, as B does, so a compiled block's backward first run
there is compiled without donation and the schedule's B and W can run it. A
lazy module's parameters
are materialised, as torch's own inference does. What it cannot undo, another
parameter changed in place (weight clipping in ``loss_fn``), it refuses with
:class:`MetadataInferenceError`, as it refuses lazy buffers before the inference.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from gradsafe.pipelining import _torch
from gradsafe.pipelining._handoff import SplitBackwardError

__all__ = [
    "InferenceSnapshot",
    "MetadataInferenceError",
    "around_schedule_inference",
    "around_stage_inference",
    "zero_filled_inputs",
]


class MetadataInferenceError(RuntimeError):
    """Stage metadata inference changed state gradsafe cannot put back."""


class SnapshotState(enum.Enum):
    """Where an :class:`InferenceSnapshot` is in its life."""

    #: Taken: gradients are parked, hooks silenced; the inference may run.
    TAKEN = "taken"
    #: Restored: everything is back; the snapshot holds nothing.
    RESTORED = "restored"


@dataclasses.dataclass
class _ParamRecord:
    param: torch.Tensor
    grad: torch.Tensor | None
    version: int
    main_grad: torch.Tensor | None
    main_grad_copy: torch.Tensor | None
    #: Uninitialised (a lazy module's): the inference's forward materialises it,
    #: as the step's first forward would.
    lazy: bool
    #: The values before the inference, kept for a weight its module's forward
    #: renormalises in place (``max_norm``): the inference's rows are not the step's.
    copy: torch.Tensor | None


@dataclasses.dataclass
class _BufferRecord:
    module: nn.Module
    name: str
    buffer: torch.Tensor
    copy: torch.Tensor


class InferenceSnapshot:
    """What metadata inference may change, taken before it and put back once after it.

    :meth:`take` parks every parameter's ``.grad`` (the parameter's ``.grad``
    is ``None`` while the inference runs, so nothing it accumulates reaches
    the caller's tensor), copies ``main_grad``, the buffers and ``max_norm``
    embedding weights, saves the RNG states, silences the parameters' tensor
    and post-accumulate-grad hooks and the modules' backward hooks, and keeps
    backwards off the parameters (:func:`~gradsafe.pipelining._torch.backwards_spare`),
    their ``autograd.grad`` keeping its graph where ``keep_graphs``.
    :meth:`restore` reverses all of it and then raises
    :class:`MetadataInferenceError` if another parameter, not lazy, was
    changed in place meanwhile.
    """

    def __init__(self, modules: Sequence[nn.Module], keep_graphs: bool) -> None:
        self._modules = list(modules)
        self._keep_graphs = keep_graphs
        self._params: list[_ParamRecord] = []
        self._buffers: list[_BufferRecord] = []
        self._rng: _torch.RngStates | None = None
        self._hooks = contextlib.ExitStack()
        self.state: SnapshotState | None = None

    @classmethod
    def take(cls, modules: Sequence[nn.Module], keep_graphs: bool) -> InferenceSnapshot:
        """Take it; with ``keep_graphs``, ``autograd.grad`` keeps its graph until :meth:`restore`."""
        snapshot = cls(modules, keep_graphs)
        snapshot._take()
        return snapshot

    def _take(self) -> None:
        params = _unique(p for m in self._modules for p in m.parameters())
        with torch.no_grad():
            renormed = {id(p) for p in _renormed_weights(self._modules)}
            for param in params:
                main_grad = getattr(param, "main_grad", None)
                main_grad = main_grad if isinstance(main_grad, torch.Tensor) else None
                lazy = is_lazy(param)
                self._params.append(
                    _ParamRecord(
                        param,
                        param.grad,
                        _torch.version(param),
                        main_grad,
                        None if main_grad is None else main_grad.clone(),
                        lazy,
                        param.clone() if id(param) in renormed and not lazy else None,
                    )
                )
            for module in _unique(sub for m in self._modules for sub in m.modules()):
                for name, buffer in module.named_buffers(recurse=False):
                    self._buffers.append(_BufferRecord(module, name, buffer, buffer.clone()))
        self._rng = _torch.rng_states()
        self._hooks.enter_context(_torch.silenced_gradient_hooks(params, self._modules))
        self._hooks.enter_context(_torch.backwards_spare(params, self._keep_graphs))
        for record in self._params:
            record.param.grad = None
        self.state = SnapshotState.TAKEN

    def restore(self) -> None:
        """Put everything back; raise :class:`MetadataInferenceError` for what cannot be."""
        if self.state is not SnapshotState.TAKEN:
            raise MetadataInferenceError(
                f"an inference snapshot can be restored once, after it is taken (it is {self.state})"
            )
        self.state = SnapshotState.RESTORED
        self._hooks.close()
        changed = []
        with torch.no_grad():
            for record in self._params:
                record.param.grad = record.grad
                if record.main_grad is not None:
                    record.param.main_grad = record.main_grad  # type: ignore[attr-defined]
                    record.main_grad.copy_(record.main_grad_copy)  # type: ignore[arg-type]
                if record.copy is not None:
                    record.param.copy_(record.copy)
                elif not record.lazy and _torch.version(record.param) != record.version:
                    changed.append(record.param)
            for buf in self._buffers:
                setattr(buf.module, buf.name, buf.buffer)  # re-seats a buffer the forward rebound
                # Always copied: kernels that update buffers (BatchNorm's running
                # statistics) do not bump their version counters.
                buf.buffer.copy_(buf.copy)
        if self._rng is not None:
            _torch.set_rng_states(self._rng)
        names = _names(self._modules, changed)
        self._params, self._buffers, self._rng, self._modules = [], [], None, []
        if changed:
            raise MetadataInferenceError(
                f"parameter(s) {', '.join(names)} changed in place while the pipeline stages "
                "inferred their metadata. Before the first microbatch of the first step torch "
                "runs each stage forward and the loss_fn once (the first stage on the first "
                "microbatch, the others on zeros); gradsafe puts gradients, buffers, RNG and "
                "the weights of nn.Embedding/EmbeddingBag(max_norm=...) back afterwards, but "
                "keeps no copy of other parameters: one the stage's forward changes in place "
                "(e.g. F.embedding(..., max_norm=...) on a parameter) or an optimizer stepped "
                "inside loss_fn or a hook would keep the inference's change. Fix: step the "
                "optimizer after schedule.step(), or give every PipelineStage its input_args "
                "and output_args so no inference runs."
            )


def _renormed_weights(modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Weights whose module's forward renormalises the rows it looks up, in place."""
    return [
        sub.weight
        for m in modules
        for sub in m.modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.max_norm is not None
    ]


def _unique(items: Iterable[Any]) -> list[Any]:
    return list({id(item): item for item in items}.values())


def _names(modules: Sequence[nn.Module], params: Sequence[torch.Tensor]) -> list[str]:
    wanted = {id(p) for p in params}
    found = {id(p): name for m in modules for name, p in m.named_parameters(remove_duplicate=False)}
    return sorted(found.get(i, "<unnamed>") for i in wanted)


class _Run:
    """One schedule's metadata inference: the snapshot is taken when a stage first runs."""

    def __init__(self, modules: Sequence[nn.Module], keep_graphs: bool) -> None:
        self.modules = modules
        self.keep_graphs = keep_graphs
        self.snapshot: InferenceSnapshot | None = None

    def ensure_taken(self) -> None:
        if self.snapshot is None:
            self.snapshot = InferenceSnapshot.take(self.modules, self.keep_graphs)


_CURRENT: contextvars.ContextVar[_Run | None] = contextvars.ContextVar(
    "gradsafe_metadata_inference", default=None
)


def _refuse_lazy_buffers(modules: Sequence[nn.Module]) -> None:
    lazy = sorted(
        name
        for m in modules
        for name, buffer in m.named_buffers(remove_duplicate=False)
        if is_lazy(buffer)
    )
    if lazy:
        raise MetadataInferenceError(
            f"buffer(s) {', '.join(lazy)} of lazy modules are uninitialised, and the pipeline "
            "stages are about to infer their metadata: before the first microbatch of the "
            "first step torch runs each stage forward once, which would materialise them and "
            "may update them (running statistics of zeros), and gradsafe has no value from "
            "before to put back. Fix: initialise lazy modules before building the schedule "
            "(one forward on a sample input, e.g. in eval mode), or give every PipelineStage "
            "its input_args and output_args so no inference runs."
        )


@contextlib.contextmanager
def _inference_run(modules: Sequence[nn.Module], keep_graphs: bool) -> Iterator[_Run]:
    _refuse_lazy_buffers(modules)
    run = _Run(modules, keep_graphs)
    token = _CURRENT.set(run)
    try:
        yield run
    except RuntimeError as exc:
        if keep_graphs and _torch.engine_error(exc) == "donated_buffer":
            # B would refuse the block the same way: say why, and before any step runs.
            raise SplitBackwardError(_DONATED_AT_INFERENCE) from exc
        raise
    finally:
        _CURRENT.reset(token)
        if run.snapshot is not None:
            run.snapshot.restore()


_DONATED_AT_INFERENCE = (
    _torch.DONATED_BUFFERS.split(" (no parameter")[0]
    + " Found while the pipeline schedule inferred its stages' metadata, before the first "
    "microbatch: under a schedule that splits backwards gradsafe runs that inference's backward "
    "keeping the graph, as B will. If no backward of the block ran in this process, its "
    "backward was loaded so from AOTAutograd's on-disk cache (under TORCHINDUCTOR_CACHE_DIR): "
    "run with TORCHINDUCTOR_AUTOGRAD_CACHE=0 or delete that cache entry, or set "
    "donated_buffer = False as above (no parameter gradient has changed)."
)


def _loss_modules(loss_fn: object) -> list[nn.Module]:
    # A loss that owns parameters (an nn.Module, or a method of one) can
    # accumulate into them too.
    owner = getattr(loss_fn, "__self__", loss_fn)
    return [owner] if isinstance(owner, nn.Module) else []


def around_schedule_inference(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineSchedule._initialize_pp_stages``: one snapshot over all its stages' inference."""

    @functools.wraps(original)
    def _initialize_pp_stages(self: Any, *args: Any, **kwargs: Any) -> Any:
        stages = kwargs["stages"] if "stages" in kwargs else args[0]
        modules = [stage.submod for stage in stages]
        # A fused schedule's compiled blocks keep AOTAutograd's buffer donation.
        keep_graphs = _torch.splits_backward(self)
        with _inference_run(
            [*modules, *_loss_modules(getattr(self, "_loss_fn", None))], keep_graphs
        ):
            return original(self, *args, **kwargs)

    return _initialize_pp_stages


def around_stage_inference(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a stage's inference method: snapshot before it, unless a schedule-wide run already has one."""

    @functools.wraps(original)
    def inference(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = _CURRENT.get()
        if run is not None:
            run.ensure_taken()
            return original(self, *args, **kwargs)
        with _inference_run([self.submod], keep_graphs=True) as own:
            own.ensure_taken()
            return original(self, *args, **kwargs)

    return inference


def zero_filled_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``PipelineStage._to_tensor``: a tensor made from metadata (not copied) is zeros."""

    @functools.wraps(original)
    def _to_tensor(self: Any, arg: Any) -> Any:
        tensor = original(self, arg)
        if not isinstance(arg, torch.Tensor) and isinstance(tensor, torch.Tensor):
            with torch.no_grad():
                tensor.zero_()
        return tensor

    return _to_tensor
