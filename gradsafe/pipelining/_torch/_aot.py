"""AOTAutograd internals the compiled-region split reads or wraps (:mod:`gradsafe.pipelining._compiled`).

- ``torch._functorch.aot_autograd.aot_stage2_compile``: where AOTAutograd
  partitions a region's joint graph and hands the backward graph to the
  backend's backward compiler (``bw_compiler``, called at once for dynamic
  shapes, else lazily on the region's first backward). Wrapped, it hands
  that compiler the split's two graphs instead.
- ``AOTState.flat_args``: which of the region's inputs are tensors (the
  region's autograd node has an edge per tensor input only).
- the ``TracingContext``'s ``fw_metadata`` while the backward compiles:
  ``static_input_indices`` (the parameters and buffers dynamo lifted) and
  ``bw_donated_idxs`` (saved buffers the backward may overwrite; cleared for a
  split, whose W reads saved tensors after B).
- ``should_use_local_autograd_cache`` / ``should_use_remote_autograd_cache``
  (looked up by name in ``torch._functorch.aot_autograd``): AOTAutograd's
  cache is off for regions compiled under the patch, so an entry written
  without the split never loads as split, and a split never lands in it.
- ``torch._C._current_autograd_node``: the region's node while its backward
  runs (the key of :func:`gradsafe.wgrad.split_wgrad_store`);
  ``torch._C._DisableAutocast``: W runs the weight graph as AOTAutograd runs
  a backward, without autocast.
- the forward class of a ``CompiledFunctionBackward`` node and its
  ``compiled_bw``: whether a region's backward is split.
- ``torch.distributed.pipelining.schedules._check_torch_compile_compatibility``:
  the zero-bubble schedules' refusal of stages holding ``OptimizedModule``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

__all__ = [
    "AOT_MODULE",
    "CACHE_SWITCHES",
    "COMPILE_CHECK",
    "STAGE2",
    "call_compiled",
    "compiled_backward_of",
    "compiled_split_unsupported",
    "draws_random",
    "writes_in_place",
    "current_node",
    "input_is_tensor",
    "is_compiled_region",
    "region_metadata",
    "without_autocast",
]

#: Where AOTAutograd looks up the names below at call time.
AOT_MODULE = "torch._functorch.aot_autograd"
STAGE2 = "aot_stage2_compile"
CACHE_SWITCHES = ("should_use_local_autograd_cache", "should_use_remote_autograd_cache")
#: The zero-bubble schedules' refusal of compiled stages (torch 2.12+).
COMPILE_CHECK = ("torch.distributed.pipelining.schedules", "_check_torch_compile_compatibility")


#: aot_stage2_compile's leading parameters, as the split's wrapper takes them.
STAGE2_PARAMETERS = ("aot_state", "aot_graph_capture", "partition_fn", "fw_compiler", "bw_compiler")
_SCHEMAS = "torch._functorch._aot_autograd.schemas"
_METADATA_FIELDS = ("static_input_indices", "bw_donated_idxs", "input_info")


def compiled_split_unsupported() -> str | None:
    """How the installed AOTAutograd differs from what the compiled-region split wraps and reads.

    Checked by name, signature and schema field (watching a region compile
    split would cost seconds of compilation wherever this runs). What is read
    only while a backward compiles falls back there on its own: a region whose
    forward metadata is missing compiles whole, and B warns once for it.
    """
    import dataclasses
    import importlib
    import inspect

    try:
        aot = importlib.import_module(AOT_MODULE)
        schemas = importlib.import_module(_SCHEMAS)
    except ImportError as exc:
        return f"AOTAutograd does not import: {exc}"
    missing = [name for name in (STAGE2, *CACHE_SWITCHES) if not callable(getattr(aot, name, None))]
    if missing:
        return f"{AOT_MODULE} has no {', '.join(missing)}"
    taken = tuple(inspect.signature(getattr(aot, STAGE2)).parameters)[: len(STAGE2_PARAMETERS)]
    if taken != STAGE2_PARAMETERS:
        return f"{AOT_MODULE}.{STAGE2} takes {taken}, not {STAGE2_PARAMETERS}"
    for cls, wanted in (
        (getattr(schemas, "ViewAndMutationMeta", None), _METADATA_FIELDS),
        (getattr(schemas, "AOTState", None), ("flat_args",)),
    ):
        fields = (
            {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        )
        if not set(wanted) <= fields:
            return f"{_SCHEMAS} has no {', '.join(sorted(set(wanted) - fields))} where read"
    return None


# Namespaces whose operators say by their tags whether they draw random numbers.
_TAGGED_NAMESPACES = frozenset({"aten", "prims"})


def draws_random(target: object) -> bool | None:
    """Whether a graph node's operator draws random numbers, by its tags; None where it cannot
    be told (not an ``OpOverload`` of aten or prims: a custom or higher-order op)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in _TAGGED_NAMESPACES:
        return None
    return torch.Tag.nondeterministic_seeded in target.tags


def writes_in_place(target: object) -> bool:
    """Whether a graph node's operator writes one of its arguments (``copy_``, ``add_``, ...)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(
        arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments
    )


def input_is_tensor(aot_state: Any) -> tuple[bool, ...] | None:
    """Per input of the region AOTAutograd is compiling, whether it is a tensor (None: unknown)."""
    flat_args = getattr(aot_state, "flat_args", None)
    if flat_args is None:
        return None
    return tuple(isinstance(a, torch.Tensor) for a in flat_args)


def region_metadata() -> tuple[frozenset[int], int] | None:
    """While a backward compiles: its region's parameter/buffer input indices and number of inputs.

    Clears the region's donated-buffer record: the split's graphs are
    compiled without donation (W reads saved tensors after B). None where
    the tracing context has no forward metadata.
    """
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    static = getattr(metadata, "static_input_indices", None)
    input_info = getattr(metadata, "input_info", None)
    if metadata is None or static is None or input_info is None:
        return None
    metadata.bw_donated_idxs = []
    return frozenset(static), len(input_info)


def current_node() -> Node | None:
    """The autograd node whose backward is running on this thread, if any."""
    return torch._C._current_autograd_node()


@contextlib.contextmanager
def without_autocast() -> Iterator[None]:
    with torch._C._DisableAutocast():
        yield


def call_compiled(fn: Callable[..., Any], args: list[Any]) -> Sequence[Any]:
    """Call a compiled graph as AOTAutograd does: boxed (it may clear ``args``) or unpacked."""
    if getattr(fn, "_boxed_call", False):
        return fn(args)  # type: ignore[no-any-return]
    return fn(*args)  # type: ignore[no-any-return]


def is_compiled_region(node: Node) -> bool:
    """Whether ``node`` is a ``torch.compile``'d region's backward node (AOTAutograd's)."""
    return type(node).__name__ == "CompiledFunctionBackward" and hasattr(type(node), "_forward_cls")


def compiled_backward_of(node: Node) -> object | None:
    """The compiled backward the region of ``node`` runs (None: not compiled yet)."""
    return getattr(getattr(type(node), "_forward_cls", None), "compiled_bw", None)
