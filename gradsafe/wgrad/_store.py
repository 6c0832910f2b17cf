"""Delayed weight gradients: B records one closure per weight use, W runs them.

Lifecycle (one :class:`PendingWeightGrads` per microbatch)::

    store = WeightGradStore()
    loss.backward()            # B: fused kernels call store.record(...)
    pending = store.seal()     # B's records, frozen; the store records the next B
    ...                        # more B passes, other work
    pending.run()              # W: gradients computed, accumulated, hooks fired

Parameters whose weight gradient comes from W are marked with
:func:`~gradsafe.wgrad.markers.mark_delayed_wgrad`. Their AccumulateGrad node
sees only None during B (the weight slot returns None), so whoever needs to
know that a delayed parameter's gradient is ready registers with
:meth:`WeightGradStore.register_grad_ready_hook` instead of hooking
AccumulateGrad — Megatron-core's DDP through
:mod:`gradsafe.wgrad.megatron`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from gradsafe._shared import pending_w
from gradsafe.patching import REGISTRY
from gradsafe.wgrad._policy import flag_grad_written, flag_main_grad_written, watch_flag
from gradsafe.wgrad._torch import autograd_version
from gradsafe.wgrad.markers import mark_delayed_wgrad

__all__ = [
    "GradReadyHook",
    "OutstandingW",
    "PendingWeightGrads",
    "WeightGradClosure",
    "WeightGradStore",
    "forget_lost_w",
    "outstanding_w",
]

WeightGradClosure: TypeAlias = Callable[[torch.Tensor | None], torch.Tensor | None]
"""One use's weight-gradient computation, run at W time.

Called with ``param.main_grad`` when the use was recorded with
``accumulate_into_main_grad=True``: it must add its gradient into that tensor
(e.g. a GEMM with ``beta=1``) and return None. Called with None otherwise: it
returns this use's weight gradient as a fresh tensor the store may keep.
"""

GradReadyHook: TypeAlias = Callable[[torch.Tensor], None]
"""Called with the parameter once its gradient for the microbatch is complete."""


@dataclasses.dataclass(frozen=True)
class _Read:
    """A tensor a closure reads at W, and its autograd version when B recorded the closure."""

    tensor: torch.Tensor
    version: int

    def modified(self) -> bool:
        return autograd_version(self.tensor) != self.version


@dataclasses.dataclass(frozen=True)
class _Use:
    """One recorded weight use: what W computes for ``param`` (this store's and a split B's)."""

    param: torch.Tensor
    compute: WeightGradClosure
    accumulate_into_main_grad: bool
    # Recorded while a CUDA graph was being captured (WeightGradStore's records only: a
    # split B's store does not read it).
    captured: bool
    reads: tuple[_Read, ...]
    # The custom Function's node (an autograd Node) that recorded it (a split B's records only:
    # B refuses a node that records a parameter's weight part and also returns its gradient).
    node: Any = None


@dataclasses.dataclass(frozen=True)
class _LostPass:
    """A sealed pass with records that will deliver nothing more: its step's ``main_grad`` lacks it."""

    params: tuple[weakref.ref[torch.Tensor], ...]  # weak: a lost pass must not keep a model alive
    why: str

    @staticmethod
    def of(uses: tuple[_Use, ...], why: str) -> _LostPass:
        params = {id(use.param): use.param for use in uses}
        return _LostPass(tuple(weakref.ref(p) for p in params.values()), why)

    def touches(self, ids: set[int]) -> bool:
        return any(id(p) in ids for p in (ref() for ref in self.params) if p is not None)


