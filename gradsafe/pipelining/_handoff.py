"""The B->W hand-off: what B recorded for W, with an explicit single-use lifecycle; it runs W."""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

from gradsafe.pipelining._torch import DONATED_BUFFERS, engine_error
from gradsafe.pipelining._weight_pass import Kept, OutputRoot, Recorded, deliver, leaf_grads

__all__ = [
    "GradientEdgeRootError",
    "GradientTypeError",
    "HandoffState",
    "SplitBackwardError",
    "WeightGradHandoff",
    "describe",
    "detach_output",
    "detached_by_split",
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

    Raised before any gradient is changed: gradsafe checks everything it can
    (argument types, B run twice, a hand-off used twice or with another stage's
    parameters, hooks a split cannot honour) before B runs any hook, and
    computes every gradient (saved tensors already freed fail there; hooks on
    weight-side nodes run there) before W's single delivery step. The one
    failure that can come after some gradients were accumulated is a user
    parameter hook's own exception, which propagates as is.
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
    ) -> None:
        self._recorded: tuple[Recorded, ...] = tuple(recorded)
        self._kept: tuple[Kept, ...] = tuple(kept)
        self._output_roots = tuple(output_roots)
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
        self._state = HandoffState.PENDING
        self._failure: str | None = None
        #: Autograd nodes the graph analysis visited (for diagnostics and benchmarks).
        self.num_nodes = num_nodes
        #: Input-dependent nodes whose weight-side gradients W computes.
        self.num_intermediates = len(self._recorded)
        #: Parameters (leaves) whose gradient B already computed and kept for W.
        self.num_kept = len(self._kept)
        #: Bytes of those kept gradients, held from B until W.
        self.kept_bytes = sum(g.numel() * g.element_size() for g, _, _ in self._kept)

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
        counterparts). Every error gradsafe can detect is raised as
        :class:`SplitBackwardError` before any gradient changes or hook runs;
        any exception leaves the hand-off ``FAILED``. With ``retain_graph=False``
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
        callbacks: list[Any] = []
        grads = self._compute(weights, callbacks)
        try:
            deliver(self._leaves, grads, callbacks)
        except BaseException as exc:
            self._finish(HandoffState.FAILED, f"delivery raised {type(exc).__name__}: {exc}")
            raise
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
        grads = self._compute(weights)
        by_owner: dict[int, torch.Tensor | None] = {}
        for owners, grad in zip(self._owners, grads):
            for owner in owners:
                by_owner[id(owner)] = grad
        self._finish(HandoffState.CONSUMED)
        return tuple(by_owner.get(id(w)) for w in weights)

    def _compute(
        self, weights: Sequence[torch.Tensor], callbacks: list[Any] | None = None
    ) -> list[torch.Tensor | None]:
        """Every leaf's gradient, computed before anything changes; any error leaves FAILED."""
        self._check_usable()
        try:
            self._check_weights(weights)
            try:
                # W takes the recorded nodes over and drops each once used.
                recorded, self._recorded = list(self._recorded), ()
                kept, self._kept = self._kept, ()
                group, self._group = self._group, None
                with contextlib.nullcontext() if group is None else group:
                    return leaf_grads(
                        recorded,
                        kept,
                        self._output_roots,
                        self._weight_nodes,
                        self._leaf_nodes,
                        self._leaves,
                        callbacks,
                    )
            except (
                RuntimeError
            ) as exc:  # torch's own errors; a hook's other exceptions pass as they are
                if engine_error(exc) == "donated_buffer":
                    raise SplitBackwardError(DONATED_BUFFERS) from exc
                raise SplitBackwardError(
                    "the weight pass failed while computing gradients, before changing any "
                    f"parameter's gradient ({type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}). A hook on "
                    "a weight-side node or tensor may have raised it; or another backward ran "
                    "through this microbatch's graph between B and W without retain_graph=True, "
                    "and the saved tensors W needs are gone: redo the microbatch's forward and "
                    "backward."
                ) from exc
        except BaseException as exc:
            self._finish(HandoffState.FAILED, f"{type(exc).__name__}: {exc}")
            raise

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

    def _check_weights(self, weights: Sequence[torch.Tensor]) -> None:
        given = {id(w) for w in weights}
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
        self._state = state
        self._failure = None if failure is None else failure.strip().splitlines()[0][:200]
        self._recorded = ()
        self._kept = ()
        self._group = None
        self._output_roots = ()
        self._weight_nodes = ()
        self._leaf_nodes = ()
        self._leaves = ()
        self._owners = ()
        self._outputs = ()
        self._keep_alive = ()
