"""Whether the installed torch behaves as the split backward relies on, probed on tiny tensors.

:func:`missing_feature`: what every split needs (a mismatch skips the patch,
and B refuses). :func:`unpack_twice_unsupported` and
:func:`recompute_alike_unsupported`: what ``CheckpointedWeights.IN_W`` and
``RECOMPUTE_IN_W`` need of ``torch.utils.checkpoint`` (a mismatch makes that
policy fall back to ``IN_B``, exact). Each is computed once per process.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils._python_dispatch import _disable_current_modes

from gradsafe.pipelining._torch._checkpoint import (
    HOLDER_NAME,
    checkpoint_holders,
    recomputes_alike,
    unpack_saved,
    unpack_twice,
)
from gradsafe.pipelining._torch._engine import backwards_spare, exec_group, run_backward
from gradsafe.pipelining._torch._hooks import has_other_post_hooks
from gradsafe.pipelining._torch._leaf_hooks import silenced_tensor_hooks
from gradsafe.pipelining._torch._multi_grad_hooks import multi_grad_hook_spans
from gradsafe.pipelining._torch._nodes import call_node, is_view, leaf_variable, runs_whole, version

__all__ = [
    "missing_feature",
    "recompute_alike_unsupported",
    "unpack_twice_unsupported",
]


def missing_feature() -> str | None:
    """The internal autograd feature the split backward needs and this torch lacks, if any.

    Runs on tiny tensors with gradients enabled, whatever the caller's grad mode.
    """
    with torch.enable_grad(), torch.inference_mode(False):
        x = torch.ones(2, device="cpu", requires_grad=True)
        w = torch.ones(2, device="cpu", requires_grad=True)
        node = (x * w).grad_fn
        if node is None:
            return "autograd records no graph here"
        if not hasattr(node, "_input_metadata"):
            return "autograd nodes have no _input_metadata"
        try:
            call_node(node, (torch.ones(2, device="cpu"),))
        except TypeError as exc:
            return f"built-in autograd nodes cannot be called directly ({exc})"
        accumulator = node.next_functions[1][0]
        if accumulator is None or leaf_variable(accumulator) is not w:
            return "AccumulateGrad nodes do not expose their variable"
        try:
            run_backward(
                [GradientEdge(node, 0)], [torch.ones(2, device="cpu")]
            )  # retains the graph
            torch.autograd.grad([GradientEdge(node, 0)], [w], [torch.ones(2, device="cpu")])  # type: ignore[list-item]
        except (TypeError, RuntimeError, AttributeError) as exc:
            return f"the autograd engine does not take GradientEdge roots ({exc})"
        return (
            _missing_hook_introspection(node, x, w)
            or _missing_custom_function_marks(x)
            or _missing_version_counter()
            or _missing_engine_queries()
            or _missing_sparing()
            or _missing_hook_silencing()
        )
    return None


class _Doubled(torch.autograd.Function):
    """A custom Function, to see that its node is told from a built-in one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def _missing_custom_function_marks(x: torch.Tensor) -> str | None:
    """Whether a custom Function's node is told from a built-in one: B runs a custom
    Function's backward whole (calling it again for its weight part would run user code twice),
    and would split one it took for built-in."""
    said = "a custom autograd.Function's node is not told from a built-in one"
    custom, builtin = _Doubled.apply(x).grad_fn, (x * 2).grad_fn
    try:
        told = custom is not None and builtin is not None
        told = told and runs_whole(custom) and not runs_whole(builtin)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - a changed internal may fail in any way
        return f"{said} ({type(exc).__name__}: {exc})"
    return None if told else said


def _missing_version_counter() -> str | None:
    """Whether in-place changes bump a tensor's version counter, shared with its views: W
    refuses a tensor B recorded that changed since (a parameter an optimizer stepped, a stage
    input overwritten), and would otherwise compute with the new values silently."""
    base = torch.zeros(2, device="cpu")
    view = base[:1]
    before = version(base)
    base.add_(1)
    view.mul_(2)
    if not is_view(view) or is_view(base) or not version(base) == version(view) == before + 2:
        return "in-place changes do not bump a tensor's version counter, shared with its views"
    return None


