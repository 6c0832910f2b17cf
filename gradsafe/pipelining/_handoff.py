"""The B->W hand-off: what B recorded for W, with an explicit single-use lifecycle; it runs W."""

from __future__ import annotations

import contextlib
import enum
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import torch
from torch.autograd.graph import Node

from gradsafe._shared import pending_w
from gradsafe._shared.gc_pause import collector_paused
from gradsafe.pipelining._compiled import announce_unsplit
from gradsafe.pipelining._graph import StageGraph
from gradsafe.pipelining._torch import (
    DONATED_BUFFERS,
    KeptRecomputed,
    engine_error,
    first_modified,
    freed_storages,
    is_modified_in_place,
    is_python_node,
    leaf_variable,
    saved_unusable,
    saves_storage,
    version,
)
from gradsafe.pipelining._weight_pass import (
    Delivery,
    IntermediateFailed,
    Kept,
    OutputRoot,
    Progress,
    Recorded,
    leaf_grads,
)
from gradsafe.wgrad.split import DeferredWeightGrads, open_split_store

_T = TypeVar("_T")

__all__ = [
    "GradientEdgeRootError",
    "GradientTypeError",
    "HandoffState",
    "KernelWeightGrads",
    "SplitBackwardError",
    "WeightGradHandoff",
    "describe",
    "detach_output",
    "detached_by_split",
    "kernels_defer_to_w",
]

# Stage outputs a split backward detached, by id (tensors compare elementwise,
# so no WeakSet): a later B on one of them is B run twice for a microbatch.
_DETACHED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def detach_output(tensor: torch.Tensor) -> None:
    """Detach a stage output in place, remembering that B already ran from it."""
    tensor.detach_()
    _DETACHED[id(tensor)] = tensor


def detached_by_split(tensor: torch.Tensor) -> bool:
    """Whether B or W detached ``tensor`` (a stage output of a microbatch already backwarded)."""
    return _DETACHED.get(id(tensor)) is tensor


class SplitBackwardError(RuntimeError):
    """A split backward was used in a way that cannot give a fused backward's gradients.

    Misuse is refused before any gradient changes: gradsafe checks everything
    it can without computing a gradient (argument types, B run twice, a
    hand-off used twice or with another stage's parameters, hooks a split
    cannot honour) before B runs any hook and before W computes anything. W
    then delivers each parameter's gradient as soon as it is final, so a
    failure part-way through W (saved tensors freed by another backward, a
    hook raising) leaves the parameters delivered before it with their new
    gradient; the error says how many (see ``stage_backward_weight``).
    """


class GradientEdgeRootError(SplitBackwardError, AssertionError):
    """A ``GradientEdge`` root (a released activation) came without its output gradient.

    Also an ``AssertionError``: torch's split raises one for this condition
    (2.15: "A GradientEdge root requires output gradients ..."), so an
    ``except`` clause written for torch's exception catches gradsafe's too.
    """


class GradientTypeError(SplitBackwardError, TypeError):
    """An output gradient that is neither a Tensor nor None.

    Also a ``TypeError``: torch's split raises one for this (2.11, from
    autograd; later releases wrap it in a ``RuntimeError``, which this is too).
    """


def _changed(progress: Progress | None) -> str:
    """What a weight pass that stopped at ``progress`` left changed, in words."""
    if progress is None or not (progress.delivered or progress.under_way):
        return "No parameter gradient has changed."
    text = (
        f"W had already delivered {progress.delivered} of the {progress.total} parameters' "
        "gradients (their .grad includes this microbatch's and their hooks ran)"
    )
    if progress.under_way:
        text += (
            f"; {progress.under_way} more were being delivered when it stopped (each may or "
            "may not include it)"
        )
    return text + "; the others are unchanged."


_MODIFIED = (
    "saved a tensor in the forward (an activation, a stage input or a weight) that was "
    "modified in place after B and before W, and W needs it (a fused backward run after the "
    "same change raises torch's 'modified by an inplace operation' error). Leave it unchanged "
    "until W has run (e.g. step the optimizer after every W), or modify a copy; then redo the "
    "microbatch's forward and backward."
)


