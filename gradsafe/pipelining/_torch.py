"""Every use of torch internals by gradsafe's split backward, in one place.

Public autograd API (``Node.next_functions``, ``register_prehook``,
``GradientEdge``, ``Node.metadata``) is used everywhere; what is private or
undocumented lives here, so a torch release that changes it breaks one module
and :func:`missing_feature` reports it before the patch is applied:

- ``Node._input_metadata``: the shape/dtype/device each node input expects;
- calling a built-in node directly (``node(*grads)``): runs its backward
  formula without the engine, so no hooks run and nothing flows into other
  nodes;
- ``RemovableHandle.hooks_dict_ref``: a node's Python post hooks, all in one
  dict (whether a user registered any besides gradsafe's);
- the closures ``register_multi_grad_hook`` registers as tensor hooks (which
  tensors one registration spans);
- ``Variable._execution_engine.run_backward``: the engine's entry point,
  called directly for each component W delivers; and
  ``torch.autograd.graph._engine_run_backward``, what ``autograd.grad`` ends
  in, called by B directly where ``autograd.grad``'s argument handling would
  change nothing (:func:`captured_grads`);
- ``torch._C._FunctionBase``: tells custom-Function nodes from built-in ones;
  its C ``apply`` is what ``Function.apply``'s Python wrapper (before 2.14)
  ends in, called directly where the wrapper would change nothing
  (:func:`apply_function`, with ``torch._C._are_functorch_transforms_active``
  and ``torch._C._functorch.is_functorch_wrapped_tensor``);
  ``Node.name()`` tells C++ custom Functions (``CppNode<...>``) and ``CopySlices``;
- ``AccumulateGrad.variable``: the leaf a gradient accumulator writes to
  (``torch._C._functions.AccumulateGrad``: the accumulators' class);
- ``Tensor._is_view``: views cannot be detached in place;
- ``SavedTensor.unpack_hook`` (via a node's ``_raw_saved_*``): whether a
  built-in node's saved tensors come back through saved-tensor hooks
  (activation checkpointing), so calling it again would unpack them again;
  unpacking one (``_saved_*``) tells whether they were freed;
- ``Tensor._backward_hooks``: the dict a leaf's tensor hooks are read from at
  call time, replaced by an empty stand-in while a gradient is captured at
  that leaf;
- ``Tensor._version``: a parameter changed in place during stage metadata
  inference (refused: it cannot be undone); a gradient W reads changed in
  place between its arrival in B and W (refused before W changes anything);
- ``Tensor._post_accumulate_grad_hooks`` and ``nn.Module``'s backward-hook
  dicts (per module and the module-global ones): silenced while a stage's
  metadata inference runs;
- AOTAutograd's forward-class ``metadata.bw_donated_idxs`` and ``compiled_bw``:
  a compiled block whose backward was already compiled donating saved
  buffers (refused before B runs anything);
- the text of the engine's ``RuntimeError`` messages (torch raises no typed
  error for donated buffers or a mode-``"all"`` multi-grad hook):
  :func:`engine_error` reads it;
- ``torch.utils.checkpoint.GraphExecGroup``: makes B and W one checkpoint
  group, so a checkpointed region recomputes once across both;
- torch bugs a split's weight-only call of a built-in node reaches (GroupNorm's
  weight-only backward on a channels_last input segfaults on 2.13): probed once
  per process in a subprocess, where a crash cannot take the caller down;
- ``Variable._execution_engine.queue_callback`` and ``torch._C._current_autograd_node``:
  end-of-backward callbacks queued by hooks in W's weight-only pass are held
  for W's delivery pass, and ``Variable._execution_engine.run_backward``: a
  backward run inside stage metadata inference is kept off the parameters
  (the engine object is swapped for a forwarding proxy while either runs);
- FSDP2's per-module state (``FSDPParam.sharded_param`` and its unsharded
  parameter): which parameter autograd saw for the sharded one a caller passes;
- ``torch.distributed.pipelining._backward``, where torch's split functions
  live (the hazard reproductions call whichever is installed there), and the
  schedules' ``_Action`` (parsing an action's string form, for capture orders);
- for ``verify``: ``TorchDispatchMode`` (``torch.utils._python_dispatch``) and
  ``UntypedStorage._cdata`` (a storage's identity) to count live tensor memory
  on any device; ``nn.Module._apply`` to cast floating and complex tensors of
  a copy apart (``Module.to`` casts complex buffers to real); torch's device
  probes ``torch._utils._get_available_device_type`` / ``_get_device_module``,
  which torchtitan reads once at import to pick its device.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import importlib
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch._utils
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointFunction
from torch.utils.weak import WeakIdKeyDictionary

# The node class of a reentrant checkpoint region (read once: checked per weight node per B).
_REENTRANT_NODE: Any = getattr(CheckpointFunction, "_backward_cls", ())

__all__ = [
    "DONATED_BUFFERS",
    "TorchDispatchMode",
    "apply_to_tensors",
    "device_probes_answer",
    "storage_key",
    "storages_of",
    "EngineError",
    "apply_function",
    "call_node",
    "captured_grads",
    "crashes_weight_only",
    "backwards_spare",
    "deferred_callbacks",
    "queue_callback",
    "engine_error",
    "saves_itself",
    "donates_buffers",
    "has_other_post_hooks",
    "is_reentrant_checkpoint",
    "refusable_kind",
    "multi_grad_hook_cells",
    "multi_grad_hook_spans",
    "current_exec_group",
    "exec_group",
    "has_hooked_saved",
    "RngStates",
    "rng_states",
    "set_rng_states",
    "silenced_gradient_hooks",
    "silenced_tensor_hooks",
    "version",
    "fsdp_counterparts",
    "grad_target",
    "input_meta",
    "is_python_kind",
    "is_python_node",
    "is_view",
    "leaf_variable",
    "missing_feature",
    "run_backward",
    "runs_whole",
    "is_modified_in_place",
    "saved_unusable",
]


def is_python_node(node: Node) -> bool:
    """Whether ``node`` is a custom ``autograd.Function``'s node."""
    return isinstance(node, torch._C._FunctionBase)


