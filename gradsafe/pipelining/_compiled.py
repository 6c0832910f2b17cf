"""A ``torch.compile``'d region's backward split into an input-gradient graph (B) and a weight-gradient graph (W).

AOTAutograd runs a compiled region's backward as one custom Function node
(``CompiledFunctionBackward``) that returns every gradient of the region from
one compiled graph, so a split backward used to run it whole in B. Under the
``pipelining`` patch, AOTAutograd's backward compiler receives, instead of
that graph, two graphs cut from it (:func:`partition`):

* **dI**: every node an input gradient depends on (and every side-effecting or
  random node), returning the input gradients and the *boundary*, the values
  computed here that the weight part reads;
* **dW**: the nodes only parameter gradients depend on (the weight GEMMs),
  reading saved tensors and the boundary.

Both are compiled by the backend's own backward compiler (aot_eager's,
inductor's, any ``aot_autograd`` backend's). The region's backward
(:class:`SplitCompiledBackward`) always runs dI; inside gradsafe's B (the
region's node sees a :func:`gradsafe.wgrad.split_wgrad_store`) it records dW,
run once, as the weight closures of the region's parameters and returns None
in their slots, so W runs dW and delivers the gradients through the
parameters' accumulators, as for any kernel that delays its weight part.
Anywhere else (a fused backward, torch's own split) it runs dW at once and
returns every gradient. Each node of the original graph is computed in
exactly one of the two, so B+W does a fused backward's work.

Where the split cannot apply the region's backward stays whole in B (exact)
and one warning per region says why: a region whose backward was compiled
without the patch (before it, or by a process whose AOTAutograd cache entry
it loaded), a parameter slot whose gradient does not go to a leaf's
accumulator. AOTAutograd's cache is off for regions compiled under the patch
(:mod:`gradsafe.pipelining._torch._aot`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.autograd.graph import Node

from gradsafe.pipelining import _torch
from gradsafe.wgrad.split import split_wgrad_store

__all__ = [
    "Partition",
    "SplitCompiledBackward",
    "announce_unsplit",
    "watching_unsplit",
    "no_autograd_cache",
    "partition",
    "splitting_stage2",
    "zero_bubble_compile_check",
]

_NO_GRADIENT = object()


@dataclasses.dataclass(frozen=True)
class Partition:
    """The two graphs cut from one backward graph, and how their values connect."""

    di: fx.GraphModule
    dw: fx.GraphModule
    #: Output slots (forward input indices) dW fills, in dW's output order.
    weight_slots: tuple[int, ...]
    #: Positions of the backward's arguments dW reads, in dW's placeholder order.
    kept_args: tuple[int, ...]
    #: Number of gradient outputs of dI (the rest of its outputs are the boundary).
    num_grads: int


def _ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _must_run_in_b(node: fx.Node) -> bool:
    """Side effects and random draws stay where the fused backward has them, in B's graph.

    An operator whose tags cannot say (a custom op, a higher-order op) may draw from the
    global generator untagged: in W it would draw later, shifting the next microbatch's
    dropout masks. So it runs in B; ``operator.getitem`` is pure.
    """
    if node.op != "call_function":
        return node.op not in ("placeholder", "get_attr", "output")
    if node.target is operator.getitem:
        return False
    return node.is_impure() or _torch.draws_random(node.target) is not False


# Why a region's backward was compiled whole (``partition``'s answer when it cannot cut).
NO_WEIGHT_GRADIENTS = "none of its outputs is a parameter's gradient"
WRITES_IN_PLACE = (
    "its backward writes a tensor in place, which a weight gradient might read after the write"
)
NO_WEIGHT_ONLY_WORK = (
    "its weight gradients come out of the kernels that compute its input gradients (a "
    "convolution's backward), or of operators that run in B (random draws, custom ops)"
)
NO_METADATA = "AOTAutograd gave no forward metadata for it"


def partition(gm: fx.GraphModule, weight_inputs: frozenset[int]) -> Partition | str:
    """Cut ``gm`` (a backward graph, one output per forward input) into dI and dW.

    ``weight_inputs``: the forward inputs whose gradients go to W. Where it
    cannot cut, why (one of the reasons above): the backward then runs whole in B.
    """
    if any(n.op == "call_function" and _torch.writes_in_place(n.target) for n in gm.graph.nodes):
        # A write in place may land (in dI) before a weight gradient reads the old value
        # (in dW): the whole backward runs in B, as compiled.
        return WRITES_IN_PLACE
    output = next(iter(reversed(gm.graph.nodes)))
    grads = list(output.args[0])
    weight_slots = tuple(
        i for i in sorted(weight_inputs) if i < len(grads) and isinstance(grads[i], fx.Node)
    )
    if not weight_slots:
        return NO_WEIGHT_GRADIENTS
    input_grads = [g for i, g in enumerate(grads) if i not in weight_slots]
    in_b = _ancestors(g for g in input_grads if isinstance(g, fx.Node))
    in_b |= _ancestors(n for n in gm.graph.nodes if _must_run_in_b(n) and n not in in_b)
    # B hands dW tensors, never a tuple: the items of a multi-output node B runs
    # (convolution_backward's weight and bias gradients) are taken in B.
    in_b |= {n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0] in in_b}
    in_w = [
        n
        for n in _ancestors(grads[i] for i in weight_slots)
        if n not in in_b and n.op == "call_function"
    ]
    if not in_w:
        return NO_WEIGHT_ONLY_WORK
    w_set = set(in_w)
    reads = {p for n in in_w for p in n.all_input_nodes if p not in w_set}
    reads |= {grads[i] for i in weight_slots if grads[i] not in w_set}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kept = [p for p in placeholders if p in reads]
    boundary = [n for n in gm.graph.nodes if n in reads and n.op not in ("placeholder", "get_attr")]
    b_nodes = [n for n in gm.graph.nodes if n in in_b or n.op == "placeholder"]
    di_outputs = [None if i in weight_slots else g for i, g in enumerate(grads)]
    di = _graph_of(gm, b_nodes, [*di_outputs, *boundary])
    # Constants (get_attr) are copied into dW rather than handed over.
    w_nodes = [n for n in gm.graph.nodes if n in w_set or (n.op == "get_attr" and n in reads)]
    dw = _weight_graph(gm, [*kept, *boundary], w_nodes, [grads[i] for i in weight_slots])
    return Partition(
        di=di,
        dw=dw,
        weight_slots=weight_slots,
        kept_args=tuple(placeholders.index(p) for p in kept),
        num_grads=len(grads),
    )


def _graph_of(
    gm: fx.GraphModule, nodes: Sequence[fx.Node], outputs: Sequence[Any]
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return fx.GraphModule(gm, graph)


def _weight_graph(
    gm: fx.GraphModule,
    inputs: Sequence[fx.Node],
    nodes: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    # Saved tensors first, then what B hands over: inductor takes the
    # placeholders without "tangents" in their name, first, as the static ones.
    for i, node in enumerate(inputs):
        saved = node.op == "placeholder" and "tangents" not in node.name
        placeholder = graph.placeholder(node.name if saved else f"tangents_gradsafe_{i}")
        placeholder.meta = dict(node.meta)
        env[node] = placeholder
    for node in nodes:
        if node.op == "get_attr" or node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph)


def _example(node: fx.Node) -> Any:
    return node.meta.get("val")


def _compile_split(
    compiler: Callable[..., Any], gm: fx.GraphModule, is_tensor: tuple[bool, ...] | None
) -> SplitCompiledBackward | str:
    """The region's backward compiled split, or why it is not (then it compiles whole)."""
    metadata = _torch.region_metadata()
    if metadata is None or is_tensor is None or len(is_tensor) != metadata[1]:
        return NO_METADATA
    weight_inputs = frozenset(i for i in metadata[0] if is_tensor[i])
    cut = partition(gm, weight_inputs)
    if isinstance(cut, str):
        return cut
    di = compiler(cut.di, [_example(n) for n in cut.di.graph.find_nodes(op="placeholder")])
    dw = compiler(cut.dw, [_example(n) for n in cut.dw.graph.find_nodes(op="placeholder")])
    return SplitCompiledBackward(di, dw, cut, is_tensor)


