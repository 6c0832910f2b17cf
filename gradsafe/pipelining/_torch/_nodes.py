"""Autograd nodes: their kinds, input metadata and saved tensors, and calling one directly.

Private torch read here: ``Node._input_metadata``; calling a built-in node
(``node(*grads)``); ``torch._C._FunctionBase`` and ``Node.name()`` (custom
Functions, ``CopySlices``); ``AccumulateGrad.variable``; ``Tensor._version``
and ``Tensor._is_view``; ``SavedTensor.unpack_hook`` and ``register_hooks`` through a node's
``_raw_saved_*``; AOTAutograd's ``bw_donated_idxs`` / ``compiled_bw``; and
the weight-only calls that crash a torch release (probed in a subprocess).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch.autograd.graph import Node
from torch.utils.checkpoint import CheckpointFunction

__all__ = [
    "first_modified",
    "call_node",
    "crashes_weight_only",
    "backward_from_cache",
    "donates_buffers",
    "freed_storages",
    "grad_target",
    "has_hooked_saved",
    "input_meta",
    "is_modified_in_place",
    "is_python_kind",
    "is_python_node",
    "is_reentrant_checkpoint",
    "is_view",
    "leaf_variable",
    "refusable_kind",
    "release_saved",
    "runs_whole",
    "saved_unusable",
    "saves_storage",
    "saved_names",
    "saves_itself",
    "version",
]


# The node class of a reentrant checkpoint region (read once: checked per weight node per B).
_REENTRANT_NODE: Any = getattr(CheckpointFunction, "_backward_cls", ())


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


def first_modified(seen: Iterable[tuple[weakref.ref[torch.Tensor], int]]) -> torch.Tensor | None:
    """The first tensor still alive whose version differs from the one recorded with it."""
    for ref, recorded in seen:
        tensor = ref()
        if tensor is not None and version(tensor) != recorded:
            return tensor
    return None


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view (those cannot be detached in place)."""
    return bool(tensor._is_view())


def leaf_variable(node: Node) -> torch.Tensor | None:
    """The leaf tensor an ``AccumulateGrad`` node accumulates into (None for other nodes)."""
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def has_hooked_saved(node: Node) -> bool:
    """Whether a built-in ``node`` saved a tensor through saved-tensor hooks (e.g. checkpointing)."""
    for name in saved_names(type(node)):
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
    return tuple(name for name in saved_names(kind) if name.startswith("_raw_saved_result"))


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
    names = saved_names(type(node))
    if not names:
        return None
    # A checkpointed node's saved tensors are read packed: unpacking one here,
    # outside the microbatch's checkpoint group, would recompute its region.
    hooked = has_hooked_saved(node)
    try:
        getattr(node, names[0] if hooked else names[0].replace("_raw_saved_", "_saved_", 1))
    except RuntimeError as exc:
        return "modified" if is_modified_in_place(exc) else "freed"
    return None


def freed_storages(leaves: Sequence[torch.Tensor]) -> set[int]:
    """Storage identities of the ``leaves`` whose storage was freed in place (resized to 0 bytes).

    FSDP2 frees an unsharded parameter that way when it reshards (and
    re-gathers into the same storage): a graph recorded while it was gathered
    still holds it.
    """
    freed: set[int] = set()
    for leaf in leaves:
        if leaf.layout is torch.strided and leaf.numel():
            try:
                storage = leaf.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):  # subclasses without one
                continue
            if storage.nbytes() == 0:
                freed.add(storage._cdata)
    return freed


def saves_storage(node: Node, storages: set[int]) -> bool:
    """Whether ``node`` saved a tensor whose storage is one of ``storages`` (a leaf, or a view of one).

    Unpacks the saved tensors where they come back without hooks. A node
    whose saved tensors come back through hooks (a checkpointed op W calls)
    is not unpacked (that would recompute its region outside the
    microbatch's group): it counts as saving one, so that W refuses rather
    than risk reading freed memory. A custom Function's node is read
    through ``saved_tensors``.
    """
    if has_hooked_saved(node):
        return bool(storages)
    if is_python_node(node):
        try:
            saved: Any = node.saved_tensors  # type: ignore[attr-defined]
        except RuntimeError:
            return False  # freed or modified: W's other checks say so
        tensors = list(saved)
    else:
        tensors = []
        for name in saved_names(type(node)):
            try:
                value = getattr(node, name.replace("_raw_saved_", "_saved_", 1))
            except RuntimeError:
                continue
            tensors += value if isinstance(value, (list, tuple)) else [value]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided:
            try:
                if tensor.untyped_storage()._cdata in storages:
                    return True
            except (RuntimeError, NotImplementedError, TypeError):  # subclasses without one
                continue
    return False


