"""Where a split puts the weight-gradient work of activation-checkpointed ops: the user's choice.

Read by B (``stage_backward_input``) when it runs, from a context variable
:func:`checkpointed_weights` sets, so that it reaches B however a schedule
calls it (torch's schedules call B with torch's own arguments).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import warnings
from collections.abc import Iterator

__all__ = ["CheckpointedWeights", "checkpointed_weights", "current_policy"]


class CheckpointedWeights(enum.Enum):
    """Where the weight gradients of ops inside non-reentrant ``torch.utils.checkpoint`` regions
    (full or selective) are computed; docs/pipelining.md has the trade-off as formulas.

    ``IN_W`` and ``IN_B`` are exact. Each region recomputes once per
    microbatch, in B, and with ``RECOMPUTE_IN_W`` once more, in W: exact only
    where the second recomputation reproduces the first (see its entry).
    """

    #: The default. W computes them: B keeps, from its recomputation, the
    #: tensors the checkpointed ops W calls saved (a GEMM's input), and W
    #: runs their weight GEMMs, as for a stage without checkpointing. Memory
    #: between B and W: those tensors and the gradients that arrived at the
    #: ops (no more than the stage without checkpointing holds).
    IN_W = "in_w"
    #: W computes them and recomputes their regions a second time to do so
    #: (in W, all its direct calls in one group: once per region), keeping
    #: nothing from B's recomputation: memory between B and W no more than
    #: torch's own split holds. Only for regions a second recomputation
    #: reproduces: plain ``checkpoint`` (no ``context_fn``: selective
    #: checkpointing's cache serves one recomputation) with
    #: ``preserve_rng_state=True``, nested (if at all) only in such regions;
    #: B computes the others' weight gradients (as ``IN_B``). Not detected,
    #: and wrong: a region whose forward updates state it reads (a buffer, a
    #: step counter, ``spectral_norm``) recomputes to other tensors in W;
    #: choosing this policy warns once (``UserWarning``).
    RECOMPUTE_IN_W = "recompute_in_w"
    #: B computes them with the input gradients and keeps the finished weight
    #: gradients for W to deliver: W does no GEMM of those ops. Memory between
    #: B and W: the weight gradients (less than ``IN_W`` when a microbatch
    #: has many tokens per weight element).
    IN_B = "in_b"


_POLICY: contextvars.ContextVar[CheckpointedWeights] = contextvars.ContextVar(
    "gradsafe_checkpointed_weights", default=CheckpointedWeights.IN_W
)


def current_policy() -> CheckpointedWeights:
    """The policy B uses now."""
    return _POLICY.get()


@contextlib.contextmanager
def checkpointed_weights(policy: CheckpointedWeights) -> Iterator[None]:
    """Use ``policy`` for every B (``stage_backward_input``) called in the ``with`` block.

    Wrap a schedule's ``step()`` (or the whole training loop). The policy is
    read when B runs; W follows what its B chose.

    Raises:
        TypeError: ``policy`` is not a :class:`CheckpointedWeights`.

    Example::

        >>> from gradsafe.pipelining import CheckpointedWeights, checkpointed_weights
        >>> with checkpointed_weights(CheckpointedWeights.IN_B):
        ...     pass  # schedule.step(...)
    """
    if not isinstance(policy, CheckpointedWeights):
        raise TypeError(
            f"checkpointed_weights takes a gradsafe.pipelining.CheckpointedWeights, got "
            f"{policy!r}: use CheckpointedWeights.IN_W (the default), RECOMPUTE_IN_W or IN_B."
        )
    if policy is CheckpointedWeights.RECOMPUTE_IN_W:
        warnings.warn(
            "CheckpointedWeights.RECOMPUTE_IN_W recomputes each checkpointed region again in W: "
            "a region whose forward updates state it reads (a buffer, a step counter, "
            "spectral_norm) gives W other tensors than B's, so its weight gradients differ from "
            "a fused backward's, silently. Use it only for regions that are pure functions of "
            "their inputs and parameters; IN_W (the default) and IN_B are exact there too.",
            UserWarning,
            stacklevel=3,
        )
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)