class _WeightRun:
    """dW of one backward call, run once by the first of its parameters' closures in W."""

    def __init__(self, dw: Callable[..., Any], args: list[Any]) -> None:
        self._dw = dw
        self._args: list[Any] | None = args
        self._grads: list[Any] | None = None
        self._lock = threading.Lock()

    def closure(self, k: int) -> Callable[[Any], torch.Tensor]:
        def compute(_: Any) -> torch.Tensor:
            with self._lock:
                if self._grads is None:
                    args, self._args = self._args, None
                    with _torch.without_autocast():
                        self._grads = list(_torch.call_compiled(self._dw, args or []))
                grad, self._grads[k] = self._grads[k], None
            return grad  # type: ignore[no-any-return]

        return compute


class SplitCompiledBackward:
    """A compiled region's backward: dI, then dW now (fused) or recorded for W (gradsafe's B)."""

    _boxed_call = True

    def __init__(
        self,
        di: Callable[..., Any],
        dw: Callable[..., Any],
        cut: Partition,
        is_tensor: tuple[bool, ...],
    ) -> None:
        self._di = di
        self._dw = dw
        # The indices only: the graphs (and the fake tensors in their metadata) are not kept.
        self._weight_slots, self._kept_args, self._num_grads = (
            cut.weight_slots,
            cut.kept_args,
            cut.num_grads,
        )
        # Edge index of each input: the node has edges for tensor inputs only.
        edge_of = [sum(is_tensor[:i]) for i in range(len(is_tensor))]
        self._edges = tuple(edge_of[i] for i in cut.weight_slots)
        self._num_edges = sum(is_tensor)
        self._warned = False

    # As AOTAutograd wraps a backward compiler's result: dynamo never traces it.
    @torch.compiler.disable
    def __call__(self, args: list[Any]) -> list[Any]:
        kept = [args[i] for i in self._kept_args]
        node = _torch.current_node()
        outputs = list(_torch.call_compiled(self._di, args))
        grads, boundary = outputs[: self._num_grads], outputs[self._num_grads :]
        del outputs
        w_args = [*kept, *boundary]
        del kept, boundary
        store = split_wgrad_store(node) if node is not None else None
        params = self._params(node) if store is not None and node is not None else None
        if store is None or params is None:
            for slot, grad in zip(self._weight_slots, _torch.call_compiled(self._dw, w_args)):
                grads[slot] = grad
            return grads
        run = _WeightRun(self._dw, w_args)
        reads = [a for a in w_args if isinstance(a, torch.Tensor)]
        for k, param in enumerate(params):
            store.record(param, run.closure(k), accumulate_into_main_grad=False, reads=reads)
        return grads

    def _params(self, node: Node) -> list[torch.Tensor] | None:
        """The leaves the weight slots' gradients go to, or None (then dW runs in B, announced)."""
        edges = node.next_functions
        params = []
        if len(edges) == self._num_edges:
            for e in self._edges:
                accumulator = edges[e][0]
                leaf = None if accumulator is None else _torch.leaf_variable(accumulator)
                if leaf is None:
                    break
                params.append(leaf)
            else:
                return params
        if not self._warned:
            self._warned = True
            _warn(
                "a torch.compile'd region's weight gradients go to an input that is not a leaf "
                "tensor (a parameter used through a view or a cast before the region), so W "
                "cannot deliver them: its whole backward runs in B (exact). Pass the parameter "
                "itself into the compiled region."
            )
        return None