def is_python_kind(kind: type) -> bool:
    """Whether nodes of class ``kind`` are custom ``autograd.Function`` nodes."""
    return issubclass(kind, torch._C._FunctionBase)


def runs_whole(node: Node) -> bool:
    """Whether ``node``'s backward is user code that computes all its gradients in one call.

    A custom ``autograd.Function`` in Python or C++ (a ``CppNode``), also when
    applied in place to a view (autograd wraps it in a ``CopySlices``): calling
    it again for its weight part would run that code, and its side effects,
    twice.
    """
    if is_python_node(node):
        return True
    kind = type(node)
    whole = _WHOLE_KINDS.get(kind)
    if whole is None:
        name = node.name()
        whole = (
            name.startswith("torch::autograd::CppNode<") or name == "torch::autograd::CopySlices"
        )
        if _named_by_kind(kind, name):
            _WHOLE_KINDS[kind] = whole
    return whole


# Per built-in node class, whether its nodes run whole / may crash a
# weight-only call: read once per class, not once per node of every B. Only
# for classes named as their nodes (each built-in kind's generated class, a
# process-lifetime object); a class shared by nodes of several names (C++
# custom Functions, nodes torch binds no class of their own) is asked node
# by node, and so are custom Functions' classes (made at run time).
_WHOLE_KINDS: dict[type, bool] = {}
_CRASH_KINDS: dict[type, bool] = {}


def _named_by_kind(kind: type, name: str) -> bool:
    return kind.__name__ == name


def input_meta(node: Node, input_nr: int) -> tuple[torch.Size, torch.dtype, torch.device]:
    """Shape, dtype and device of the gradient ``node`` expects at input ``input_nr``."""
    meta = node._input_metadata[input_nr]  # type: ignore[attr-defined]
    return torch.Size(meta.shape), meta.dtype, meta.device


