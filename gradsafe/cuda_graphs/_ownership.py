"""Which gradients a graphed backward must copy out of its static buffers, and the Function that does it.

Upstream's graphed backward returns ``static_grad.detach()`` for every input
slot. That view is fine wherever autograd consumes it before the next replay of
the same graph, and wrong wherever it is *kept*:

* a leaf (parameter or user input) whose ``.grad`` is None: AccumulateGrad
  steals the incoming tensor as ``.grad``; the next replay rewrites it (H3);
* a leaf whose ``.grad`` exists: AccumulateGrad adds in place and drops the
  view, so no copy is needed -- unless a tensor hook (``register_hook``) on the
  leaf, which receives the view, may keep it;
* a leaf captured by ``torch.autograd.grad``: the view is returned to the caller;
* a non-leaf input: the producing node receives the view and may keep it
  (``AddBackward`` and view backwards pass it through unchanged, possibly all
  the way into a leaf's ``.grad``; a custom Function may store it; a tensor hook
  may keep it; ``torch.autograd.grad(..., inputs=[h])`` returns it). The one
  producer known to consume it at once is another gradsafe-graphed callable,
  whose backward copies it into its own static buffer before returning. So a
  non-leaf slot is copied unless it comes from a gradsafe-graphed callable, has
  no tensor hooks, that callable's backward will run, and the running backward
  is shown to be ``Tensor.backward`` (some leaf accumulator in reach will run;
  ``autograd.grad`` never runs one).

Hooks registered directly on autograd nodes (``Node.register_prehook``) are not
visible to Python; ``"always"`` covers them.

The same Function makes the callable's one-microbatch-at-a-time state loud
(:class:`Replays`): each call bumps the autograd version counter of its
outputs (a replay rewrites the static output buffers in place, which autograd
cannot see), so a tensor saved from an earlier call's output fails at unpack
with torch's "modified by an inplace operation" error; and a backward whose
call is no longer the last replay refuses to read the later call's activations.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal

import torch
from torch.autograd.graph import increment_version
from typing_extensions import TypeAlias

from gradsafe.cuda_graphs._autograd import (
    accumulate_grad_keeps,
    function_class_of,
    has_tensor_hooks,
    is_accumulate_grad,
    is_accumulating_backward,
    leaf_fate,
    not_differentiable,
    version_of,
    will_execute,
)

__all__ = ["Ownership", "Replays", "owning_graphed", "OWNERSHIP_POLICIES"]

Ownership: TypeAlias = Literal["auto", "always", "never"]
"""Which gradients a graphed callable copies out of its static buffers (``make_graphed_callables``'s ``ownership``)."""
OWNERSHIP_POLICIES: tuple[Ownership, ...] = ("auto", "always", "never")

# Class attribute marking gradsafe's Graphed subclasses (and, through
# ``_forward_cls``, their backward nodes).
_MARK = "_gradsafe_owning_graphed"


def _is_gradsafe_graphed_output(t: object) -> bool:
    return bool(getattr(function_class_of(getattr(t, "grad_fn", None)), _MARK, False))


def _leaf_needs_copy(accumulator: Any, policy: Ownership) -> bool:
    # No exemption for parameters marked as delayed-wgrad: a mark says that
    # some use of the weight is delayed, not that this slot holds a placeholder
    # (a tied weight's unfused use inside the callable puts its real gradient
    # here, and W then adds into whatever .grad is). A static buffer does not
    # say which it holds, so it is owned by the same rule as any leaf's.
    leaf = accumulator.variable
    fate = leaf_fate(accumulator)
    if fate == "discarded":
        return False
    if policy == "always" or fate == "captured":
        return True
    return accumulate_grad_keeps(leaf)


def _nonleaf_needs_copy(
    producer: Any, held_input: torch.Tensor | None, policy: Ownership, accumulating: bool
) -> bool:
    if policy == "always" or held_input is None:
        return True
    return has_tensor_hooks(held_input) or not (accumulating and will_execute(producer))


def _evidence_nodes(ctx: Any) -> list[Any]:
    """Our own edges and those of the graphed callables feeding us: where leaf accumulators are."""
    nodes = [node for node, _ in ctx.next_functions if node is not None]
    for held in ctx.gradsafe_chained:
        if held is not None:
            nodes += [node for node, _ in held.grad_fn.next_functions if node is not None]
    return nodes


def _owned(ctx: Any, static: tuple[Any, ...], policy: Ownership) -> tuple[Any, ...]:
    """``static`` (upstream's backward results) with the gradients ``policy`` owns cloned."""
    owned = list(static)
    accumulating: bool | None = None  # probed once, only if a chained slot needs it
    for i, grad in enumerate(static):
        edge = ctx.gradsafe_edge_of[i]
        if grad is None or edge is None or not ctx.needs_input_grad[i]:
            continue
        node = ctx.next_functions[edge][0]
        if node is None:
            continue
        if is_accumulate_grad(node):
            copy = _leaf_needs_copy(node, policy)
        else:
            held = ctx.gradsafe_chained[i]
            if held is not None and accumulating is None:
                accumulating = is_accumulating_backward(_evidence_nodes(ctx))
            copy = _nonleaf_needs_copy(node, held, policy, bool(accumulating))
        if copy:
            # In the engine's grad mode: under create_graph the clone keeps
            # once_differentiable's error node, so differentiating again
            # still raises instead of treating the gradient as a constant.
            owned[i] = grad.clone()
    return tuple(owned)


def _storage_pointer(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage starts (None for an empty one, which aliases nothing)."""
    pointer = t.untyped_storage().data_ptr()
    return pointer or None


class Replays:
    """How many times one graphed callable's forward graph was replayed: its static buffers hold the last.

    Each call is numbered (its generation). A backward may replay the backward
    graph only for the last call, and only once: the static activations it
    reads are that call's, its outputs must not have been modified in place
    since (the backward graph may read them, as an eager backward reads a
    saved output), and a backward replay may overwrite them (measured on a GPU).
    """

    def __init__(self, static_inputs: tuple[torch.Tensor, ...] = ()) -> None:
        self.latest = 0
        # Aliases of the latest call's outputs (no autograd history, so no
        # cycle through the graph) and their versions right after the call.
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._versions: tuple[int, ...] = ()
        # The call whose backward graph was last replayed.
        self._backward_of = 0
        # The tensors the graphs read as inputs (sample arguments, parameters:
        # the backward graph reads those a capture saved) and their versions
        # right after the latest call.
        self._static_inputs = static_inputs
        self._input_versions: tuple[int, ...] = ()
        # Their storages: an output that is one of them (a module returning
        # its weight, a callable returning its argument) is not rewritten by
        # the replay, so its version is not bumped (that would break an eager
        # use of the parameter saved before the call).
        self._input_storages = {p for p in map(_storage_pointer, static_inputs) if p is not None}

    def stamp(self, ctx: Any, outputs: tuple[Any, ...]) -> None:
        """Number the call whose forward replay just wrote ``outputs``; host work only, no kernel."""
        # The outputs are detached views of the static output buffers and share
        # their version counter: tensors saved from an earlier call's outputs
        # now fail at unpack instead of reading this call's values.
        tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
        rewritten = [o for o in tensors if _storage_pointer(o) not in self._input_storages]
        if rewritten:
            increment_version(rewritten)
        self._outputs = tuple(o.detach() for o in tensors)
        self._versions = tuple(version_of(o) for o in tensors)
        self._input_versions = tuple(version_of(t) for t in self._static_inputs)
        self.latest += 1
        ctx.gradsafe_generation = self.latest
        # Also saved, so that a non-reentrant checkpoint's recomputation
        # replaces it with the recomputed call's. On the CPU whatever the
        # default device: reading it must not synchronise a GPU.
        ctx.save_for_backward(torch.scalar_tensor(self.latest, dtype=torch.int64, device="cpu"))

    def check(self, ctx: Any) -> None:
        """Raise unless the static buffers hold the call whose backward ``ctx`` runs, unmodified."""
        if ctx.gradsafe_generation != self.latest:
            # Under a non-reentrant torch.utils.checkpoint, unpacking recomputes
            # the call (a replay with the same inputs) and hands back the
            # recomputed call's token instead: the buffers then hold this call again.
            (token,) = ctx.saved_tensors
            if int(token) != self.latest:
                raise self._called_again(ctx)
        if self._backward_of == self.latest:
            raise RuntimeError(
                "gradsafe.cuda_graphs: a second backward through one call of a graphed callable "
                "(retain_graph=True, or autograd.grad and then backward over the same call). The "
                "backward graph was captured as a single backward: the memory it frees as it goes "
                "is reused within the graph, so its first replay may overwrite the activations a "
                "second replay would read, and that replay would compute wrong gradients "
                "silently. Call the graphed callable again (or recompute the call in its "
                "backward with torch.utils.checkpoint around it) for each backward through it."
            )
        changed = next(
            (
                i
                for i, (t, v) in enumerate(zip(self._static_inputs, self._input_versions))
                if version_of(t) != v
            ),
            None,
        )
        if changed is not None:
            raise RuntimeError(
                f"gradsafe.cuda_graphs: input {changed} of this graphed callable's graphs (its "
                "sample arguments, then the module's parameters) was modified in place after the "
                "call and before its backward. The captured backward graph reads that tensor "
                "itself wherever an op of the callable saved it (a parameter always is the "
                "graph's input; an argument is when it is the sample tensor passed again), so it "
                "would differentiate the modified values; eager autograd refuses the same change "
                "where the tensor was saved. Change parameters only after the backward (step "
                "the optimizer after it), and refill a sample tensor for the next call only "
                "after this call's backward (or pass a different tensor, which is copied). "
                "Gradients already accumulated by this backward are incomplete: zero them "
                "before redoing the step."
            )
        if any(version_of(o) != v for o, v in zip(self._outputs, self._versions)):
            raise RuntimeError(
                "gradsafe.cuda_graphs: an output of this graphed callable was modified in place "
                "after the call and before its backward. The captured backward graph reads the "
                "static output buffers wherever an op of the callable saved its output (as "
                "tanh, sigmoid, softmax and relu do), so it would differentiate the modified "
                "values; eager autograd refuses the same modification where the output was "
                "saved. Modify a copy instead (y = graphed(x).clone(), or an out-of-place op). "
                "Gradients already accumulated by this backward are incomplete: zero them "
                "before redoing the step."
            )
        self._backward_of = self.latest

    def _called_again(self, ctx: Any) -> RuntimeError:
        return RuntimeError(
            f"gradsafe.cuda_graphs: this backward belongs to call {ctx.gradsafe_generation} of a "
            f"graphed callable, but the callable was called again since (its latest call is "
            f"{self.latest}). Its backward graph reads the static activations the latest call's "
            "replay wrote, so it would compute that call's gradients, not this one's. Run each "
            "call's backward before the callable's next call (F0 B0 F1 B1); for several "
            "microbatches in flight (1F1B, zero-bubble schedules) graph the stages with "
            "gradsafe.cuda_graphs.make_graphed_split_callables (one graph per microbatch), or "
            "recompute the call in its backward with torch.utils.checkpoint around the graphed "
            "callable. Gradients already accumulated by this backward are incomplete: zero them "
            "before redoing the step."
        )


_TWICE = (
    "trying to differentiate twice through a graphed callable (gradsafe.cuda_graphs): its "
    "backward replays a captured graph, which autograd cannot differentiate, so a gradient "
    "computed with create_graph=True through it (a gradient penalty) has no second-order "
    "terms. Compute that gradient with the eager module instead of the graphed callable."
)


def owning_graphed(
    graphed_cls: type[torch.autograd.Function],
    policy: Ownership,
    static_inputs: tuple[torch.Tensor, ...] = (),
) -> type[torch.autograd.Function]:
    """A subclass of upstream's ``Graphed`` whose backward returns owned gradients per ``policy``.

    ``static_inputs``: the tensors its graphs read as inputs, checked unmodified at backward.
    """
    if policy not in ("auto", "always"):
        raise ValueError(f"owning_graphed: policy must be 'auto' or 'always', got {policy!r}")
    upstream_forward = graphed_cls.forward
    upstream_backward = graphed_cls.backward
    replays = Replays(static_inputs)  # one per callable: graphed_cls is

    class GradsafeGraphed(graphed_cls):  # type: ignore[valid-type,misc]
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            # Autograd gives tensor arguments edges (ctx.next_functions) and
            # skips the others (2.15's leading tuple of graphs), so argument i's
            # edge is number edge_of[i].
            edges = itertools.count()
            ctx.gradsafe_edge_of = tuple(
                next(edges) if isinstance(a, torch.Tensor) else None for a in args
            )
            # An input produced by another gradsafe-graphed callable lives in
            # that callable's static output buffer, so holding it costs no
            # memory; its hooks are checked at backward time.
            ctx.gradsafe_chained = tuple(
                a if _is_gradsafe_graphed_output(a) else None for a in args
            )
            outputs = upstream_forward(ctx, *args)
            replays.stamp(ctx, outputs)
            return outputs

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> Any:
            replays.check(ctx)
            # One slot per forward argument: checked when the callable was made.
            static = upstream_backward(ctx, *grads)
            if not isinstance(static, tuple):
                # once_differentiable returns its error node's lone output
                # bare when the incoming gradients require grad (create_graph).
                static = (static,)
            owned = _owned(ctx, static, policy)
            if torch.is_grad_enabled():
                # create_graph=True: the replayed graph computed these outside
                # autograd, so differentiating them again must raise, not see constants.
                return not_differentiable(owned, _TWICE)
            return owned

    setattr(GradsafeGraphed, _MARK, True)
    GradsafeGraphed.__qualname__ = f"GradsafeGraphed[{policy}]"
    return GradsafeGraphed
