"""The B->W hand-off: what B recorded for W, with an explicit single-use lifecycle."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import NoReturn

import torch
from torch.autograd.graph import GradientEdge, Node

from gradsafe.pipelining._graph import Intermediate

__all__ = ["HandoffState", "SplitBackwardError", "WeightGradHandoff"]


class SplitBackwardError(RuntimeError):
    """A split backward was used in a way that cannot give a fused backward's gradients.

    Raised before any gradient is changed.
    """


class HandoffState(enum.Enum):
    """Where a :class:`WeightGradHandoff` is in its life."""

    #: Made by ``stage_backward_input``; ``stage_backward_weight`` may consume it once.
    PENDING = "pending"
    #: ``stage_backward_weight`` delivered its gradients; everything it held is released.
    CONSUMED = "consumed"
    #: ``stage_backward_weight`` failed on it; everything it held is released.
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class CapturedIntermediate:
    """An intermediate and the gradients that arrived at it during B (None: none arrived)."""

    intermediate: Intermediate
    grads: tuple[torch.Tensor | None, ...]


@dataclasses.dataclass(frozen=True)
class OutputRoot:
    """A stage output whose gradient edge is weight-only, and its output gradient."""

    edge: GradientEdge
    grad: torch.Tensor


class WeightGradHandoff:
    """What ``stage_backward_input`` (B) hands to ``stage_backward_weight`` (W) for one microbatch.

    It takes the place of torch's ``param_groups`` list in a pipeline stage's
    ``backward_state``: the schedule stores it after B and passes it back to W.
    It is single-use: W consumes it (state ``CONSUMED``) and drops every node,
    gradient and tensor it held, so the microbatch's graph can be freed. Using it
    again, or with parameters that lack some of B's (another stage's), raises
    :class:`SplitBackwardError` without touching any gradient.
    """

    def __init__(
        self,
        *,
        captured: Sequence[CapturedIntermediate],
        output_roots: Sequence[OutputRoot],
        params: Sequence[torch.Tensor],
        weight_ids: frozenset[int],
        owners: Sequence[Node],
        num_nodes: int,
    ) -> None:
        self._captured: tuple[CapturedIntermediate, ...] = tuple(captured)
        self._output_roots: tuple[OutputRoot, ...] = tuple(output_roots)
        self._params: tuple[torch.Tensor, ...] = tuple(params)
        self._weight_ids = weight_ids
        # Nodes that own custom-Function nodes W still needs (their Python
        # objects do not keep the C++ graph alive once the outputs are detached).
        self._owners: tuple[Node, ...] = tuple(owners)
        self._state = HandoffState.PENDING
        self._failure: str | None = None
        #: Autograd nodes the graph analysis visited (for diagnostics and benchmarks).
        self.num_nodes = num_nodes
        #: Input-dependent nodes whose weight-side gradients W computes.
        self.num_intermediates = len(self._captured)

    @property
    def state(self) -> HandoffState:
        """The hand-off's lifecycle state."""
        return self._state

    def __repr__(self) -> str:
        return (
            f"WeightGradHandoff(state={self._state.value}, intermediates={self.num_intermediates}, "
            f"nodes={self.num_nodes})"
        )

    def __iter__(self) -> NoReturn:
        # torch's stage_backward_weight iterates its param_groups first, before
        # touching any gradient: reached when B ran patched and W did not.
        raise SplitBackwardError(
            "torch's stage_backward_weight got gradsafe's hand-off: stage_backward_input ran "
            "under gradsafe.patch('pipelining') and stage_backward_weight after the patch was "
            "released. Keep the patch active from B through W (patch at start-up, or around the "
            "whole schedule step); no gradient was changed."
        )

    # -- used by stage_backward_weight -------------------------------------------------

    def _claim(self, weights: Sequence[torch.Tensor]) -> None:
        """Check that W may run now with ``weights``; raise before anything changes."""
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
        given = {id(w) for w in weights}
        if not self._weight_ids <= given:
            raise SplitBackwardError(
                "stage_backward_weight got a hand-off made by stage_backward_input for another "
                f"set of parameters ({len(self._weight_ids)} given to B, "
                f"{len(self._weight_ids - given)} of them missing now): pass the hand-off back "
                "to the stage whose backward made it, with (at least) the same parameters."
            )

    def _finish(self, state: HandoffState, failure: str | None = None) -> None:
        self._state = state
        self._failure = failure
        self._captured = ()
        self._output_roots = ()
        self._params = ()
        self._owners = ()