def grad_target(node: Node, input_nr: int) -> tuple[torch.Size, torch.dtype | None]:
    """Shape and dtype the engine gives a gradient on its way into ``node``'s input ``input_nr``.

    The dtype is None where the engine keeps the gradient's own dtype: an
    ``AccumulateGrad`` whose leaf has ``grad_dtype`` None (FSDP2 sets that
    while gradients accumulate in a wider dtype than the parameter's, e.g. an
    fp32-computed RMSNorm weight gradient of a bf16 parameter). For a leaf,
    its ``grad_dtype`` is what the engine casts to, which the node's input
    metadata (always the parameter's dtype) does not show.
    """
    # Read once per edge of every W: no device, and the accumulator told by
    # its class (a getattr that misses costs more than the rest).
    meta = node._input_metadata[input_nr]  # type: ignore[attr-defined]
    shape = torch.Size(meta.shape)
    if type(node) is _ACCUMULATE_GRAD:
        leaf = node.variable  # type: ignore[attr-defined]
        if hasattr(leaf, "grad_dtype"):
            return shape, leaf.grad_dtype
    return shape, meta.dtype


# The class of every gradient accumulator node (AccumulateGrad, bound from C++).
_ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: in-place operations through autograd bump it."""
    return int(tensor._version)


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view (those cannot be detached in place)."""
    return bool(tensor._is_view())


def leaf_variable(node: Node) -> torch.Tensor | None:
    """The leaf tensor an ``AccumulateGrad`` node accumulates into (None for other nodes)."""
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def has_hooked_saved(node: Node) -> bool:
    """Whether a built-in ``node`` saved a tensor through saved-tensor hooks (e.g. checkpointing)."""
    for name in _saved_names(type(node)):
        saved = getattr(node, name)
        if isinstance(saved, (list, tuple)):
            if any(getattr(item, "unpack_hook", None) is not None for item in saved):
                return True
        elif getattr(saved, "unpack_hook", None) is not None:
            return True
    return False


def saves_itself(node: Node) -> bool:
    """Whether built-in ``node`` saved its own output through hooks that packed it as itself.

    Identity-like saved-tensor hooks (``save_on_cpu`` on a CPU tensor, ``lambda t: t``)
    keep the tensor in the saved variable; for a node's own output, whose
    ``grad_fn`` is the node, that is a reference cycle through C++ that only
    the engine freeing the saved tensors breaks. Read from the packed value
    (``SavedTensor.data``), without unpacking it.
    """
    for name in _saved_output_names(type(node)):
        saved = getattr(node, name)
        for item in saved if isinstance(saved, (list, tuple)) else (saved,):
            if getattr(item, "unpack_hook", None) is None:
                continue
            packed = item.data
            for value in packed if isinstance(packed, (list, tuple)) else (packed,):
                if isinstance(value, torch.Tensor) and value.grad_fn is node:
                    return True
    return False


@functools.cache
def _saved_output_names(kind: type) -> tuple[str, ...]:
    return tuple(name for name in _saved_names(kind) if name.startswith("_raw_saved_result"))


def saved_unusable(node: Node) -> Literal["freed", "modified"] | None:
    """Why a built-in ``node``'s saved tensors cannot be unpacked for W (None: they can, as far as one tells).

    ``"freed"``: a backward ran through it without retain_graph (the engine
    frees all of a node's saved tensors at once, so unpacking one tells).
    ``"modified"``: the one unpacked was changed in place since it was saved
    (another saved tensor changed in place shows only when W calls the node).
    A custom Function's node is not checked (it unpacks through user code).
    """
    if is_python_node(node):
        return None
    names = _saved_names(type(node))
    if not names:
        return None
    try:
        getattr(node, names[0].replace("_raw_saved_", "_saved_", 1))
    except RuntimeError as exc:
        return "modified" if is_modified_in_place(exc) else "freed"
    return None


def is_modified_in_place(exc: BaseException) -> bool:
    """Whether ``exc`` is autograd's refusal to unpack a saved tensor changed in place since it was saved."""
    return isinstance(exc, RuntimeError) and "modified by an inplace operation" in str(exc)