@dataclasses.dataclass(frozen=True)
class OutstandingW:
    """Delayed weight gradients some parameters still lack: what a reduction or ``zero_grad_buffer()`` must not pass.

    Computed by :func:`outstanding_w`. False when nothing is outstanding.
    """

    open_records: int  # weight uses B recorded since its store's last seal()
    unrun: int  # sealed passes not run yet (or running on another thread)
    lost: tuple[str, ...]  # passes of this step that will deliver nothing more: why, each
    shapes: tuple[tuple[int, ...], ...]  # the parameters concerned, each once
    handoffs: int  # pipelining B's whose W (stage_backward_weight) has not run yet

    def __bool__(self) -> bool:
        return bool(self.open_records or self.unrun or self.lost or self.handoffs)

    def describe(self) -> str:
        """One clause per kind of outstanding work, with what makes it deliver."""
        parts = []
        if self.handoffs:
            parts.append(
                f"{self.handoffs} pipelining B(s) whose W (stage_backward_weight) has not run yet"
            )
        if self.unrun:
            parts.append(f"{self.unrun} sealed W pass(es) not run yet")
        if self.open_records:
            parts.append(
                f"{self.open_records} weight use(s) recorded by B since the last store.seal() "
                "(seal them and run the pass)"
            )
        if self.lost:
            counts = collections.Counter(self.lost)
            parts.append(
                f"{len(self.lost)} W pass(es) of this step that will deliver nothing ("
                + ", ".join(f"{n} {why}" for why, n in counts.items())
                + ": redo the step, see docs/wgrad.md)"
            )
        shapes = ", ".join(str(shape) for shape in self.shapes)
        return "; ".join(parts) + f" (parameters of shape {shapes})"


class _State(enum.Enum):
    SEALED = "sealed"
    RUNNING = "running"
    DONE = "done"
    FAILED = (
        "failed part-way (its gradients are partly applied: set every parameter's .grad to None "
        "and zero its main_grad, then redo the step; Megatron-core's zero_grad_buffer() zeroes "
        "main_grad but keeps .grad, which would land in the redone step)"
    )