class ReadInRecompute:
    """The stage's parameters when B ended (held weakly), for W's regions recomputed under ``RECOMPUTE_IN_W``.

    W recomputes a checkpointed region with the parameters' values at W, and a
    recomputation checks no version: an optimizer, EMA or clamp step run
    between B and W would give W other activations than the forward's. Every
    parameter given to B and every leaf (with its FSDP2 counterpart) the
    stage's graph accumulates into counts: which ones a region reads is not
    known before W recomputes it. Views share their base's version, and
    FSDP2's all-gather keeps the unsharded parameter's, so an update of the
    sharded parameter counts too.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        unique = {id(t): t for t in tensors}.values()
        self._seen = [(weakref.ref(t), version(t)) for t in unique]

    def modified(self) -> torch.Tensor | None:
        """A parameter changed in place since B (None: none did)."""
        return first_modified(self._seen)


def _recompute_refusal(param: torch.Tensor) -> str:
    return (
        f"W stopped before changing any parameter's gradient: a {describe(param)} of this stage "
        "was modified in place after B and before W (an optimizer, EMA or clamp step run before "
        "the last W). Under CheckpointedWeights.RECOMPUTE_IN_W, W recomputes the checkpointed "
        "regions with the parameters' values at W, so it would compute the weight gradients from "
        "other activations than the forward's. Step the optimizer (and modify parameters) only "
        "after every W has run (the schedule's step() returns), or use CheckpointedWeights.IN_W "
        "(the default: W reads B's recomputation); then redo the microbatch's forward and backward."
    )


def _intermediate_error(exc: IntermediateFailed, state: str) -> SplitBackwardError:
    cause = exc.cause
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    if is_modified_in_place(cause):
        why = "that node " + _MODIFIED
    elif "second time" in first or "freed" in first:
        why = (
            "its saved tensors are gone: another backward ran through this microbatch's graph "
            "between B and W without retain_graph=True. Redo the microbatch's forward and backward."
        )
    else:
        why = (
            "this is a limit of gradsafe's split backward (W calls that node's backward directly), "
            "not a misuse: use stage_backward (fused) for this stage and report it."
        )
    return SplitBackwardError(
        f"W could not compute the weight gradients of {exc.node_name} "
        f"({type(cause).__name__}: {first}); {why} {state}"
    )


class _LiveReads:
    """The tensors delayed weight closures read, held weakly, to test each result against.

    A read freed since (its parameter done) is no longer matched: a later result
    may reuse its address or its ``id``, which :class:`MemoryOf` (addresses and
    ids, read once) would take for sharing, copying that gradient for nothing.
    """

    __slots__ = ("_by_pointer",)

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._by_pointer: dict[int | None, list[weakref.ref[torch.Tensor]]] = {}
        for tensor in tensors:
            key = _pointer(tensor)
            self._by_pointer.setdefault(key, []).append(weakref.ref(tensor))

    def shared_by(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is a read still alive or shares its storage."""
        for key in {_pointer(grad), None}:
            for ref in self._by_pointer.get(key, ()):
                tensor = ref()
                if tensor is grad or (
                    tensor is not None and key is not None and _pointer(tensor) == key
                ):
                    return True
        return False


def _pointer(tensor: torch.Tensor) -> int | None:
    if tensor.layout is not torch.strided or tensor.numel() == 0:
        return None
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):  # subclasses without one storage
        return None