@functools.cache
def _saved_names(kind: type) -> tuple[str, ...]:
    # Each built-in node kind is its own class; dir() per node would cost more
    # than the rest of B's bookkeeping for it.
    return tuple(name for name in dir(kind) if name.startswith("_raw_saved_"))


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


@contextlib.contextmanager
def silenced_tensor_hooks(leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """Keep the leaves' tensor hooks from running while a gradient is captured at them.

    ``autograd.grad`` runs a captured input's tensor hooks; B's capture is not
    the leaf's gradient yet (W delivers it, and its hooks run then, once).
    The engine reads a leaf's hooks from the dict installed as its
    ``_backward_hooks`` (a snapshot of its values per call), so each leaf gets
    an empty stand-in for the duration: nothing runs at the capture, even a
    hook registered on the leaf meanwhile by another hook (``register_hook``
    writes into the stand-in, which holds it aside). Afterwards the leaf's own
    dict is back, with those hooks added, and the stand-in forwards their
    handles' ``remove()`` there. A hook removed meanwhile from the leaf's own
    dict stays removed.
    """
    installed: list[tuple[torch.Tensor, Any, _HeldHooks]] = []
    try:
        for leaf in leaves:
            stand_in = _HeldHooks()
            installed.append((leaf, leaf._backward_hooks, stand_in))
            leaf._backward_hooks = stand_in
        yield
    finally:
        for leaf, own, stand_in in installed:
            if stand_in.held:
                if own is None:
                    own = collections.OrderedDict()
                own.update(stand_in.held)
                stand_in.home = own
                _STAND_INS.setdefault(leaf, []).append(stand_in)  # their handles refer to it
            leaf._backward_hooks = own


class _HeldHooks(collections.OrderedDict):  # type: ignore[type-arg]
    """A leaf's stand-in hook dict during a capture; see :func:`silenced_tensor_hooks`.

    Its own storage (what the engine reads) stays empty; what ``register_hook``
    and ``RemovableHandle.remove`` do goes to ``held``, then to ``home`` (the
    leaf's own dict) once the capture is over.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self.home: dict[Any, Any] | None = None

    def _target(self) -> dict[Any, Any]:
        return self.held if self.home is None else self.home

    def __setitem__(self, key: Any, value: Any) -> None:
        self._target()[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self._target()

    def __delitem__(self, key: Any) -> None:
        del self._target()[key]


# Stand-ins that held hooks, per leaf: those hooks' handles refer to them weakly.
_STAND_INS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def silenced_gradient_hooks(
    params: Sequence[torch.Tensor], modules: Sequence[torch.nn.Module]
) -> contextlib.AbstractContextManager[None]:
    """Silence every gradient hook a user can register on ``params`` and ``modules`` (and globally).

    Tensor hooks and post-accumulate-grad hooks (``Tensor._backward_hooks``,
    ``Tensor._post_accumulate_grad_hooks``: read when called), and module
    backward hooks and pre-hooks, per module and global (``_backward_hooks``,
    ``_backward_pre_hooks``: read when a forward runs, so silenced across the
    forward whose backward would fire them).
    """
    from torch.nn.modules import module as module_py

    dicts: list[Any] = [module_py._global_backward_hooks, module_py._global_backward_pre_hooks]
    for param in params:
        dicts += [param._backward_hooks, getattr(param, "_post_accumulate_grad_hooks", None)]
    for root in modules:
        for sub in root.modules():
            dicts += [sub._backward_hooks, sub._backward_pre_hooks]
    return _silenced(dicts)


@contextlib.contextmanager
def _silenced(dicts: Iterable[dict[Any, Any] | None]) -> Iterator[None]:
    # Each hook is swapped for a no-op in place, so a hook removed meanwhile
    # (its key deleted) stays removed and one added meanwhile stays.
    saved: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
    seen: set[int] = set()
    for hooks in dicts:
        if hooks and id(hooks) not in seen:
            seen.add(id(hooks))
            saved.append((hooks, list(hooks.items())))
            for key in hooks:
                hooks[key] = _no_hook
    try:
        yield
    finally:
        for hooks, items in saved:
            for key, hook in items:
                if hooks.get(key) is _no_hook:
                    hooks[key] = hook


class deferred_callbacks:  # noqa: N801 - a context manager, used as `with deferred_callbacks(nodes) as held:`
    """Hold the end-of-backward callbacks that hooks of ``nodes`` queue, in the list ``with`` yields.

    ``queue_callback`` runs a callback when the current engine call ends. W's
    weight-only pass ends before its delivery pass gives the parameters their
    gradients, where a fused backward's callbacks run after: the caller queues
    the held callbacks from inside its delivery pass. A callback queued while
    any other node runs (another thread's backward) goes to the engine as usual.

    A class, not a generator-based context manager: W enters it once per call.
    """

    __slots__ = ("_entry",)

    def __init__(self, nodes: set[Node]) -> None:
        self._entry: tuple[set[Node], list[Callable[[], None]]] = (nodes, [])

    def __enter__(self) -> list[Callable[[], None]]:
        with _ENGINE_LOCK:
            _wrap_engine()
            _DEFERRING.append(self._entry)
        return self._entry[1]

    def __exit__(self, *exc: object) -> None:
        entry = self._entry
        with _ENGINE_LOCK:
            _DEFERRING[:] = [e for e in _DEFERRING if e is not entry]
            _unwrap_engine()


@contextlib.contextmanager
def backwards_spare(params: Sequence[torch.Tensor]) -> Iterator[None]:
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
    """
    token = _SPARED.set(frozenset(id(p) for p in params))
    try:
        with _engine_wrapped():
            yield
    finally:
        _SPARED.reset(token)


_SPARED: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar(
    "gradsafe_spared_parameters", default=None
)
_ENGINE_LOCK = threading.Lock()
_ENGINE_USERS = [0]
_DEFERRING: list[tuple[set[Node], list[Callable[[], None]]]] = []


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
            for nodes, held in tuple(_DEFERRING):
                if node in nodes:
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
        spared: frozenset[int],
        tensors: Sequence[Any],
        grad_tensors: Sequence[Any],
        keep_graph: bool,
        create_graph: bool,
        inputs: Sequence[Any] = (),
        allow_unreachable: bool = False,  # the engine's own signature and defaults
        accumulate_grad: bool = False,
    ) -> Any:
        if accumulate_grad:
            kept = _unspared_inputs(tensors, inputs, spared)
            if kept is not None:
                if not kept:
                    return ()
                inputs = tuple(kept)
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


@dataclasses.dataclass(frozen=True)
class RngStates:
    """The CPU generator's state, and every CUDA device's where CUDA is initialised."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None


def rng_states() -> RngStates:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
    return RngStates(torch.get_rng_state(), cuda)


def set_rng_states(states: RngStates) -> None:
    torch.set_rng_state(states.cpu)
    if states.cuda is not None:
        torch.cuda.set_rng_state_all(list(states.cuda))


def call_node(node: Node, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    """Run a built-in ``node``'s backward on ``grads`` without the engine: one entry per next edge."""
    result = node(*grads)  # type: ignore[operator]
    # A node with one next edge returns a bare tensor (or None).
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


# Built-in nodes whose weight-only backward (input gradient not requested)
# crashes some torch release on inputs laid out other than contiguously: the
# probe runs that backward on such an input. On 2.13 GroupNorm's segfaults for
# channels_last and channels_last_3d inputs (fixed by 2.15).
_CRASH_PROBES = {
    "NativeGroupNormBackward0": (
        "import torch\n"
        "gn = torch.nn.GroupNorm(2, 4)\n"
        "for shape, fmt in (((2, 4, 3, 3), torch.channels_last), ((2, 4, 3, 3, 3), torch.channels_last_3d)):\n"
        "    x = torch.randn(shape).to(memory_format=fmt)\n"
        "    torch.autograd.grad(gn(x), list(gn.parameters()), torch.randn(shape))\n"
    ),
}


def crashes_weight_only(node: Node) -> bool:
    """Whether calling built-in ``node`` for its weight gradients alone would crash this torch.

    Such a node must compute its input and weight gradients together (in B).
    Checked on the node's saved input (a non-contiguous 4-D/5-D layout, e.g.
    channels_last), then by running the probe for its kind in a subprocess,
    once per process. A probe that cannot run counts as a crash: computing
    the node whole is always exact.
    """
    kind = type(node)
    probed = _CRASH_KINDS.get(kind)
    if probed is None:
        name = node.name()
        probed = name in _CRASH_PROBES
        if _named_by_kind(kind, name) and not is_python_node(node):
            _CRASH_KINDS[kind] = probed
    if not probed:
        return False
    saved = getattr(node, "_saved_input", None)
    if not isinstance(saved, torch.Tensor) or saved.dim() not in (4, 5) or saved.is_contiguous():
        return False
    return _probe_crashes(node.name())


@functools.cache
def _probe_crashes(name: str) -> bool:
    try:
        result = subprocess.run(
            [sys.executable, "-c", _CRASH_PROBES[name]],
            capture_output=True,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return True
    return result.returncode != 0


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


def donates_buffers(node: Node) -> bool:
    """Whether ``node`` is a compiled block's backward that will refuse to run with the graph kept.

    AOTAutograd records the donated saved tensors in its forward class's
    metadata, but compiles the backward lazily, on its first run: a first run
    that keeps the graph (as B's and W's do) compiles it without donation and
    clears that record. So only a backward already compiled with donation
    (e.g. by an earlier fused backward), with
    ``torch._functorch.config.donated_buffer`` set, refuses a split.
    """
    if not is_python_node(node):
        return False
    forward_cls = getattr(type(node), "_forward_cls", None)
    metadata = getattr(forward_cls, "metadata", None)
    if not getattr(metadata, "bw_donated_idxs", None):
        return False
    if getattr(forward_cls, "compiled_bw", None) is None:
        return False  # not compiled yet: B's run compiles it without donation
    from torch._functorch import config  # importable: the node came from AOTAutograd

    return bool(getattr(config, "donated_buffer", False))


def _no_hook(*args: object) -> None:
    return None


def refusable_kind(kind: type) -> bool:
    """Whether nodes of class ``kind`` may be a reentrant checkpoint or save their own output.

    B checks those (:func:`is_reentrant_checkpoint`, :func:`saves_itself`)
    node by node only for the kinds this admits: most kinds save no output.
    """
    return issubclass(kind, _REENTRANT_NODE) or bool(_saved_output_names(kind))


def is_reentrant_checkpoint(node: Node) -> bool:
    """Whether ``node`` is a reentrant ``torch.utils.checkpoint`` region's node (``use_reentrant=True``)."""
    return isinstance(node, _REENTRANT_NODE)


@functools.cache
def _multi_grad_hook_codes() -> frozenset[types.CodeType]:
    # The code objects of the functions register_multi_grad_hook defines
    # (its hooks): constants of its own code. Mode "any" copies the user's
    # names onto its hook, so names cannot tell.
    codes: set[types.CodeType] = set()
    stack = [torch.autograd.graph.register_multi_grad_hook.__code__]
    while stack:
        for const in stack.pop().co_consts:
            if isinstance(const, types.CodeType):
                codes.add(const)
                stack.append(const)
    return frozenset(codes)


def has_other_post_hooks(handle: Any) -> bool:
    """Whether the node a hook was just registered on (``handle``) has other hooks of its kind.

    A node keeps all its Python post hooks (and all its pre-hooks) in one
    dict, which the handle of each of them refers to.
    """
    hooks = handle.hooks_dict_ref()
    return hooks is not None and len(hooks) > 1


def multi_grad_hook_cells(tensor: torch.Tensor) -> set[int]:
    """Identities of the ``register_multi_grad_hook`` registrations that include ``tensor``.

    One registration puts one hook per tensor (the same function in mode
    ``"any"``, closures over shared cells in mode ``"all"``); the cells they
    close over identify the registration.
    """
    hooks = tensor._backward_hooks
    if not hooks:
        return set()
    return {
        id(cell)
        for hook in hooks.values()
        if getattr(hook, "__code__", None) in _multi_grad_hook_codes()
        for cell in getattr(hook, "__closure__", None) or ()
    }


def multi_grad_hook_spans(tensors: Sequence[torch.Tensor]) -> dict[int, tuple[Node | None, ...]]:
    """Every ``register_multi_grad_hook`` registration on any of ``tensors``, with what it spans.

    Keyed by registration (the lock cell its hooks share); the value is the
    gradient-edge node of each tensor it spans (grad_fn, or the accumulator of
    a leaf), None for one that cannot be identified. Mode ``"all"`` keeps
    those nodes in its closure. Mode ``"any"`` keeps nothing: its one hook
    function sits in the hook dict of each tensor, so when more dicts hold it
    than ``tensors`` account for, the other holders are looked for through
    the garbage collector's referrers (costly: only then); a tensor autograd
    also holds (e.g. a leaf with a live gradient accumulator) is invisible to
    the collector, and counts as unidentified.
    """
    spans: dict[int, tuple[Node | None, ...]] = {}
    any_hooks: dict[int, Any] = {}
    for tensor in tensors:
        for hook in tuple(tensor._backward_hooks.values()) if tensor._backward_hooks else ():
            if getattr(hook, "__code__", None) not in _multi_grad_hook_codes():
                continue
            cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
            if "lock" not in cells:
                continue
            key = id(cells["lock"])
            if "grad_fns" in cells:  # mode "all"
                spans[key] = tuple(n for n in cells["grad_fns"].cell_contents if n is not None)
            else:
                any_hooks[key] = hook
    if not any_hooks:
        return spans
    del hook, cells  # count only the hook dicts' references
    holders = _count_holders(any_hooks)
    nodes = {id(t): get_gradient_edge(t).node for t in tensors if t.requires_grad}
    for key, hook in any_hooks.items():
        known = [t for t in tensors if t._backward_hooks and _holds(t._backward_hooks, hook)]
        if holders[key] == len(known):
            spans[key] = tuple(nodes[id(t)] for t in known)
        else:
            known_dicts = {id(t._backward_hooks): nodes[id(t)] for t in known}
            spans[key] = _holder_nodes(hook, any_hooks, known_dicts)
    return spans


def _holds(hooks: dict[Any, Any], hook: Any) -> bool:
    return any(h is hook for h in hooks.values())


def _count_holders(hooks: dict[int, Any]) -> dict[int, int]:
    """For each hook, how many references beyond ``hooks`` and this call's own hold it."""
    return {key: sys.getrefcount(hook) - _REF_OVERHEAD for key, hook in hooks.items()}


def _ref_overhead() -> int:
    _REF_OVERHEAD_PROBE[0] = object()  # held by that dict only, like a hook by one tensor's dict
    return _count_holders({0: _REF_OVERHEAD_PROBE[0]})[0] - 1


_REF_OVERHEAD = 0
_REF_OVERHEAD_PROBE: dict[int, object] = {}
_REF_OVERHEAD = _ref_overhead()
_REF_OVERHEAD_PROBE.clear()


def _holder_nodes(
    hook: Any, ignore: dict[int, Any], known: dict[int, Node]
) -> tuple[Node | None, ...]:
    """The node of each tensor whose hook dict holds ``hook`` (``known``: by dict id), None where unidentified."""
    import gc

    found: list[Node | None] = []
    for holder in gc.get_referrers(hook):
        if holder is ignore or not isinstance(holder, dict) or not _holds(holder, hook):
            continue
        if id(holder) in known:
            found.append(known[id(holder)])
            continue
        if "__builtins__" in holder:
            continue  # a module's globals, not a tensor's hook dict
        owners = [
            t
            for t in gc.get_referrers(holder)
            if isinstance(t, torch.Tensor) and t._backward_hooks is holder
        ]
        found.extend(get_gradient_edge(t).node if t.requires_grad else None for t in owners)
        if not owners:
            found.append(None)
    return tuple(found)


def fsdp_counterparts() -> dict[int, torch.Tensor]:
    """For every FSDP2-managed parameter: id(sharded) -> unsharded and id(unsharded) -> sharded.

    FSDP2 swaps a module's parameters between a sharded DTensor and an unsharded
    tensor; a graph recorded while one was installed holds it, while
    ``module.parameters()`` may yield the other by the time B or W runs.
    """
    try:
        from torch.distributed import _composable_state
    except ImportError:
        return {}
    pairs: dict[int, torch.Tensor] = {}
    for state_ref in list(_composable_state._module_state_mapping.values()):
        state = state_ref()
        # Newer FSDP2 keeps several parameter groups per module, older one.
        groups: Any = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [] if single is None else [single]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                sharded = getattr(fsdp_param, "sharded_param", None)
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if isinstance(sharded, torch.Tensor) and isinstance(unsharded, torch.Tensor):
                    pairs[id(sharded)] = unsharded
                    pairs[id(unsharded)] = sharded
    return pairs


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
        return _missing_hook_introspection(node, x, w) or _missing_sparing()
    return None


def _missing_sparing() -> str | None:
    """Whether :func:`backwards_spare` keeps a backward off a parameter and feeds the other leaf."""
    param = torch.nn.Parameter(torch.ones(2, device="cpu"))
    leaf = torch.ones(2, device="cpu", requires_grad=True)
    try:
        with backwards_spare([param]):
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


#: Why a split backward cannot run a compiled block that donates its saved buffers, and the fix.
DONATED_BUFFERS = (
    "a torch.compile'd block in this stage had its backward already compiled donating its "
    "saved buffers (by a first backward that did not keep the graph, e.g. a fused warm-up "
    "step), so it can run only once, and a split backward keeps the graph from B for W. Set "
    "torch._functorch.config.donated_buffer = False before compiling, or let the split run the "
    "block's first backward (no parameter gradient has changed)."
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


def split_backward_module() -> types.ModuleType:
    """``torch.distributed.pipelining._backward`` as it is now: torch's split functions, or gradsafe's when patched."""
    return importlib.import_module("torch.distributed.pipelining._backward")


def schedule_action(text: str) -> Any:
    """torch's pipeline-schedule action for its string form (e.g. ``"0F1"``), None for an empty one."""
    from torch.distributed.pipelining.schedules import _Action

    return _Action.from_str(text)


def tensor_hook_dicts(t: torch.Tensor) -> tuple[dict[Any, Any] | None, dict[Any, Any] | None]:
    """``t``'s tensor-hook dict (``register_hook``) and post-accumulate-grad hook dict, None where it has none."""
    return t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)


def module_backward_hook_dicts(module: torch.nn.Module) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``module``'s full-backward hook dict and backward pre-hook dict (the objects themselves)."""
    return module._backward_hooks, module._backward_pre_hooks


def storages_of(t: torch.Tensor) -> tuple[torch.UntypedStorage, ...]:
    """The storages ``t``'s data lives in: its own, or a sparse COO tensor's indices and values."""
    if t.is_sparse:  # uncoalesced too, which the public indices()/values() refuse
        return (t._indices().untyped_storage(), t._values().untyped_storage())
    return (t.untyped_storage(),)


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """An identity of a storage (``t``'s, shared by its views), valid while the storage lives."""
    storage = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    return storage._cdata


def apply_to_tensors(
    module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.nn.Module:
    """``fn`` applied to every parameter and buffer of ``module``, in place, as ``Module.to`` does."""
    return module._apply(fn)


@contextlib.contextmanager
def device_probes_answer(device_type: str, device_module: Any) -> Iterator[None]:
    """While inside, torch's accelerator probes report ``device_type`` and ``device_module``."""
    probes = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: device_type
    torch._utils._get_device_module = lambda device_type=None: device_module  # type: ignore[assignment]
    try:
        yield
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = probes
