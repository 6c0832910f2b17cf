"""A kernel's weight part in a split backward's W: the store gradsafe's B opens for custom Functions.

A split (zero-bubble) backward runs B (input gradients) and, later, W
(weight gradients). gradsafe's B (:func:`gradsafe.pipelining.stage_backward_input`)
runs a custom ``autograd.Function``'s backward whole, since W cannot call it
a second time; a kernel library's weight GEMMs would then all land in B. A
kernel that can delay its weight part asks, in its ``backward``::

    store = split_wgrad_store(ctx)   # None outside a split B
    if store is not None:
        store.record(weight, compute, accumulate_into_main_grad=fuse, reads=(x, grad_out))
    ...
    return dgrad, wgrad_return(weight, wgrad, accumulate_into_main_grad=fuse,
                               delayed=store is not None)

(the :class:`~gradsafe.wgrad.WeightGradStore` protocol). B leaves the closures
unrun; the stage's :class:`~gradsafe.pipelining.WeightGradHandoff` runs them in
W and delivers each parameter's gradient through its AccumulateGrad, summed
with the rest of W's, exactly as the fused backward would have returned it:
the closure's tensor (unfused), or, after it added into ``main_grad``, what
:func:`~gradsafe.wgrad.wgrad_return` returns for a fused undelayed use.

The store belongs to the nodes B runs: :func:`split_wgrad_store` keys on the
node (``ctx``), so it answers the same on every autograd thread (a CUDA
backward runs Python on device threads) and None for the same Function in
any other backward.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from gradsafe.wgrad._policy import wgrad_return
from gradsafe.wgrad._store import WeightGradClosure, _read, _Use, accumulate_into_main_grad

__all__ = ["DeferredWeightGrads", "SplitWeightGradStore", "open_split_store", "split_wgrad_store"]


class _Recorded:
    """One B's uses, recorded by any of its nodes (from any autograd thread)."""

    def __init__(self) -> None:
        self.uses: list[_Use] = []
        self.open = True
        self.lock = threading.Lock()  # records may come from several autograd threads


class SplitWeightGradStore:
    """Where a custom Function run by a split B records its weight part; made by B, never by users.

    :meth:`record` has :meth:`WeightGradStore.record <gradsafe.wgrad.WeightGradStore.record>`'s
    signature, so one kernel serves both. Unlike that store it marks nothing
    (the parameter's gradient still reaches it through AccumulateGrad, in W).
    """

    def __init__(self, recorded: _Recorded, node: Any) -> None:
        # One store per node (so each use names the node that recorded it), all of one B sharing `recorded`.
        self._recorded = recorded
        self._node = node

    def record(
        self,
        param: torch.Tensor,
        compute: WeightGradClosure,
        *,
        accumulate_into_main_grad: bool,
        reads: Iterable[torch.Tensor] = (),
    ) -> None:
        """Record one use of ``param`` whose weight gradient ``compute`` produces in W.

        Call from the custom ``backward`` B runs, having returned None in
        ``param``'s slot (``wgrad_return(..., delayed=True)``). ``reads``: the
        tensors ``compute`` reads; W refuses, before any gradient changes, if
        one was modified in place since.

        Raises:
            ValueError: ``param`` is not a leaf (pass the parameter itself), or
                a tensor in ``reads`` is an inference tensor.
            RuntimeError: the B that opened this store has ended (a kernel
                kept the store past its backward).
        """
        if param.grad_fn is not None:
            raise ValueError(
                f"SplitWeightGradStore.record: the parameter given (shape {tuple(param.shape)}) is "
                f"not a leaf but the output of {param.grad_fn.name()}, so W could not deliver its "
                "gradient. Pass the parameter itself to the Function (and record it), and apply "
                "the view inside the kernel and the closure."
            )
        use = _Use(
            param,
            compute,
            accumulate_into_main_grad,
            captured=False,  # read only by WeightGradStore
            reads=tuple(_read(t) for t in reads),
            node=self._node,
        )
        recorded = self._recorded
        with recorded.lock:
            if not recorded.open:
                raise RuntimeError(
                    "SplitWeightGradStore.record: the split backward (B) that opened this store "
                    "has ended, so no W would run this weight gradient. Look the store up with "
                    "split_wgrad_store(ctx) inside each backward call; do not keep it."
                )
            recorded.uses.append(use)


def _close(recorded: _Recorded) -> DeferredWeightGrads:
    with recorded.lock:
        recorded.open = False
        uses, recorded.uses = tuple(recorded.uses), []
    return DeferredWeightGrads(uses)