def _missing_engine_queries() -> str | None:
    """Whether a hook can ask the running backward which nodes it executes and which node is
    running (``_will_engine_execute_node``, ``_current_autograd_node``): B's leaf and
    multi-grad hooks decide by them what a capture may run."""
    x = torch.ones(2, device="cpu", requires_grad=True)
    w = torch.ones(2, device="cpu", requires_grad=True)
    a, b = x * 2, w * 3
    y = a + b
    seen: list[tuple[bool, bool, bool]] = []

    def hook(grad: torch.Tensor) -> None:
        seen.append(
            (
                bool(torch._C._will_engine_execute_node(a.grad_fn)),  # type: ignore[arg-type]
                bool(torch._C._will_engine_execute_node(b.grad_fn)),  # type: ignore[arg-type]
                torch._C._current_autograd_node() is y.grad_fn,
            )
        )

    y.register_hook(hook)
    try:
        torch.autograd.grad(y.sum(), [x])
    except (AttributeError, RuntimeError, TypeError) as exc:
        return f"a hook cannot ask the running backward what it executes ({exc})"
    if seen != [(True, False, True)]:
        return (
            "a hook asking the running backward (inputs=[x]) what it executes was told "
            f"(x's branch, the other branch, the hooked node running) = {seen}, not "
            "[(True, False, True)]"
        )
    return None


def _missing_hook_silencing() -> str | None:
    """Whether :func:`silenced_tensor_hooks` keeps a leaf's hook from running at a capture.

    B captures a parameter's gradient before W delivers it; a hook that ran at
    the capture too would run twice (and one that returns a changed gradient
    would change it twice).
    """
    leaf = torch.ones(2, device="cpu", requires_grad=True)
    calls: list[None] = []
    leaf.register_hook(lambda grad: calls.append(None))
    with silenced_tensor_hooks([leaf]):
        torch.autograd.grad((leaf * 2).sum(), [leaf])
    if calls:
        return "a leaf's tensor hooks run at a capture with its _backward_hooks set aside"
    torch.autograd.grad((leaf * 2).sum(), [leaf])
    if len(calls) != 1:
        return "a leaf's tensor hooks do not run again once its _backward_hooks are back"
    return None


def _missing_sparing() -> str | None:
    """Whether :func:`backwards_spare` keeps a backward off a parameter and feeds the other leaf."""
    param = torch.nn.Parameter(torch.ones(2, device="cpu"))
    leaf = torch.ones(2, device="cpu", requires_grad=True)
    try:
        with backwards_spare([param], keep_graphs=False):
            (param * leaf * 3).sum().backward()
    except (TypeError, RuntimeError, AttributeError) as exc:
        return f"autograd's engine object cannot be wrapped to spare parameters ({exc})"
    if (
        param.grad is not None
        or leaf.grad is None
        or not torch.equal(leaf.grad, param.detach() * 3)
    ):
        return "a backward with inputs= the other leaves still reaches the parameter"
    return None


def _missing_hook_introspection(node: Node, x: torch.Tensor, w: torch.Tensor) -> str | None:
    # Without these, B could not refuse hooks it cannot honour: it would
    # silently give them partial gradients instead.
    first = node.register_hook(lambda grad_inputs, grad_outputs: None)
    second = node.register_hook(lambda grad_inputs, grad_outputs: None)
    try:
        if not has_other_post_hooks(second):
            return "a node's post-hook handles do not expose the node's hook dict"
    except AttributeError as exc:
        return f"a node's post-hook handles do not expose the node's hook dict ({exc})"
    finally:
        first.remove()
        second.remove()
    for mode in ("all", "any"):
        handle = torch.autograd.graph.register_multi_grad_hook(
            (x, w),
            lambda grads: None,
            mode=mode,  # type: ignore[arg-type]
        )
        try:
            spans = multi_grad_hook_spans([x, w])
            joined = list(spans.values()) == [
                (get_gradient_edge(x).node, get_gradient_edge(w).node)
            ]
        finally:
            handle.remove()
        if not joined:
            return f"register_multi_grad_hook(mode={mode!r}) registrations are not recognisable"
    return None


# -- torch.utils.checkpoint, for the CheckpointedWeights policies -----------------------


@functools.cache
def unpack_twice_unsupported() -> str | None:
    """Why ``CheckpointedWeights.IN_W`` cannot rely on this torch's checkpoint (None: it can).

    IN_W relies on: a checkpointed op's saved tensors are ``_Holder`` objects
    with a ``handles`` dict and their region's frame; a region recomputes once
    per ``GraphExecGroup``; :func:`unpack_twice` makes B's unpack leave the
    recomputed tensor for W's, which gets the very same tensors without a
    second recomputation and then drops them (a further unpack raises); and
    :class:`KeptRecomputed` sees those tensors changed in place.
    """
    return _probed(_unpack_twice_differs)


