"""autograd's engine: its entry points, end-of-backward callbacks, and the checkpoint group.

Private torch read here: ``Variable._execution_engine`` (``run_backward``,
``queue_callback``; swapped for a forwarding proxy while W defers callbacks
or a backward must spare parameters), ``torch.autograd.graph._engine_run_backward``,
``torch._C._current_autograd_node``, ``Function.apply``'s C ``apply`` with
functorch's checks, ``torch.utils.checkpoint.GraphExecGroup`` and
``torch._C._get_graph_exec_group``, and the text of the engine's errors.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from gradsafe.pipelining._torch._nodes import leaf_variable

__all__ = [
    "DONATED_BUFFERS",
    "DONATED_BUFFERS_FROM_CACHE",
    "EngineError",
    "apply_function",
    "backwards_spare",
    "captured_grads",
    "current_exec_group",
    "deferred_callbacks",
    "engine_error",
    "exec_group",
    "on_device_thread",
    "queue_callback",
    "run_backward",
]


def exec_group() -> Any:
    """A new checkpoint ``GraphExecGroup`` (None if this torch has none): one per microbatch."""
    try:
        from torch.utils.checkpoint import GraphExecGroup
    except ImportError:
        return None
    return GraphExecGroup()


def current_exec_group() -> Any:
    """The checkpoint ``GraphExecGroup`` active on this thread, if any."""
    getter = getattr(torch._C, "_get_graph_exec_group", None)
    return None if getter is None else getter()


class deferred_callbacks:  # noqa: N801 - a context manager, used as `with deferred_callbacks(nodes) as held:`
    """Hold the end-of-backward callbacks that hooks of ``nodes`` queue, in the list ``with`` yields.

    ``queue_callback`` runs a callback when the current engine call ends. W's
    weight-only pass ends before its delivery pass gives the parameters their
    gradients, where a fused backward's callbacks run after: the caller queues
    the held callbacks from inside its delivery pass. A callback queued while
    any other node runs (another thread's backward) goes to the engine as usual.
    Several Ws may hold the same nodes (a tied weight): the W the calling
    thread runs holds it, the innermost where Ws nest (a W run from a hook of
    another W); on one of autograd's device threads (a GPU node's hook), the
    innermost of any thread.

    A class, not a generator-based context manager: W enters it once per call.
    """

    __slots__ = ("_entry",)

    def __init__(self, nodes: set[Node]) -> None:
        self._entry: _Deferring = (0, nodes, [])

    def __enter__(self) -> list[Callable[[], None]]:
        self._entry = (threading.get_ident(), *self._entry[1:])
        with _ENGINE_LOCK:
            _wrap_engine()
            _DEFERRING.append(self._entry)
        return self._entry[2]

    def __exit__(self, *exc: object) -> None:
        entry = self._entry
        with _ENGINE_LOCK:
            _DEFERRING[:] = [e for e in _DEFERRING if e is not entry]
            _unwrap_engine()


@contextlib.contextmanager
def backwards_spare(params: Sequence[torch.Tensor], keep_graphs: bool) -> Iterator[None]:
    """Keep the backwards this context runs (``backward()``, not ``autograd.grad``) off ``params``.

    A backward that would accumulate into one of ``params`` (or into any other
    ``nn.Parameter``) runs with ``inputs=`` the other leaves it reaches, so
    the engine never runs those parameters' ``AccumulateGrad`` nodes: their
    ``.grad`` is not written and none of their hooks fire (tensor hooks,
    post-accumulate-grad hooks, the node's Python pre-hooks and post hooks,
    C++ hooks such as DDP's reducer), nor any node whose only way out leads
    to them. The other leaves get exactly the gradients they would have got.
    A backward that reaches no other leaf is not run. Backwards on other
    threads, and contexts copied before this one was entered, are untouched.

    With ``keep_graphs``, every ``autograd.grad`` (a backward that
    accumulates nothing: torch's backward to the stage inputs) runs keeping
    its graph, as a split's B does. A compiled block whose backward first runs
    there is then compiled by AOTAutograd without donating its saved buffers
    (it donates only when that first run frees the graph), so a later B can
    run it; the gradients are the same.
    """
    token = _SPARED.set(_Spared(frozenset(id(p) for p in params), keep_graphs))
    try:
        with _engine_wrapped():
            yield
    finally:
        _SPARED.reset(token)


@dataclasses.dataclass(frozen=True)
class _Spared:
    """What :func:`backwards_spare` does to this thread's backwards."""

    #: ``id`` of each parameter kept out of them.
    params: frozenset[int]
    #: Run ``autograd.grad`` keeping its graph.
    keep_graphs: bool


_SPARED: contextvars.ContextVar[_Spared | None] = contextvars.ContextVar(
    "gradsafe_spared_parameters", default=None
)
_ENGINE_LOCK = threading.Lock()
_ENGINE_USERS = [0]
# Per W deferring callbacks: the thread running it, its nodes, the callbacks it holds.
_Deferring = tuple[int, set[Node], list[Callable[[], None]]]
_DEFERRING: list[_Deferring] = []


@contextlib.contextmanager
def _engine_wrapped() -> Iterator[None]:
    """autograd's engine wrapped in a :class:`_Engine` while any caller needs it."""
    with _ENGINE_LOCK:
        _wrap_engine()
    try:
        yield
    finally:
        with _ENGINE_LOCK:
            _unwrap_engine()


def _wrap_engine() -> None:
    # Under _ENGINE_LOCK: one more user of the wrapper; the first installs it.
    if _ENGINE_USERS[0] == 0:
        torch.autograd.Variable._execution_engine = _Engine(  # type: ignore[attr-defined,assignment]
            torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        )
    _ENGINE_USERS[0] += 1


def _unwrap_engine() -> None:
    # Under _ENGINE_LOCK: one user fewer; the last puts autograd's engine back.
    _ENGINE_USERS[0] -= 1
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    if _ENGINE_USERS[0] == 0 and isinstance(engine, _Engine):
        torch.autograd.Variable._execution_engine = engine.engine  # type: ignore[attr-defined]


class _Engine:
    """Forwards everything to autograd's engine, except: callbacks queued from a
    deferring pass's nodes are held (:func:`deferred_callbacks`), and a backward
    run under :func:`backwards_spare` leaves the spared parameters out."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def queue_callback(self, callback: Callable[[], None]) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:
            # Innermost first: a W run from a hook of another W over the same
            # leaves (a later microbatch's) holds its own callbacks, which run
            # when it ends, as a backward's nested in a hook do. Another
            # thread's W over a tied weight holds none of this thread's, except
            # on a device thread, which runs the nodes of every thread's W.
            me = threading.get_ident()
            device_thread = on_device_thread()
            for thread, nodes, held in tuple(reversed(_DEFERRING)):
                if (thread == me or device_thread) and node in nodes:
                    held.append(callback)
                    return
        self.engine.queue_callback(callback)

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        spared = _SPARED.get()
        if spared is None:
            return self.engine.run_backward(*args, **kwargs)
        return self._run_spared(spared, *args, **kwargs)

    def _run_spared(
        self,
        spared: _Spared,
        tensors: Sequence[Any],
        grad_tensors: Sequence[Any],
        keep_graph: bool,
        create_graph: bool,
        inputs: Sequence[Any] = (),
        allow_unreachable: bool = False,  # the engine's own signature and defaults
        accumulate_grad: bool = False,
    ) -> Any:
        if accumulate_grad:
            kept = _unspared_inputs(tensors, inputs, spared.params)
            if kept is not None:
                if not kept:
                    return ()
                inputs = tuple(kept)
        elif spared.keep_graphs:
            keep_graph = True
        return self.engine.run_backward(
            tensors,
            grad_tensors,
            keep_graph,
            create_graph,
            inputs,
            allow_unreachable=allow_unreachable,
            accumulate_grad=accumulate_grad,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def on_device_thread() -> bool:
    """Whether this is one of autograd's device threads (made in C++, unknown to ``threading``),
    which run a GPU backward's nodes, and their hooks, for every Python thread's backward."""
    return isinstance(threading.current_thread(), threading._DummyThread)


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the engine call this runs in ends (autograd's own queue)."""
    from torch.autograd.variable import Variable

    Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def _is_spared(leaf: torch.Tensor | None, spared: frozenset[int]) -> bool:
    return leaf is not None and (id(leaf) in spared or isinstance(leaf, torch.nn.Parameter))


def _unspared_inputs(
    roots: Sequence[Any], inputs: Sequence[Any], spared: frozenset[int]
) -> list[Any] | None:
    """The inputs a backward from ``roots`` keeps once spared leaves are left out; None: all of them."""
    if inputs:
        kept = [
            i
            for i in inputs
            if not _is_spared(leaf_variable(i.node) if isinstance(i, GradientEdge) else i, spared)
        ]
        return None if len(kept) == len(inputs) else kept
    # No inputs: every leaf the graph reaches accumulates; find them.
    stack: list[Node | None] = [
        root.node if isinstance(root, GradientEdge) else get_gradient_edge(root).node
        for root in roots
        if isinstance(root, GradientEdge) or root.requires_grad
    ]
    seen: set[Node] = set()
    leaves: list[torch.Tensor] = []
    dropped = False
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = leaf_variable(node)
        if leaf is not None:
            if _is_spared(leaf, spared):
                dropped = True
            else:
                leaves.append(leaf)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves if dropped else None


def run_backward(
    roots: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
    wanted: Sequence[GradientEdge] = (),
) -> None:
    """One engine backward from ``roots`` with ``grads``, graph retained.

    Without ``wanted`` it accumulates into the leaves it reaches; with it, it
    runs only what leads to ``wanted`` and captures there, as ``autograd.grad``
    (the captures are dropped). The engine's own entry point, without
    ``autograd.backward``'s argument handling: W calls it once per delivered
    component, with exact gradients.
    """
    torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tuple(roots), tuple(grads), True, False, tuple(wanted), True, not wanted
    )


def captured_grads(
    roots: Sequence[torch.Tensor | GradientEdge],
    inputs: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)``.

    Where ``autograd.grad``'s Python argument handling would pass everything
    through unchanged (every root a tensor, not nested, its gradient a
    non-nested tensor of the same shape and complexness; no
    ``__torch_function__`` override on roots or inputs), the same engine
    entry it ends in is called directly: on a small stage that handling cost
    a tenth of B. Anything else goes through ``autograd.grad`` itself, with
    its overrides, checks and error messages.
    """
    direct = _ENGINE_RUN_BACKWARD is not None and len(inputs) > 0
    tensors: list[torch.Tensor] = []
    if direct:
        for root, grad in zip(roots, grads):
            if (
                not isinstance(root, torch.Tensor)
                or not isinstance(grad, torch.Tensor)
                or root.is_nested
                or grad.is_nested
                or root.shape != grad.shape
                or root.dtype.is_complex != grad.dtype.is_complex
            ):
                direct = False
                break
            tensors.append(root)
        tensors += [i for i in inputs if isinstance(i, torch.Tensor)]
    if not direct or torch.overrides.has_torch_function(tensors):
        return torch.autograd.grad(
            roots,  # type: ignore[arg-type]
            inputs,  # type: ignore[arg-type]
            grads,
            retain_graph=True,
            allow_unused=True,
        )
    # Looked up at each call, as autograd.grad does (a profiler may wrap it).
    return torch.autograd.graph._engine_run_backward(  # type: ignore[no-any-return]
        tuple(roots), tuple(grads), True, False, tuple(inputs), True, accumulate_grad=False
    )


def apply_function(cls: type[torch.autograd.Function], *args: Any) -> Any:
    """``cls.apply(*args)``, for a gradsafe Function that defines no ``setup_context``.

    Before 2.14 ``Function.apply`` is a Python wrapper that, with no functorch
    transform active, only unwraps dead functorch wrappers (tensors that
    escaped a finished transform) in ``args`` before the C ``apply``: a
    pytree walk that cost W's delivery helper more than the node itself
    (50 us over 24 parameters). Where no transform is active and ``args``
    (and the lists and tuples in them) hold no functorch-wrapped tensor, the
    C ``apply`` is called directly; otherwise, and on torches whose
    ``Function.apply`` is the C one already, ``cls.apply``.
    """
    if (
        _C_APPLY is None
        or torch.autograd.function._is_setup_context_defined(cls.setup_context)
        or torch._C._are_functorch_transforms_active()
        or _has_wrapped(args)
    ):
        return cls.apply(*args)
    return _C_APPLY.__get__(None, cls)(*args)


def _has_wrapped(args: Sequence[Any]) -> bool:
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for arg in args:
        for item in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(item, torch.Tensor):
                if wrapped(item):
                    return True
            elif item is not None and not callable(item):
                return True  # anything else: leave it to the wrapper
    return False


# The C apply where Function.apply is a Python wrapper around it (None where it is the C one).
_C_APPLY: Any = (
    torch._C._FunctionBase.__dict__.get("apply")
    if isinstance(torch.autograd.Function.__dict__.get("apply"), classmethod)
    else None
)


# None on a torch without it: then B always goes through autograd.grad.
_ENGINE_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)


#: What happened where a split backward cannot run a compiled block that donates, and the fixes.
DONATED_BUFFERS = (
    "a torch.compile'd block in this stage had its backward already compiled donating its "
    "saved buffers, so that backward can run only once, and a split backward keeps "
    "the graph from B for W. AOTAutograd compiles a block's backward on the first backward "
    "through its compiled code and donates when that backward frees the graph; instances of one "
    "module class compiled alike share that code (torchtitan's transformer blocks do). So the "
    "backward that did it ran earlier, through this block or another instance of its class, "
    "and freed the graph: a fused backward (a warm-up or evaluation step, a reference model "
    "built from the same class, a fused pipeline schedule's step or metadata inference) of code "
    "compiled before gradsafe.patch(), or a zero-bubble pipeline schedule's stage-metadata "
    "inference run without gradsafe.patch() (its first step, which backwards through every "
    "stage but the first before the first microbatch). A region compiled under the patch "
    "splits its backward, compiled without donation, and gradsafe's own inference under a "
    "zero-bubble schedule keeps the graph. Fix: apply gradsafe.patch() before the block's first "
    "compile (torch._dynamo.reset() to recompile one compiled before it) and run the zero-bubble "
    "schedule's first step under gradsafe.patch() before any fused backward through these "
    "blocks; or set torch._functorch.config.donated_buffer = False before compiling: then no "
    "backward donates, which costs memory only (no parameter gradient has changed)."
)

#: The same, where the donating backward was loaded from torch.compile's on-disk cache.
DONATED_BUFFERS_FROM_CACHE = (
    "a torch.compile'd block in this stage had its backward loaded from AOTAutograd's on-disk "
    "cache (under TORCHINDUCTOR_CACHE_DIR; by default a torchinductor_<user> directory in the "
    "temporary directory) as an earlier process compiled it, donating its saved buffers (that "
    "process's first backward through the block's compiled code freed the graph: a fused step, "
    "or a schedule's stage-metadata inference without gradsafe.patch()), so it can run only "
    "once, and a split backward keeps the graph from B for W. Set "
    "torch._functorch.config.donated_buffer = False before compiling, or run without that "
    "cache entry (TORCHINDUCTOR_AUTOGRAD_CACHE=0, or TORCHINDUCTOR_FX_GRAPH_CACHE=0, or delete "
    "the cache directory) so that the split runs the block's first backward (no parameter "
    "gradient has changed)."
)

#: The engine failures a split backward turns into errors naming their fix.
EngineError = Literal["donated_buffer", "multi_grad_hook_all", "reentrant_checkpoint"]


def engine_error(exc: RuntimeError) -> EngineError | None:
    """Which known engine failure ``exc`` is, read from its message (None: another one).

    ``"donated_buffer"``: a compiled block's backward ran a second time (or
    with the graph retained) after donating its saved buffers;
    ``"multi_grad_hook_all"``: a ``register_multi_grad_hook(mode="all")``
    hook ran under ``torch.autograd.grad`` with ``inputs``;
    ``"reentrant_checkpoint"``: a ``checkpoint(use_reentrant=True)`` region's
    backward refused to run under ``torch.autograd.grad``.
    """
    text = str(exc)
    if "donated_buffer" in text:
        return "donated_buffer"
    if "_will_engine_execute_node" in text:
        return "multi_grad_hook_all"
    if "use_reentrant=True" in text:
        return "reentrant_checkpoint"
    return None