class DeferredWeightGrads:
    """What the custom Functions of one B left for its W; :meth:`compute` runs it once.

    Owned by the B->W hand-off, which calls :meth:`modified_read`
    before W changes anything and then :meth:`compute`. Dropped without
    :meth:`compute`, it warns: those weight gradients are missing from the step.
    """

    def __init__(self, uses: tuple[_Use, ...]) -> None:
        self._uses = uses
        self._done = False

    def __len__(self) -> int:
        """Number of recorded weight uses."""
        return len(self._uses)

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """The parameters recorded, each once, in first-recorded order."""
        return tuple({id(u.param): u.param for u in self._uses}.values())

    @property
    def recorded_by(self) -> tuple[tuple[Any, torch.Tensor], ...]:
        """Each use's ``(node that recorded it, parameter)``, in recorded order."""
        return tuple((u.node, u.param) for u in self._uses)

    @property
    def reads(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a closure reads (what a closure's result may alias)."""
        return tuple(r.tensor for u in self._uses for r in u.reads)

    def modified_read(self) -> str | None:
        """Why W must not run the closures (a read modified in place since B), or None."""
        for use in self._uses:
            for read in use.reads:
                if read.modified():
                    return (
                        f"a tensor a custom Function's delayed weight gradient reads (shape "
                        f"{tuple(read.tensor.shape)}, for a parameter of shape "
                        f"{tuple(use.param.shape)}) was modified in place after B recorded it"
                    )
        return None

    def compute(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per parameter: run its closures, yield ``(param, what its fused backward returned)``.

        The unfused closures' gradients are summed; fused ones add into
        ``main_grad`` and contribute :func:`wgrad_return`'s dummy (or None). A
        parameter's ``main_grad`` changes only as its own pair is computed.

        Raises:
            RuntimeError: called twice, a closure's result of the wrong shape,
                or a fused closure that returned a tensor.
        """
        if self._done:
            raise RuntimeError("DeferredWeightGrads.compute: already ran (W runs once per B)")
        self._done = True
        uses, self._uses = self._uses, ()
        by_param: dict[int, list[_Use]] = {}
        for use in uses:
            by_param.setdefault(id(use.param), []).append(use)
        del uses
        with torch.inference_mode(False), torch.no_grad():
            for group in by_param.values():
                yield _compute_param(group)
                group.clear()  # each closure's inputs are freed once its parameter is done

    def discard(self) -> None:
        """Drop the closures unrun, without the warning: the W that owned them failed or refused."""
        self._done = True
        self._uses = ()

    def __del__(self) -> None:
        # A finalizer cannot refuse: a hand-off dropped before its W loses these.
        if not self._done and self._uses:
            warnings.warn(
                f"the weight gradients {len(self._uses)} custom Function use(s) left for W were "
                "dropped without W: a split B's hand-off was discarded before "
                "stage_backward_weight ran. Run W once for every B (or use a fused backward).",
                RuntimeWarning,
                stacklevel=2,
            )


def _compute_param(group: Sequence[_Use]) -> tuple[torch.Tensor, torch.Tensor | None]:
    param = group[0].param
    total: torch.Tensor | None = None
    for use in group:
        if use.accumulate_into_main_grad:
            continue
        grad = use.compute(None)
        if grad is None or grad.shape != param.shape:
            got = None if grad is None else tuple(grad.shape)
            raise RuntimeError(
                f"an unfused WeightGradClosure must return the weight gradient of shape "
                f"{tuple(param.shape)}, got {got}"
            )
        total = grad if total is None else total + grad  # never into a closure's tensor
    fused = [use for use in group if use.accumulate_into_main_grad]
    if fused:
        accumulate_into_main_grad(param, [use.compute for use in fused])
        # One fused use in a backward returns the dummy (or None): the same here.
        returned = wgrad_return(param, None, accumulate_into_main_grad=True, delayed=False)
        if total is None:
            total = returned
    return param, total


_open: dict[int, tuple[object, SplitWeightGradStore]] = {}
_open_lock = threading.Lock()


def split_wgrad_store(ctx: object) -> SplitWeightGradStore | None:
    """The store a split B opened for this custom Function's node, or None.

    ``ctx`` is the ``ctx`` a custom ``backward`` receives (the Function's
    node). None outside gradsafe's B (a fused backward, torch's own split, W,
    another thread's backward through other nodes): the kernel then computes
    its weight gradient as usual.
    """
    entry = _open.get(id(ctx))
    return entry[1] if entry is not None and entry[0] is ctx else None


@contextmanager
def open_split_store(nodes: Sequence[object]) -> Iterator[list[DeferredWeightGrads]]:
    """B's scope: ``nodes`` (custom Function nodes) see one store until it exits.

    Yields a list that holds, after the scope exits normally, the
    :class:`DeferredWeightGrads` recorded in it (nothing on an exception:
    what was recorded is dropped with the failed B, silently).
    """
    recorded = _Recorded()
    stores = {id(node): SplitWeightGradStore(recorded, node) for node in nodes}
    result: list[DeferredWeightGrads] = []
    with _open_lock:
        for node in nodes:
            _open[id(node)] = (node, stores[id(node)])
    try:
        yield result
    except BaseException:
        _close(recorded).discard()
        raise
    finally:
        with _open_lock:
            for node in nodes:
                if _open.get(id(node), (None, None))[1] is stores[id(node)]:
                    del _open[id(node)]
    result.append(_close(recorded))