@functools.cache
def recompute_alike_unsupported() -> str | None:
    """Why ``CheckpointedWeights.RECOMPUTE_IN_W`` cannot rely on this torch's checkpoint (None: it can).

    RECOMPUTE_IN_W relies on: each ``GraphExecGroup`` recomputes a region anew,
    to the same tensors where the region preserves the RNG state (dropout
    included); :func:`recomputes_alike` says so for such a plain region, and
    not for one without the RNG state preserved or with selective
    checkpointing's ``context_fn``.
    """
    return _probed(_recompute_alike_differs)


def _probed(probe: Callable[[], str | None]) -> str | None:
    # A changed internal may fail in any way (a missing attribute as much as
    # torch's own internal assert): each is a difference, never a crash. The
    # caller's dispatch modes (memory and FLOP counters) do not see the probe.
    try:
        with (
            _disable_current_modes(),
            torch.enable_grad(),
            torch.inference_mode(False),
            torch.random.fork_rng(devices=[]),
        ):
            return probe()
    except Exception as exc:  # noqa: BLE001 - see above
        return f"probing torch.utils.checkpoint failed ({type(exc).__name__}: {exc})"


class _Region:
    """A tiny checkpointed region that counts its runs: ``exp(x) * w``, dropout between.

    Its function closes over a counter, not over the region: the graph holds
    the function, and a cycle back to it would outlive the probe while a
    split pauses the cyclic collector.
    """

    def __init__(self, **checkpoint_kwargs: Any) -> None:
        self._runs: list[None] = []
        self.x = torch.arange(1.0, 5.0, device="cpu", requires_grad=True)
        w = torch.full((4,), 2.0, device="cpu", requires_grad=True)
        out = torch.utils.checkpoint.checkpoint(
            _counted(self._runs, w), self.x, use_reentrant=False, **checkpoint_kwargs
        )
        self.node: Node = out.grad_fn

    @property
    def runs(self) -> int:
        return len(self._runs)


def _counted(runs: list[None], w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        runs.append(None)
        return torch.nn.functional.dropout(x.exp(), 0.5, training=True).mul(w)

    return forward


def _unpack_twice_differs() -> str | None:
    region = _Region()
    holders = checkpoint_holders(region.node)
    if not holders or any(frame is None for _, frame in holders):
        return (
            f"a checkpointed op's saved tensors are not torch.utils.checkpoint.{HOLDER_NAME} "
            "objects with their region's frame"
        )
    group = exec_group()
    if group is None:
        return "torch.utils.checkpoint has no GraphExecGroup"
    with unpack_twice(holders, group) as kept, group:
        first = unpack_saved(region.node)
    if kept.modified() is not None:
        return "a recomputed tensor reads as changed in place though nothing changed it"
    with torch.no_grad():
        first[0].add_(0)
    if kept.modified() is None:
        return "a recomputed tensor changed in place between B and W is not seen as changed"
    with group:
        second = unpack_saved(region.node)
    if region.runs != 2 or not all(_same(a, b) for a, b in zip(first, second, strict=True)):
        return (
            "a recomputed tensor kept for a second unpack in its GraphExecGroup was not given "
            f"back as the same tensor from one recomputation (the region ran {region.runs - 1} "
            "time(s) in backward)"
        )
    with group:
        try:
            unpack_saved(region.node)
        except RuntimeError:
            pass
        else:
            return "a checkpoint holder keeps its recomputed tensor after its last unpack"
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Each unpack wraps the recomputed tensor anew: the same memory, not the same object.
    return a.data_ptr() == b.data_ptr() and torch.equal(a, b)


def _recompute_alike_differs() -> str | None:
    plain = _Region(preserve_rng_state=True)
    if not recomputes_alike(plain.node):
        return "a plain checkpointed region with preserve_rng_state=True is not recognised as such"
    groups = [exec_group(), exec_group()]
    if groups[0] is None:
        return "torch.utils.checkpoint has no GraphExecGroup"
    unpacked = []
    for group in groups:
        with group:
            unpacked.append(unpack_saved(plain.node))
    if plain.runs != 3 or not all(torch.equal(a, b) for a, b in zip(*unpacked, strict=True)):
        return (
            "a region does not recompute once per GraphExecGroup to the same tensors "
            f"(it ran {plain.runs - 1} time(s) in two groups)"
        )
    unlike = {
        "preserve_rng_state=False": _Region(preserve_rng_state=False),
        "a selective-checkpointing context_fn": _Region(context_fn=_save_nothing_contexts),
    }
    for what, region in unlike.items():
        if recomputes_alike(region.node):
            return f"a region with {what} is taken to recompute alike"
    return None


def _save_nothing_contexts() -> tuple[contextlib.AbstractContextManager[Any], ...]:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(  # type: ignore[no-any-return]
        lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE
    )
