"""A torch whose ``torch.utils.checkpoint`` behaves otherwise: exact (via ``IN_B``) or refused.

``CheckpointedWeights.IN_W`` (the default) relies on how non-reentrant
checkpoint packs and drops recomputed tensors (``_Holder.handles``, dropped at
the first unpack, one recomputation per ``GraphExecGroup``); ``RECOMPUTE_IN_W``
on a new group recomputing to the same tensors. Each test below simulates a
plausible change of a future torch with ``monkeypatch`` and asserts what a
user gets: gradients equal to a fused backward's in fp64, the policy falling
back to ``IN_B`` with one warning, and never a silently different gradient.
docs/architecture.md ("Private torch internals") lists each entry.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import _benchmarks
import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

from gradsafe.pipelining import (
    CheckpointedWeights,
    _weight_side,
    checkpointed_weights,
    stage_backward_input,
    stage_backward_weight,
)
from gradsafe.pipelining._torch import _checkpoint, _probe


@pytest.fixture(autouse=True)
def _fresh_probes() -> Iterator[None]:
    """Each test probes its own (drifted) torch; the next one probes the real one again."""
    caches = (
        _probe.unpack_twice_unsupported,
        _probe.recompute_alike_unsupported,
        _weight_side._warn_fallback,
    )
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


class _Block(nn.Module):
    """A checkpointed MLP whose region draws dropout masks (a second recomputation differs)."""

    def __init__(self, preserve_rng_state: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 6)
        self.preserve = preserve_rng_state

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.dropout(torch.tanh(self.fc1(x)), 0.5, training=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            cp.checkpoint(self._region, x, use_reentrant=False, preserve_rng_state=self.preserve)
            * 1.5
        )


def _grads(
    preserve_rng_state: bool,
    backward: Callable[[torch.Tensor, torch.Tensor, _Block, torch.Tensor], None],
) -> list[torch.Tensor]:
    """The input's and parameters' gradients of one microbatch; the RNG seeded before the
    forward and before the backward, so a fused and a split run draw the same masks."""
    torch.manual_seed(0)
    block = _Block(preserve_rng_state)
    x = torch.randn(5, 6, requires_grad=True)
    grad = torch.randn(5, 6)
    torch.manual_seed(1)
    out = block(x)
    torch.manual_seed(2)
    backward(out, grad, block, x)
    return [t.grad for t in (x, *block.parameters())]  # type: ignore[misc]


def _fused(out: torch.Tensor, grad: torch.Tensor, block: _Block, x: torch.Tensor) -> None:
    out.backward(grad)


def _split(out: torch.Tensor, grad: torch.Tensor, block: _Block, x: torch.Tensor) -> None:
    _, handoff = stage_backward_input([out], [grad], [x], block.parameters())
    stage_backward_weight(block.parameters(), handoff)


def _split_warnings(policy: CheckpointedWeights, preserve_rng_state: bool = False) -> list[str]:
    """B then W give a fused backward's gradients exactly (fp64); the warnings they gave."""
    want = _grads(preserve_rng_state, _fused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RECOMPUTE_IN_W's own warning on choosing it
        chosen = checkpointed_weights(policy)
        chosen.__enter__()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _grads(preserve_rng_state, _split)
    finally:
        chosen.__exit__(None, None, None)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=f"gradient {i} differs")
    return [str(w.message) for w in caught]


def _fell_back(messages: list[str], policy: CheckpointedWeights) -> bool:
    return any(f"CheckpointedWeights.{policy.name} falls back to IN_B" in m for m in messages)


def _w_gemms(policy: CheckpointedWeights) -> int:
    """Matmul FLOPs W runs for a checkpointed MLP under ``policy`` (0: B computed them)."""
    measure = _benchmarks.load("_balance").measure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return measure(policy, "full", 16, 8).w


IN_W, IN_B = CheckpointedWeights.IN_W, CheckpointedWeights.IN_B
RECOMPUTE = CheckpointedWeights.RECOMPUTE_IN_W


# -- the real torch: the probes pass and the policies run as documented ---------------------


def test_the_checkpoint_probes_pass_on_the_installed_torch() -> None:
    assert _probe.unpack_twice_unsupported() is None
    assert _probe.recompute_alike_unsupported() is None


def test_in_w_runs_weight_gemms_in_w_without_a_warning_on_the_installed_torch() -> None:
    assert not _fell_back(_split_warnings(IN_W), IN_W)
    assert _w_gemms(IN_W) > 0


# -- drifted torch: each change below, simulated --------------------------------------------


class _PoppingHandles(dict[Any, Any]):
    """``handles`` of a torch that drops a handle by deleting it (``handles.pop(gid)``)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if value is None:
            self.pop(key, None)
        else:
            dict.__setitem__(self, key, value)


class _KeepingHandles(dict[Any, Any]):
    """``handles`` of a torch that keeps a recomputed tensor after its unpack."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if value is not None or key not in self:
            dict.__setitem__(self, key, value)