class PendingWeightGrads:
    """One B pass's recorded weight-gradient work; :meth:`run` it exactly once (the W pass)."""

    def __init__(
        self,
        uses: tuple[_Use, ...],
        hooks: WeakIdKeyDictionary,
        lost: collections.deque[_LostPass],
    ) -> None:
        self._uses = uses
        self._hooks = hooks
        self._lost = lost  # the store's: where this pass reports that it will deliver nothing
        self._state = _State.SEALED
        self._claim = threading.Lock()  # run() from two threads: exactly one runs the pass
        # Parameters this pass has yet to deliver (ids: the uses hold the parameters until then).
        self._undelivered = {id(use.param) for use in uses}

    def __del__(self) -> None:
        # Dropped without run(): its weight gradients are lost from the step. A
        # finalizer cannot refuse, so it warns (a schedule that skips a W pass).
        if self._state is _State.SEALED and self._uses:
            # No lock: a finalizer may run on a thread that holds the store's.
            self._lost.append(_LostPass.of(self._uses, "dropped without run()"))
            warnings.warn(
                f"a sealed W pass (PendingWeightGrads with {len(self._uses)} recorded weight "
                "use(s)) was dropped without run(): those weight gradients are missing from the "
                "step (a guarded reduction refuses it: gradsafe.wgrad.guard_ddp_step). Run every "
                "sealed pass once, after its B pass and before the step's reduction.",
                RuntimeWarning,
                stacklevel=2,
            )

    def __len__(self) -> int:
        """Number of recorded weight uses."""
        return len(self._uses)

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def _will_deliver(self, param: torch.Tensor) -> bool:
        # A failed pass never runs again: it delivers nothing more.
        return self._state in _UNFINISHED and id(param) in self._undelivered

    def _outstanding_for(self, ids: set[int]) -> tuple[tuple[int, ...], ...] | None:
        """The shapes of ``ids``' parameters this unfinished pass has yet to deliver; None if none."""
        if self._state not in _UNFINISHED or self._undelivered.isdisjoint(ids):
            return None
        undelivered = self._undelivered & ids
        return tuple(tuple(u.param.shape) for u in self._uses if id(u.param) in undelivered)

    def run(self) -> None:
        """Compute every recorded weight gradient and deliver it, parameter by parameter.

        For each parameter, in the order B first recorded it: run all its
        uses (a tied weight's uses are all complete before anything else
        happens to it), then accumulate — never overwrite — into
        ``main_grad`` (uses recorded as fused) and ``.grad`` (the others), set
        ``grad_added_to_main_grad`` where it exists so that it is True only if
        ``.grad`` holds nothing ``main_grad`` lacks (``.grad`` may hold an
        undelayed use's gradient from B), and fire the parameter's grad-ready hooks once each, on
        this thread, with ``.grad`` not None (a fresh zero ``.grad`` is set if
        none exists, so hooks that assert it, as Megatron's does, hold).
        """
        with self._claim:
            if self._state is not _State.SEALED:
                raise RuntimeError(
                    f"PendingWeightGrads.run: this W pass is {self._state.value}; each sealed B "
                    "pass runs exactly once (call store.seal() after the next B for a new one)"
                )
            if any(use.captured for use in self._uses) and not _graph_capture_underway():
                raise RuntimeError(f"PendingWeightGrads.run: {_CAPTURED_OUTSIDE}")
            self._refuse_gradients_no_hook_would_take()
            self._refuse_reads_modified_since_b()
            self._refuse_params_freed_since_b()
            self._state = _State.RUNNING
        try:
            self._deliver()
        except BaseException:
            self._state = _State.FAILED
            self._lost.append(_LostPass.of(self._uses, "failed part-way"))
            raise
        self._uses = ()
        self._state = _State.DONE

    def _refuse_gradients_no_hook_would_take(self) -> None:
        # An unfused use puts its gradient into .grad. Under a Megatron-style
        # wrapper (main_grad and the flag) only a grad-ready hook moves it into
        # main_grad; without one it would silently miss the step.
        managed = [u.param for u in self._uses if _megatron_managed(u.param)]
        hooked = [p for p in managed if self._hooks.get(p)]
        for use in self._uses:
            param = use.param
            if not _megatron_managed(param) or self._hooks.get(param):
                continue
            if hooked:
                # Checked before anything is applied: W would otherwise fire the
                # hooked parameter's hook (DDP's for this one) after writing its main_grad.
                raise RuntimeError(
                    f"PendingWeightGrads.run: the delayed parameter of shape {tuple(param.shape)} "
                    "has main_grad and grad_added_to_main_grad (a Megatron-style data-parallel "
                    "wrapper owns its gradient) but no grad-ready hook in this store, while "
                    f"the delayed parameter of shape {tuple(hooked[0].shape)} in the same pass has "
                    "one. The usual cause: one module offering "
                    "register_wgrad_accumulation_and_reduce_hooks holds both (a delayed bias next "
                    "to its weight); Megatron-core's DDP calls that method once per delayed "
                    "parameter without saying which, so the module registered this parameter's "
                    "hook for the other one, and this one's W gradient would never be reduced. "
                    "Give each delayed parameter its own module offering the method, or do not "
                    "delay it (gradsafe.wgrad.guard_ddp_step refuses such a module when DDP is "
                    "built). Otherwise the module holding this parameter offers no "
                    "register_wgrad_accumulation_and_reduce_hooks, or the parameter's hook is in "
                    "another WeightGradStore (a weight tied across modules needs one store for "
                    "all its delayed uses). Nothing was applied; this pass stays unrun."
                )
            if not use.accumulate_into_main_grad:
                raise RuntimeError(
                    f"PendingWeightGrads.run: a delayed parameter of shape {tuple(param.shape)} has "
                    "main_grad and grad_added_to_main_grad (a Megatron-style data-parallel wrapper "
                    "owns its gradient) but no grad-ready hook in this store, so this W pass's "
                    "gradient would stay in .grad and never reach main_grad. Under Megatron-core "
                    "set DistributedDataParallelConfig(delay_wgrad_compute=True) and give the module "
                    "that holds the parameter register_wgrad_accumulation_and_reduce_hooks "
                    "(gradsafe.wgrad.megatron.register_megatron_hook); with "
                    "gradsafe.testing.MegatronStyleDDP pass delay_wgrad_compute=True. If that is "
                    "already so, the parameter's hook is in another WeightGradStore (gradsafe keeps "
                    "one Megatron hook per parameter, in the store registered last): a weight "
                    "tied across modules needs one store for all its delayed uses"
                )

    def _refuse_reads_modified_since_b(self) -> None:
        for use in self._uses:
            for i, read in enumerate(use.reads):
                if read.modified():
                    raise RuntimeError(
                        f"PendingWeightGrads.run: tensor {i} of reads= (shape "
                        f"{tuple(read.tensor.shape)}) of a delayed weight gradient for a parameter "
                        f"of shape {tuple(use.param.shape)} was modified in place since B recorded "
                        f"it (autograd version {read.version}, now {autograd_version(read.tensor)}), so W "
                        "would compute with values of another microbatch or step. The usual cause: "
                        "the tensor is an output of a CUDA-graphed callable "
                        "(make_graphed_callables), whose next call rewrites its static output "
                        "buffer. Run this W pass before whatever modified it (before the graphed "
                        "callable's next call), or have the kernel read a copy (e.g. "
                        "graphed(x).clone()). Nothing was applied; this pass stays unrun."
                    )

    def _refuse_params_freed_since_b(self) -> None:
        for use in self._uses:
            if _storage_freed(use.param):
                raise RuntimeError(
                    f"PendingWeightGrads.run: the delayed parameter of shape "
                    f"{tuple(use.param.shape)} has had its storage freed since B recorded it, so "
                    "its W gradient would go into a .grad that no one reads. The usual cause: "
                    "FSDP2 (fully_shard) recorded its unsharded parameter, reduce-scattered the "
                    "gradients at the end of B and resharded, freeing it; the delayed gradient "
                    "would be lost from the step. A delayed weight gradient needs a data-parallel "
                    "wrapper that waits for W (Megatron-core's DistributedDataParallel with "
                    "delay_wgrad_compute=True, see docs/wgrad.md); under FSDP2 or torch's "
                    "DistributedDataParallel compute the weight gradient in B (no wgrad store). "
                    "Nothing was applied; this pass stays unrun."
                )

    def _deliver(self) -> None:
        by_param: dict[int, list[_Use]] = {}
        for use in self._uses:
            by_param.setdefault(id(use.param), []).append(use)
        read = {_memory(r.tensor) for use in self._uses for r in use.reads}
        # Not inference mode, even if the caller runs W in it: a .grad made there is an
        # inference tensor, which the next accumulation (W's or AccumulateGrad's) refuses.
        with torch.inference_mode(False), torch.no_grad():
            for uses in by_param.values():
                param = uses[0].param
                fused = [use for use in uses if use.accumulate_into_main_grad]
                unfused = [use for use in uses if not use.accumulate_into_main_grad]
                if fused:
                    accumulate_into_main_grad(param, [use.compute for use in fused])
                    flag_main_grad_written(param)
                if unfused:
                    _accumulate_into_grad(param, unfused, read)
                    flag_grad_written(param)
                self._undelivered.discard(id(param))
                hooks = self._hooks.get(param)
                if hooks:
                    if param.grad is None:
                        # Fresh, not shared: a hook that keeps .grad may add into it.
                        param.grad = torch.zeros_like(param)
                    for hook in tuple(hooks.values()):
                        hook(param)