def is_modified_in_place(exc: BaseException) -> bool:
    """Whether ``exc`` is autograd's refusal to unpack a saved tensor changed in place since it was saved."""
    return isinstance(exc, RuntimeError) and "modified by an inplace operation" in str(exc)


@functools.cache
def saved_names(kind: type) -> tuple[str, ...]:
    """The ``_raw_saved_*`` attributes of built-in node class ``kind`` (its saved tensors, packed)."""
    # Each built-in node kind is its own class; dir() per node would cost more
    # than the rest of B's bookkeeping for it.
    return tuple(name for name in dir(kind) if name.startswith("_raw_saved_"))


_FREED_BY_B = (
    "Trying to backward through the graph a second time (or directly access saved tensors after "
    "they have already been freed). gradsafe's stage_backward_input freed this node's saved "
    "tensors after computing the input gradients, as a fused backward frees them: the split "
    "backward's W never needs them. Redo the forward for another backward."
)


def _dropped(tensor: torch.Tensor) -> None:
    return None  # the packed value: the saved tensor is let go


def _refuse_unpack(packed: None) -> torch.Tensor:
    raise RuntimeError(_FREED_BY_B)


def release_saved(nodes: Sequence[Node]) -> None:
    """Free the saved tensors of built-in ``nodes``, as the engine does without ``retain_graph``.

    Each saved tensor gets a pair of saved-tensor hooks whose pack drops it
    (``SavedTensor.register_hooks`` packs the tensor at once and lets go of
    its own reference); unpacking it later raises torch's "backward through
    the graph a second time" error. Custom Functions' nodes, and nodes whose
    tensors were saved through hooks already (checkpointing, offloading:
    those hooks decide what is held), are left alone.
    """
    for node in nodes:
        kind = type(node)
        names = saved_names(kind)
        if not names or is_python_kind(kind):
            continue
        items: list[Any] = []
        for name in names:  # one pass: each read makes a Python wrapper
            saved = getattr(node, name)
            if isinstance(saved, (list, tuple)):
                items.extend(saved)
            elif saved is not None:
                items.append(saved)
        if any(item.unpack_hook is not None for item in items):
            continue
        for item in items:
            try:
                item.register_hooks(_dropped, _refuse_unpack)
            except RuntimeError:  # an undefined (None) or already freed saved tensor
                continue


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
    if has_hooked_saved(node):
        return True  # its saved input is not unpacked here (a checkpoint would recompute)
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


def backward_from_cache(node: Node) -> bool:
    """Whether ``node``'s compiled backward was loaded from AOTAutograd's on-disk cache.

    On a cache hit AOTAutograd loads the backward as an earlier process
    compiled it (with that process's buffer donation) and records a
    ``CachedAutogradLazyBackwardCompileInfo``; a backward compiled in this
    process records an ``AutogradLazyBackwardCompileInfo``.
    """
    forward_cls = getattr(type(node), "_forward_cls", None)
    info = getattr(forward_cls, "_lazy_backward_info", None)
    return type(info).__name__ == "CachedAutogradLazyBackwardCompileInfo"


def refusable_kind(kind: type) -> bool:
    """Whether nodes of class ``kind`` may be a reentrant checkpoint or save their own output.

    B checks those (:func:`is_reentrant_checkpoint`, :func:`saves_itself`)
    node by node only for the kinds this admits: most kinds save no output.
    """
    return issubclass(kind, _REENTRANT_NODE) or bool(_saved_output_names(kind))


def is_reentrant_checkpoint(node: Node) -> bool:
    """Whether ``node`` is a reentrant ``torch.utils.checkpoint`` region's node (``use_reentrant=True``)."""
    return isinstance(node, _REENTRANT_NODE)