def _holder_with(handles_type: type[dict[Any, Any]]) -> type:
    """A ``_Holder`` whose ``handles`` always behaves as ``handles_type`` (also when replaced)."""

    class Holder(cp._Holder):  # type: ignore[misc, name-defined]
        @property  # type: ignore[misc]
        def handles(self) -> dict[Any, Any]:
            return self._drifted

        @handles.setter
        def handles(self, value: dict[Any, Any]) -> None:
            self._drifted = handles_type(value)

    return Holder


def _renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The class gradsafe looks up is gone under its name (torch renamed it).
    monkeypatch.setattr(_checkpoint, "HOLDER_NAME", "_SavedTensorHolder")


def _pops_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cp, "_Holder", _holder_with(_PoppingHandles))


def _keeps_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cp, "_Holder", _holder_with(_KeepingHandles))


def _ignores_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unpacks keyed by the graph task again: W's calls outside B's engine call recompute anew.
    monkeypatch.setattr(cp.GraphExecGroup, "_get_current_group", classmethod(lambda cls: None))


def _no_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(cp, "GraphExecGroup")


DRIFTS = {
    "holder class renamed": _renamed,
    "handle dropped by deletion": _pops_handles,
    "handle kept after its unpack": _keeps_handles,
    "GraphExecGroup ignored by unpack": _ignores_groups,
}


@pytest.mark.parametrize("drift", list(DRIFTS))
@pytest.mark.parametrize("preserve_rng_state", [False, True])
def test_in_w_on_a_drifted_checkpoint_falls_back_to_in_b_exactly_with_one_warning(
    drift: str,
    preserve_rng_state: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    DRIFTS[drift](monkeypatch)
    assert _probe.unpack_twice_unsupported() is not None
    messages = _split_warnings(IN_W, preserve_rng_state)
    assert _fell_back(messages, IN_W), messages
    assert _w_gemms(IN_W) == 0  # B computed the checkpointed ops' weight gradients
    # One warning per process and policy, not one per B.
    assert not _fell_back(_split_warnings(IN_W, preserve_rng_state), IN_W)


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_in_b_is_exact_on_every_drifted_checkpoint(
    drift: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    DRIFTS[drift](monkeypatch)
    assert not _fell_back(_split_warnings(IN_B), IN_B)


def test_a_torch_without_graph_exec_groups_refuses_a_checkpointed_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradsafe.pipelining import SplitBackwardError

    _no_groups(monkeypatch)
    assert "GraphExecGroup" in (_probe.unpack_twice_unsupported() or "")
    block = _Block(preserve_rng_state=True)
    x = torch.randn(5, 6, requires_grad=True)
    with pytest.raises(SplitBackwardError, match="no torch.utils.checkpoint.GraphExecGroup"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stage_backward_input([block(x)], [torch.ones(5, 6)], [x], block.parameters())
    assert all(p.grad is None for p in block.parameters()) and x.grad is None


def _rng_not_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    # preserve_rng_state=True still read as such, but the recomputation draws fresh masks.
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)


def _context_fn_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    # A recompute_fn whose closure no longer names its context: every region looks plain.
    monkeypatch.setattr(_checkpoint, "_closure", _plain_closure(_checkpoint._closure))


def _plain_closure(closure: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    import contextlib

    def read(fn: Any) -> dict[str, Any]:
        found = closure(fn)
        if "recompute_context" in found:
            found = {
                **found,
                "recompute_context": contextlib.nullcontext(),
                "preserve_rng_state": True,
            }
        return found

    return read


RECOMPUTE_DRIFTS = {
    "RNG state not restored on recomputation": _rng_not_restored,
    "region kind misread": _context_fn_hidden,
    "GraphExecGroup ignored by unpack": _ignores_groups,
}


@pytest.mark.parametrize("drift", list(RECOMPUTE_DRIFTS))
def test_recompute_in_w_on_a_drifted_checkpoint_falls_back_to_in_b_exactly(
    drift: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    RECOMPUTE_DRIFTS[drift](monkeypatch)
    assert _probe.recompute_alike_unsupported() is not None
    messages = _split_warnings(RECOMPUTE, preserve_rng_state=True)
    assert _fell_back(messages, RECOMPUTE), messages


def test_a_probe_that_raises_is_a_difference_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("recomputed")

    monkeypatch.setattr(_checkpoint, "checkpoint_holders", broken)
    monkeypatch.setattr(_probe, "checkpoint_holders", broken)
    reason = _probe.unpack_twice_unsupported()
    assert reason is not None and "KeyError" in reason


@pytest.mark.parametrize(
    "context",
    ["no_grad", "inference_mode", "graph_exec_group", "live_storage", "meta_device"],
)
def test_the_checkpoint_probes_answer_alike_under_a_callers_contexts(context: str) -> None:
    from gradsafe.testing import LiveStorage

    entered: Any = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "graph_exec_group": cp.GraphExecGroup,
        "live_storage": LiveStorage,
        "meta_device": lambda: torch.device("meta"),
    }[context]()
    with entered as mode:
        assert _probe.unpack_twice_unsupported() is None
        assert _probe.recompute_alike_unsupported() is None
    if isinstance(mode, LiveStorage):
        assert mode.peak == 0  # the caller's memory counter does not see the probe