class KernelWeightGrads:
    """The weight parts custom Functions left for W in one B, and each parameter's accumulator.

    Filled by :func:`kernels_defer_to_w` when B's engine call ends; the
    hand-off owns it from then on and runs it in W (:meth:`as_kept`).
    """

    def __init__(self) -> None:
        self.deferred: DeferredWeightGrads | None = None
        self.targets: dict[int, Node] = {}

    def as_kept(self) -> list[Kept]:
        """Run the closures: one :class:`Kept` per parameter, for W's delivery."""
        deferred, self.deferred = self.deferred, None
        if deferred is None:
            return []
        # Read now, while alive: a closure's inputs are freed once its parameter is
        # done, and a later gradient may then take a freed read's address (or id).
        reads = _LiveReads(deferred.reads)
        kept: list[Kept] = []
        fused = sum(hasattr(param, "main_grad") for param in deferred.params)
        try:
            for param, grad in deferred.compute():
                if grad is not None:
                    kept.append(Kept(grad, self.targets[id(param)], 0, reads.shared_by(grad)))
        except BaseException as exc:
            context = (
                "W stopped while running a custom Function's delayed weight gradient; no .grad "
                "changed"
                + (
                    f"; the main_grad of the {fused} parameter(s) that have one may include part of it"
                    if fused
                    else ""
                )
            )
            if _keeps_type(exc):  # out of memory, a kernel's own error: what callers catch
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"gradsafe: {context}.")
                raise
            raise SplitBackwardError(
                f"{context} ({type(exc).__name__}: {exc}). Fix the kernel's closure; then zero the "
                "gradients and redo the step."
            ) from exc
        return kept

    def discard(self) -> None:
        if self.deferred is not None:
            self.deferred.discard()
            self.deferred = None


_NO_KERNELS = contextlib.nullcontext(None)


def kernels_defer_to_w(
    graph: StageGraph,
) -> contextlib.AbstractContextManager[KernelWeightGrads | None]:
    """B's scope in which the stage's custom Functions may leave their weight part to W.

    None (no scope, nothing to pay) for a stage without custom Function nodes.
    """
    nodes = [
        node
        for node in (*(item.node for item in graph.intermediates), *graph.weight_nodes)
        if is_python_node(node)
    ]
    return _NO_KERNELS if not nodes else _kernel_scope(graph, nodes)


@contextlib.contextmanager
def _kernel_scope(graph: StageGraph, nodes: Sequence[Node]) -> Iterator[KernelWeightGrads]:
    kernels = KernelWeightGrads()
    # What each custom Function's backward returned (which of its gradients
    # are tensors): one that records a parameter's weight part must not also
    # return that parameter's gradient.
    returned: dict[Node, tuple[bool, ...]] = {}
    handles = [node.register_hook(functools.partial(_returned, returned, node)) for node in nodes]
    try:
        with open_split_store(nodes) as result:
            yield kernels
    finally:
        for handle in handles:
            handle.remove()
    announce_unsplit(nodes)
    deferred = result[0]
    if not len(deferred):
        return
    targets = {id(leaf): node for node, leaf in graph.leaves.items()}
    _refuse_returned_twice(deferred, returned, targets)
    for param in deferred.params:
        if id(param) not in targets:
            deferred.discard()
            raise SplitBackwardError(
                f"a custom Function recorded a delayed weight gradient for a {describe(param)} "
                "that is not an input of its node (closed over or kept on ctx, not passed to "
                "apply), so its gradient has no accumulator in the stage's graph for W to deliver "
                "into. Pass the parameter to Function.apply. No gradient has changed."
            )
    kernels.deferred = deferred
    kernels.targets = {id(p): targets[id(p)] for p in deferred.params}


def _returned(
    returned: dict[Node, tuple[bool, ...]], node: Node, grad_inputs: Any, grad_outputs: Any
) -> None:
    returned[node] = tuple(g is not None for g in grad_inputs)


def _refuse_returned_twice(
    deferred: DeferredWeightGrads, returned: dict[Node, tuple[bool, ...]], targets: dict[int, Node]
) -> None:
    """Refuse a kernel that recorded a parameter's weight part and also returned its gradient (W would add it twice)."""
    for node, param in deferred.recorded_by:
        accumulator = targets.get(id(param))
        given = returned.get(node, ())
        if accumulator is not None and any(
            child is accumulator and i < len(given) and given[i]
            for i, (child, _) in enumerate(node.next_functions)
        ):
            deferred.discard()
            raise SplitBackwardError(
                f"the custom Function {node.name()} recorded the weight gradient of a "
                f"{describe(param)} in split_wgrad_store(ctx) and also returned it from backward: "
                "W would add it a second time. Return None in the parameter's slot when the store "
                "is not None (wgrad_return(weight, wgrad, ..., delayed=store is not None)). No "
                "gradient has changed."
            )