def _warn(message: str) -> None:
    warnings.warn(f"gradsafe: {message}", RuntimeWarning, stacklevel=3)


def splitting_stage2(stage2: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap AOTAutograd's ``aot_stage2_compile``: the backend's backward compiler gets the split's graphs."""

    def aot_stage2_compile(
        aot_state: Any,
        aot_graph_capture: Any,
        partition_fn: Any,
        fw_compiler: Any,
        bw_compiler: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        is_tensor = _torch.input_is_tensor(aot_state)
        # As AOTAutograd does: aot_function(f, fw_compiler) compiles the backward with it too.
        backward_compiler = fw_compiler if bw_compiler is None else bw_compiler

        def split_bw_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
            split = _compile_split(backward_compiler, gm, is_tensor)
            if not isinstance(split, str):
                return split
            whole = backward_compiler(gm, example_inputs)
            with contextlib.suppress(TypeError):  # an object without weak references: generic words
                _declined[whole] = split
            return whole

        return stage2(
            aot_state,
            aot_graph_capture,
            partition_fn,
            fw_compiler,
            split_bw_compiler,
            *args,
            **kwargs,
        )

    return aot_stage2_compile


# Why each backward compiled under the patch was compiled whole, by the compiled object.
_declined: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

# The regions warned about, by their node class (one per compiled region): weak, so a class
# freed with its region cannot hide a later region's warning by a reused id.
_announced: weakref.WeakSet[type] = weakref.WeakSet()
_announced_lock = threading.Lock()


# Per thread (B runs on the thread that calls it), the sets of :func:`watching_unsplit` open there.
_watching = threading.local()


@contextlib.contextmanager
def watching_unsplit() -> Iterator[set[type]]:
    """Collect, in the set it yields, the node class of every compiled region whose backward a
    B on this thread runs whole while the block is open (each time, not once per process)."""
    seen: set[type] = set()
    open_sets: list[set[type]] = _watching.__dict__.setdefault("sets", [])
    open_sets.append(seen)
    try:
        yield seen
    finally:
        open_sets.remove(seen)


def announce_unsplit(nodes: Iterable[Node]) -> None:
    """Warn, once per region, for each compiled region among ``nodes`` whose backward ran whole in
    B although it computes parameters' gradients (W gets none of them), saying why."""
    for node in nodes:
        if not _torch.is_compiled_region(node):
            continue
        compiled = _torch.compiled_backward_of(node)
        if compiled is None or isinstance(compiled, SplitCompiledBackward):
            continue
        declined = _declined_reason(compiled)
        if declined == NO_WEIGHT_GRADIENTS:
            continue  # nothing of it belongs in W
        for seen in _watching.__dict__.get("sets", ()):
            seen.add(type(node))
        with _announced_lock:
            if type(node) in _announced:
                continue
            _announced.add(type(node))
        _warn(
            "a torch.compile'd region's backward was compiled without gradsafe's split, so B "
            "runs it whole and W gets none of its weight gradients (exact, but no zero-bubble "
            f"balance). {_why_whole(declined)}"
        )


def _declined_reason(compiled: object) -> str | None:
    try:
        return _declined.get(compiled)
    except TypeError:  # not weakly referable or not hashable: not one the split declined
        return None


def _why_whole(declined: str | None) -> str:
    if declined is not None:
        return f"The split declined it: {declined}."
    unsupported = _torch.compiled_split_unsupported()
    if unsupported:
        return (
            f"This torch's AOTAutograd is not what the split wraps ({unsupported}): "
            "`gradsafe doctor` lists it; compiled regions run whole in B here."
        )
    return (
        "Its forward was compiled before gradsafe.patch(), or loaded from AOTAutograd's cache "
        "as a process without the patch compiled it. Apply gradsafe.patch() before the "
        "region's first forward (torch._dynamo.reset() to recompile)."
    )


def no_autograd_cache() -> bool:
    """AOTAutograd's cache, off under the patch: its entries hold a backward whole or split."""
    return False


def zero_bubble_compile_check(check: Callable[..., Any]) -> Callable[..., Any]:
    """torch's refusal of compiled stages in zero-bubble schedules, lifted: gradsafe splits them."""

    def _check_torch_compile_compatibility(stages: Any, schedule_name: str) -> None:
        del stages, schedule_name  # the split applies to every AOTAutograd region; others announce

    return _check_torch_compile_compatibility