def accumulate_into_main_grad(param: torch.Tensor, computes: list[WeightGradClosure]) -> None:
    """Run fused closures into ``param.main_grad`` (also the split's W: gradsafe.wgrad.split)."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            "weight gradient recorded with accumulate_into_main_grad=True, but the parameter has "
            "no main_grad at W time; allocate param.main_grad before W or record without fusion"
        )
    for compute in computes:
        if compute(main_grad) is not None:
            raise RuntimeError(
                "a fused WeightGradClosure returned a tensor; when called with main_grad it must add "
                "its gradient into main_grad and return None"
            )


def _megatron_managed(param: torch.Tensor) -> bool:
    """Whether a Megatron-style wrapper owns ``param``'s gradient (it gave it ``main_grad`` and the flag)."""
    return hasattr(param, "main_grad") and hasattr(param, "grad_added_to_main_grad")


def _memory(t: torch.Tensor) -> int:
    """Where ``t``'s memory starts (shared by its views); a tensor subclass stands for itself."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return -id(t)
    return t.untyped_storage().data_ptr()


def _accumulate_into_grad(param: torch.Tensor, uses: list[_Use], read: set[int]) -> None:
    total: torch.Tensor | None = None
    summed = False  # total is this function's own sum, not a closure's tensor
    for use in uses:
        wgrad = use.compute(None)
        if wgrad is None or wgrad.shape != param.shape:
            got = None if wgrad is None else tuple(wgrad.shape)
            raise RuntimeError(
                f"an unfused WeightGradClosure must return the weight gradient of shape "
                f"{tuple(param.shape)}, got {got}"
            )
        if total is None:
            total = wgrad
        elif summed:
            total.add_(wgrad)
        else:
            # Never add into a closure's tensor: it may be one another closure of
            # this pass still reads (a bias-like weight's gradient is grad_out itself).
            total, summed = total + wgrad, True
    if total is None:  # callers pass at least one use
        return
    if param.grad is None:
        # AccumulateGrad's layout contract: .grad has the parameter's strides. And a
        # closure's result that is (a view of) a tensor this pass reads is copied: a
        # grad-ready hook writing .grad in place (zero_()) would change what a later
        # closure of the pass reads.
        if (
            total.stride() != param.stride()
            or total.dtype != param.dtype
            or (not summed and _memory(total) in read)
        ):
            total = torch.empty_like(param).copy_(total)
        param.grad = total
    else:
        param.grad.add_(total)


def _storage_freed(param: torch.Tensor) -> bool:
    """Whether ``param``'s memory was released in place (``untyped_storage().resize_(0)``, as
    FSDP2 does to an unsharded parameter when it reshards)."""
    if param.numel() == 0 or param.is_meta or type(param) not in (torch.Tensor, torch.nn.Parameter):
        return False  # a tensor subclass (a DTensor) has no storage of its own to ask about
    return param.untyped_storage().nbytes() == 0


def _read(t: torch.Tensor) -> _Read:
    if t.is_inference():
        raise ValueError(
            "WeightGradStore.record: reads= holds an inference tensor (made under "
            "torch.inference_mode()), which has no autograd version to check; pass tensors made "
            "outside inference mode"
        )
    return _Read(t, autograd_version(t))


_UNFINISHED = (_State.SEALED, _State.RUNNING)

_CAPTURED_OUTSIDE = (
    "delayed weight gradients were recorded while a CUDA graph was captured and are used after "
    "the capture ended. A graph's replay runs no Python, so no replay records them again: a "
    "delayed kernel inside a graphed callable (make_graphed_callables, "
    "make_graphed_split_callables) would leave every later W pass without its weight gradient. "
    "Keep delayed kernels out of graphed callables (or let the graph compute their weight "
    "gradient: no wgrad store for them); a graph of the whole step records, seals and runs "
    "its W passes inside the one capture"
)


def _graph_capture_underway() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    # A real capture needs an initialised CUDA context, and asking without one may
    # try to create it (and raise where no GPU is usable); a stand-in
    # (gradsafe.testing.emulate_cuda_graphs) is always asked.
    if not (
        torch.cuda.is_initialized()
        or REGISTRY.is_object_patched("torch.cuda", "is_current_stream_capturing")
    ):
        return False
    return bool(torch.cuda.is_current_stream_capturing())


class WeightGradStore:
    """Records delayed weight-gradient work during B and hands it to W, one microbatch at a time.

    Also owns the grad-ready hooks of delayed parameters. Thread-safe for
    recording from autograd's worker threads.

    Example (``record`` is called from a custom ``backward``; see
    ``examples/fused_linear.py``)::

        >>> import torch
        >>> from gradsafe.wgrad import WeightGradStore
        >>> store = WeightGradStore()
        >>> weight, x = torch.nn.Parameter(torch.ones(2)), torch.tensor([1.0, 2.0])
        >>> store.record(weight, lambda main_grad: 3 * x, accumulate_into_main_grad=False)
        >>> hook = store.register_grad_ready_hook(weight, lambda p: print("ready", p.grad))
        >>> pending = store.seal()  # end of B: this microbatch's W pass
        >>> pending.run()
        ready tensor([3., 6.])
        >>> pending.done
        True
    """

    def __init__(self) -> None:
        self._open: list[_Use] = []
        self._lock = threading.Lock()
        self._hooks: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Sealed passes not yet finished; one dropped unrun delivers nothing, and leaves.
        self._sealed: weakref.WeakSet[PendingWeightGrads] = weakref.WeakSet()
        # Passes that will deliver nothing more (dropped unrun, failed) since their
        # parameters' step began: a reduction must not pass them. Appended without
        # the lock (by finalizers), so a deque.
        self._lost: collections.deque[_LostPass] = collections.deque()
        with _stores_lock:
            _stores.add(self)

    def record(
        self,
        param: torch.Tensor,
        compute: WeightGradClosure,
        *,
        accumulate_into_main_grad: bool,
        reads: Iterable[torch.Tensor] = (),
    ) -> None:
        """Record one use of ``param`` whose weight gradient ``compute`` produces at W time.

        Call from a custom ``backward`` (B) that returned None in ``param``'s
        slot (see :func:`~gradsafe.wgrad.wgrad_return`). Marks ``param`` as
        delayed; mark it earlier (:func:`~gradsafe.wgrad.markers.mark_delayed_wgrad`)
        if a data-parallel wrapper decides at construction which parameters to
        hook.

        Args:
            reads: the tensors ``compute`` reads (the layer's input and the
                incoming gradient). A closure holds them by reference, so no
                saved-tensor check runs at W; :meth:`PendingWeightGrads.run`
                refuses, before applying anything, when one was modified in
                place since this call (its autograd version moved: e.g. a
                CUDA-graphed callable's output, which the callable's next call
                rewrites).

        Raises:
            ValueError: ``param`` is not a leaf (a view such as ``weight.t()``:
                its ``.grad`` never reaches the parameter), or a tensor in
                ``reads`` is an inference tensor (it has no version to check).
            RuntimeError: records made during a CUDA graph capture are still
                open after it ended (a delayed kernel inside a graphed
                callable): they are discarded. Records made, sealed and run
                within one capture (a whole-step graph) are fine.
        """
        if param.grad_fn is not None:
            raise ValueError(
                f"WeightGradStore.record: the parameter given (shape {tuple(param.shape)}) is not a "
                f"leaf but the output of {param.grad_fn.name()} (e.g. weight.t(), a tied weight "
                "passed as a view), so W would put its gradient in that tensor's .grad, which "
                "never reaches the parameter. Pass the parameter itself to the kernel (and record "
                "it), and apply the view inside the kernel and the closure."
            )
        read = tuple(_read(t) for t in reads)
        capturing = _graph_capture_underway()
        pending_w.warn_if_unguarded((param,), "WeightGradStore.record")
        mark_delayed_wgrad(param)
        # An undelayed use of param in this backward delivers its gradient into
        # .grad at AccumulateGrad; W must then leave it for the hook to add.
        watch_flag(param)
        with self._lock:
            if not capturing:
                self._refuse_records_left_by_a_capture("record")
            self._open.append(_Use(param, compute, accumulate_into_main_grad, capturing, read))

    def seal(self) -> PendingWeightGrads:
        """Freeze what was recorded since the last ``seal()`` into one W pass.

        Raises:
            RuntimeError: as :meth:`record`, for records a capture left open.
        """
        capturing = _graph_capture_underway()
        with self._lock:
            if not capturing:
                self._refuse_records_left_by_a_capture("seal")
            uses, self._open = tuple(self._open), []
            pending = PendingWeightGrads(uses, self._hooks, self._lost)
            for finished in [p for p in self._sealed if p._state not in _UNFINISHED]:
                self._sealed.discard(finished)
            self._sealed.add(pending)
        return pending

    def awaits_w(self, param: torch.Tensor) -> bool:
        """Whether a use of ``param`` recorded in this store still waits for the W pass that delivers it.

        True from :meth:`record` until a W pass has accumulated ``param``'s
        gradient (the use is open, or sealed in a pass not yet run or still
        running). False once no recorded use waits: no W pass this store
        knows of will touch ``param`` (a later B may still record one). A pass
        that failed, or was dropped unrun, delivers nothing more.
        """
        with self._lock:
            if any(use.param is param for use in self._open):
                return True
            return any(p._will_deliver(param) for p in self._sealed)

    def _outstanding(self, ids: set[int]) -> tuple[int, int, list[str], list[tuple[int, ...]]]:
        """Open records, unrun passes, lost passes (why) and shapes concerning the parameters ``ids``."""
        shapes: list[tuple[int, ...]] = []
        with self._lock:
            open_uses = [use for use in self._open if id(use.param) in ids]
            shapes += [tuple(use.param.shape) for use in open_uses]
            unrun = 0
            for pending in list(self._sealed):
                found = pending._outstanding_for(ids)
                if found is not None:
                    unrun += 1
                    shapes += found
        lost = [entry for entry in list(self._lost) if entry.touches(ids)]
        for entry in lost:
            shapes += [tuple(p.shape) for p in (ref() for ref in entry.params) if p is not None]
        return len(open_uses), unrun, [entry.why for entry in lost], shapes

    def _forget_lost(self, ids: set[int]) -> None:
        # Rotate rather than rebuild: a finalizer may append meanwhile (without the lock).
        for _ in range(len(self._lost)):
            entry = self._lost.popleft()
            alive = any(ref() is not None for ref in entry.params)
            if alive and not entry.touches(ids):
                self._lost.append(entry)

    def _refuse_records_left_by_a_capture(self, what: str) -> None:
        if any(use.captured for use in self._open):
            self._open = []  # unusable outside their capture; the store starts afresh
            raise RuntimeError(
                f"WeightGradStore.{what}: {_CAPTURED_OUTSIDE}. The open records were discarded"
            )

    def register_grad_ready_hook(self, param: torch.Tensor, hook: GradReadyHook) -> RemovableHandle:
        """Call ``hook(param)`` in each W pass that computes ``param``'s gradient, once it is complete.

        Marks ``param`` as delayed. Only W fires these hooks: an undelayed
        use's gradient that reaches ``.grad`` when no W pass awaits
        (:meth:`awaits_w` False) needs a post-accumulate-grad hook for it, as
        :func:`~gradsafe.wgrad.register_megatron_hook` adds.
        """
        mark_delayed_wgrad(param)
        hooks = self._hooks.get(param)
        if hooks is None:
            hooks = self._hooks[param] = OrderedDict()  # weakref-able, as RemovableHandle needs
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle


_stores: weakref.WeakSet[WeightGradStore] = weakref.WeakSet()
_stores_lock = threading.Lock()


def _live_stores() -> list[WeightGradStore]:
    with _stores_lock:
        return list(_stores)


def outstanding_w(params: Iterable[torch.Tensor]) -> OutstandingW:
    """What every live :class:`WeightGradStore` has yet to deliver to ``params``.

    Counts the uses B recorded and no ``seal()`` took yet, the sealed passes
    not yet run (or still running), and the passes that will deliver nothing
    more (dropped without ``run()``, or failed part-way) since
    :func:`forget_lost_w` last cleared them for these parameters.
    """
    ids = {id(p) for p in params}
    open_records = unrun = 0
    lost: list[str] = []
    shapes: dict[tuple[int, ...], None] = {}
    for store in _live_stores():
        store_open, store_unrun, store_lost, store_shapes = store._outstanding(ids)
        open_records += store_open
        unrun += store_unrun
        lost += store_lost
        shapes.update(dict.fromkeys(store_shapes))
    # gradsafe's own pipelining split: B's hand-offs whose W has not run, or never will.
    handoffs, handoffs_lost, handoff_shapes = pending_w.outstanding(ids)
    lost += handoffs_lost
    shapes.update(dict.fromkeys(handoff_shapes))
    return OutstandingW(open_records, unrun, tuple(lost), tuple(shapes), handoffs)


def forget_lost_w(params: Iterable[torch.Tensor]) -> None:
    """A new step starts for ``params`` (their ``main_grad`` was zeroed): passes lost in the last one no longer count."""
    ids = {id(p) for p in params}
    for store in _live_stores():
        store._forget_lost(ids)
    pending_w.forget_lost(ids)