def _keeps_type(cause: BaseException) -> bool:
    """Whether ``cause`` must reach the caller as itself: a SplitBackwardError is not caught by its ``except``.

    torch raises a plain ``RuntimeError`` for what gradsafe words (saved tensors
    freed or modified in place, a node W cannot call); anything more specific
    (``torch.OutOfMemoryError``, a ``ValueError`` from a node) is caught by a
    clause a ``SplitBackwardError`` would slip past.
    """
    return not isinstance(SplitBackwardError(""), type(cause))


class HandoffState(enum.Enum):
    """Where a :class:`WeightGradHandoff` is in its life."""

    #: Made by ``stage_backward_input``; W may consume it once.
    PENDING = "pending"
    #: W delivered its gradients; everything it held is released.
    CONSUMED = "consumed"
    #: W raised on it (whatever the exception); everything it held is released.
    FAILED = "failed"


def describe(tensor: torch.Tensor) -> str:
    kind = "parameter" if isinstance(tensor, torch.nn.Parameter) else "leaf tensor"
    return f"{kind} of shape {tuple(tensor.shape)}, dtype {tensor.dtype}"


class WeightGradHandoff:
    """What ``stage_backward_input`` (B) hands to ``stage_backward_weight`` (W) for one microbatch.

    It takes the place of torch's ``param_groups`` list in a pipeline stage's
    ``backward_state``: the schedule stores it after B and passes it back to W.
    It is opaque (not a list; iterating it raises) and single-use: :meth:`run`
    consumes it (state ``CONSUMED``), or any exception leaves it ``FAILED``;
    either way it drops every node, gradient and tensor it held.
    """

    def __init__(
        self,
        *,
        recorded: Sequence[Recorded],
        kept: Sequence[Kept],
        output_roots: Sequence[OutputRoot],
        weight_nodes: Sequence[Node],
        leaf_nodes: Sequence[Node],
        leaves: Sequence[torch.Tensor],
        owners: Sequence[tuple[torch.Tensor, ...]],
        outputs: Sequence[torch.Tensor],
        keep_alive: Sequence[torch.Tensor],
        num_nodes: int,
        group: Any = None,
        kernels: KernelWeightGrads | None = None,
        recomputed: KeptRecomputed | None = None,
        read_in_recompute: ReadInRecompute | None = None,
    ) -> None:
        self._recorded: tuple[Recorded, ...] = tuple(recorded)
        self._kept: tuple[Kept, ...] = tuple(kept)
        self._output_roots = tuple(output_roots)
        # The versions of the gradients W starts from besides the recorded
        # ones (those carry their own, read as they arrived): W refuses if one
        # changed in place before it runs.
        self._root_versions = tuple(version(r.grad) for r in self._output_roots)
        self._kept_versions = tuple(version(k.grad) for k in self._kept)
        self._weight_nodes = tuple(weight_nodes)
        self._leaf_nodes = tuple(leaf_nodes)
        self._leaves = tuple(leaves)
        # Per leaf, the tensors a caller may name it by: the leaf itself and,
        # for an FSDP2 parameter, its sharded/unsharded counterpart.
        self._owners = tuple(owners)
        # Stage outputs another node consumes: detached after W, not in B.
        self._outputs = tuple(outputs)
        # Views of the outputs, made while they had a graph: their C++ nodes own
        # custom-Function nodes W calls even if the outputs are detached first.
        self._keep_alive = tuple(keep_alive)
        # The checkpoint group B ran in (None without checkpointed ops): W
        # runs in it too, so checkpointed regions are not recomputed again and
        # their recomputed tensors (held until W) are the ones B used.
        self._group = group
        # Custom Functions' weight parts B left unrun: W runs them first and
        # delivers them with the rest (None: no such kernel in the stage).
        self._kernels = None if kernels is None or kernels.deferred is None else kernels
        # What B's recomputation kept for W: W refuses if one changed in place since.
        self._recomputed = recomputed
        # The parameters' versions, where W recomputes regions (RECOMPUTE_IN_W).
        self._read_in_recompute = read_in_recompute
        self._state = HandoffState.PENDING
        self._failure: str | None = None
        #: Autograd nodes the graph analysis visited (for diagnostics and benchmarks).
        self.num_nodes = num_nodes
        #: Input-dependent nodes whose weight-side gradients W computes.
        self.num_intermediates = len(self._recorded)
        #: Parameters (leaves) whose gradient B already computed and kept for W.
        self.num_kept = len(self._kept)
        #: Bytes of those kept gradients, held from B until W.
        self.kept_bytes = sum(k.grad.numel() * k.grad.element_size() for k in self._kept)
        # A guarded DDP refuses its reduction while this W is outstanding
        # (gradsafe.wgrad.guard_ddp_step); an unguarded Megatron one warns once.
        pending_w.track(self)
        pending_w.warn_if_unguarded(self._leaves, "stage_backward_input (B)")

    def pending_leaves(self) -> Sequence[torch.Tensor]:
        """The parameters (and their FSDP2 counterparts) whose W this hand-off has yet to run; empty once used."""
        if self._state is not HandoffState.PENDING:
            return ()
        return [t for owners in self._owners for t in owners]

    def __del__(self) -> None:
        # Dropped before its W: a guarded DDP counts this microbatch's weight
        # gradients as lost from the step until zero_grad_buffer() starts another.
        if getattr(self, "_state", None) is HandoffState.PENDING and self._owners:
            try:
                pending_w.report_lost(self.pending_leaves(), "hand-off dropped without W")
            except (AttributeError, TypeError):  # interpreter shutdown: module globals are gone
                pass

    @property
    def state(self) -> HandoffState:
        """The hand-off's lifecycle state."""
        return self._state

    def __repr__(self) -> str:
        return (
            f"WeightGradHandoff(state={self._state.value}, intermediates={self.num_intermediates}, "
            f"nodes={self.num_nodes})"
        )

    def __iter__(self) -> Iterator[object]:
        # torch's own stage_backward_weight iterates its param_groups list.
        raise SplitBackwardError(
            "a gradsafe WeightGradHandoff reached code that expects torch's param_groups list: "
            "B ran under gradsafe.patch('pipelining') and W ran with torch's own "
            "stage_backward_weight (the patch was released between B and W), or code inspects "
            "the hand-off. Keep the patch applied until the schedule's step() returns (put the "
            "whole training loop inside the with block); the hand-off is opaque, use "
            "gradsafe.pipelining.stage_backward_weight to consume it."
        )

    def run(self, weights: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
        """W: accumulate this microbatch's weight gradients into the parameters, once.

        ``weights`` must include the parameters given to B (or their FSDP2
        counterparts). Misuse is raised as :class:`SplitBackwardError` before
        any gradient changes or hook runs; each parameter's gradient is then
        delivered as soon as it is final, so a later failure leaves those
        delivered before it changed (the exception says how many). Any
        exception leaves the hand-off ``FAILED``. With ``retain_graph=False``
        the stage outputs B left attached (those another node consumes) are
        detached in place afterwards, so nothing keeps the microbatch's graph alive.
        """
        if not isinstance(retain_graph, bool):
            self._check_usable()
            error = SplitBackwardError(
                f"retain_graph must be a bool, got {type(retain_graph).__name__}; W's third "
                "positional argument is retain_graph, not another hand-off."
            )
            self._finish(HandoffState.FAILED, str(error))
            raise error
        self._check_usable()
        progress = Progress()
        try:
            self._validate(weights)
            self._pass(lambda *parts: Delivery(*parts, progress=progress).run())
        except BaseException as exc:
            self._fail(exc, progress)
        if not retain_graph:
            for out in self._outputs:
                detach_output(out)
        self._finish(HandoffState.CONSUMED)

    def weight_grads(self, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """W without delivery: the gradient each of ``weights`` gets from this microbatch.

        For callers that deliver gradients themselves (graphed split stages
        copy them into static buffers). The values are exactly those
        :meth:`run` would accumulate; None for a weight this microbatch gives no
        gradient. Consumes the hand-off like :meth:`run`, with the same errors,
        and detaches nothing.
        """
        self._check_usable()
        try:
            self._validate(weights)
            grads = self._pass(leaf_grads)
        except BaseException as exc:
            self._fail(exc, None)
        by_owner: dict[int, torch.Tensor | None] = {}
        for owners, grad in zip(self._owners, grads):
            for owner in owners:
                by_owner[id(owner)] = grad
        self._finish(HandoffState.CONSUMED)
        return tuple(by_owner.get(id(w)) for w in weights)

    def _pass(self, weight_pass: Callable[..., _T]) -> _T:
        """Run ``weight_pass`` on what B recorded; the hand-off gives it all up first."""
        # W takes the recorded nodes over and drops each once used.
        recorded, self._recorded = list(self._recorded), ()
        kept, self._kept = list(self._kept), ()
        group, self._group = self._group, None
        kernels, self._kernels = self._kernels, None
        if kernels is not None:
            kept += kernels.as_kept()
        with collector_paused(), contextlib.nullcontext() if group is None else group:
            return weight_pass(
                recorded,
                kept,
                self._output_roots,
                self._weight_nodes,
                self._leaf_nodes,
                self._leaves,
            )

    def _fail(self, exc: BaseException, progress: Progress | None) -> NoReturn:
        """Leave the hand-off FAILED and raise ``exc`` (or the error gradsafe words for it)."""
        state = _changed(progress)
        error: BaseException | None = None
        if isinstance(exc, IntermediateFailed) and not _keeps_type(exc.cause):
            error = _intermediate_error(exc, state)
        elif isinstance(exc, IntermediateFailed):
            # torch's own error of a more specific type (out of memory, say): what callers
            # catch, as from torch's W; gradsafe's context goes in a note.
            cause = exc.cause
            self._finish(HandoffState.FAILED, f"{type(cause).__name__}: {cause}")
            if hasattr(cause, "add_note"):  # Python 3.11+
                cause.add_note(
                    f"gradsafe: raised while W computed the weight gradients of {exc.node_name} "
                    f"(calling that node's backward directly). {state}"
                )
            raise cause from cause.__cause__
        elif isinstance(exc, RuntimeError) and engine_error(exc) == "donated_buffer":
            # The shared text says nothing changed; W says what did.
            error = SplitBackwardError(DONATED_BUFFERS.split(" (no parameter")[0] + ". " + state)
        self._finish(HandoffState.FAILED, f"{type(error or exc).__name__}: {error or exc}")
        if error is None:
            # A hook's own exception (or torch's, from a weight-only node) keeps its type.
            # (Python 3.10 has no exception notes: there the counts are not attached.)
            if (
                progress is not None
                and (progress.delivered or progress.under_way)
                and hasattr(exc, "add_note")
            ):
                exc.add_note("gradsafe: " + state)
            raise exc
        raise error from (exc.cause if isinstance(exc, IntermediateFailed) else exc)

    def _check_usable(self) -> None:
        if self._state is HandoffState.CONSUMED:
            raise SplitBackwardError(
                "stage_backward_weight was called twice with the same hand-off: its weight "
                "gradients were already accumulated. Run stage_backward_input again (a new "
                "forward) for another weight pass."
            )
        if self._state is HandoffState.FAILED:
            raise SplitBackwardError(
                f"this hand-off's weight pass already failed ({self._failure}); it holds nothing "
                "any more. Redo the microbatch's forward and backward."
            )

    def _validate(self, weights: Sequence[torch.Tensor]) -> None:
        """Everything W can check without computing a gradient: nothing has changed yet."""
        self._check_weights(weights)
        self._refuse_values_changed_since_b()
        nodes = (*(rec.node for rec in self._recorded), *self._weight_nodes)
        changed = self._gradient_changed_since_b()
        if changed is not None:
            raise SplitBackwardError(
                "W stopped before changing any parameter's gradient: a gradient W reads (what "
                f"arrived at {changed} in B) was modified in place after B used it: by a hook "
                "that modified its argument in place (torch's hook contract: return a new "
                "tensor instead), or by code that reused a gradient buffer given to or returned "
                "by B (an output gradient, an input gradient) before W. A fused backward "
                "computes the weight gradients from the unmodified values. Return new tensors "
                "from hooks and keep those buffers unchanged until W has run (or clone them); "
                "then redo the microbatch's forward and backward."
            )
        for node in nodes:
            why = saved_unusable(node)
            if why == "freed":
                raise SplitBackwardError(
                    "W stopped before changing any parameter's gradient: the saved tensors of "
                    f"{node.name()}, which W needs, were freed: another backward ran through this "
                    "microbatch's graph between B and W without retain_graph=True. Redo the "
                    "microbatch's forward and backward."
                )
            if why == "modified":
                raise SplitBackwardError(
                    f"W stopped before changing any parameter's gradient: {node.name()} {_MODIFIED}"
                )
        freed = freed_storages(self._leaves)
        if freed:
            for node in nodes:
                if saves_storage(node, freed):
                    raise SplitBackwardError(
                        "W stopped before changing any parameter's gradient: "
                        f"{node.name()}, which W calls, saved a parameter whose storage has "
                        "been freed since B (FSDP2 with reshard_after_forward=True frees the "
                        "unsharded parameters when a forward of the stage runs between its B "
                        "and W, or any code that resized the storage to 0 bytes): W would read "
                        "freed memory. Run W while the parameters are gathered (torch's "
                        "schedules do: call W from the schedule, or unshard() the module "
                        "before W), or use reshard_after_forward=False; then redo the "
                        "microbatch's forward and backward."
                    )

    def _refuse_values_changed_since_b(self) -> None:
        """Refuse a tensor W reads other than through a saved tensor's version check, changed in place since B."""
        modified = None
        if self._kernels is not None and self._kernels.deferred is not None:
            modified = self._kernels.deferred.modified_read()
        if modified is not None:
            raise SplitBackwardError(
                f"W stopped before changing any parameter's gradient: {modified}, so W would "
                "compute with other values than a fused backward. Leave it unchanged until W has "
                "run (or have the kernel read a copy); then redo the microbatch's forward and "
                "backward."
            )
        if self._recomputed is not None and self._recomputed.modified() is not None:
            raise SplitBackwardError(
                f"W stopped before changing any parameter's gradient: a checkpointed op {_MODIFIED}"
            )
        changed_param = None
        if self._read_in_recompute is not None:
            changed_param = self._read_in_recompute.modified()
        if changed_param is not None:
            raise SplitBackwardError(_recompute_refusal(changed_param))

    def _gradient_changed_since_b(self) -> str | None:
        """Where a gradient W starts from was modified in place since B saw it (None: nowhere)."""
        for rec in self._recorded:
            for grad, seen in zip(rec.grads, rec.versions):
                if grad is not None and version(grad) != seen:
                    return rec.node.name()
        for root, seen in zip(self._output_roots, self._root_versions):
            if version(root.grad) != seen:
                return f"the stage output of {root.node.name()}"
        for kept, seen in zip(self._kept, self._kept_versions):
            if version(kept.grad) != seen:
                leaf = leaf_variable(kept.node)
                return "the accumulator of a " + ("leaf" if leaf is None else describe(leaf))
        return None

    def _check_weights(self, weights: Sequence[torch.Tensor]) -> None:
        given = {id(w) for w in weights}
        if given.issuperset(map(id, self._leaves)):
            return  # every leaf named by itself (each leaf is one of its own owners)
        missing = [
            leaf
            for leaf, owners in zip(self._leaves, self._owners)
            if not any(id(o) in given for o in owners)
        ]
        if missing:
            raise SplitBackwardError(
                f"stage_backward_weight's weights lack {len(missing)} of the {len(self._leaves)} "
                f"parameters this hand-off's graph accumulates into (first: {describe(missing[0])}): "
                "pass the hand-off back to the stage whose backward made it, with (at least) the "
                "same parameters."
            )

    def _finish(self, state: HandoffState, failure: str | None = None) -> None:
        if state is HandoffState.FAILED and self._state is HandoffState.PENDING and self._owners:
            pending_w.report_lost(self.pending_leaves(), "W failed")
        self._state = state
        self._failure = None if failure is None else failure.strip().splitlines()[0][:200]
        self._recorded = ()
        self._kept = ()
        self._group = None
        self._recomputed = None
        self._read_in_recompute = None
        if self._kernels is not None:
            self._kernels.discard()
            self._kernels = None
        self._output_roots = ()
        self._weight_nodes = ()
        self._leaf_nodes = ()
        self._leaves = ()
        self._owners = ()
        self._outputs = ()
        self._keep_alive = ()
