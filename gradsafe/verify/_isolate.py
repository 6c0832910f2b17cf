"""Copies of the caller's stages, loss and hooks that reach none of the caller's tensors.

``copy.deepcopy`` copies a function as itself, so a hook or a ``loss_fn``
closing over the caller's parameters (a tensor hook adding into ``p.grad``,
an optimizer step in backward, a loss applying the last stage's head) would
act on the caller's tensors while verify runs the copies. Here the stages,
the loss and the parameters' hooks are copied in one memo, and every Python
function among them gets a copy of its own whose closure cells and default
arguments are copied in that memo too: a cell (or a ``p=p`` default) holding
the caller's head then holds the copy's.
What a copy still reaches of the caller's (a module-level global, an object
whose ``__deepcopy__`` returns itself) is refused by :func:`refuse_reaching_caller`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "caller_tensors",
    "copy_together",
    "loss_parameters",
    "python_rng_kept",
    "refuse_reaching_caller",
]

_DEPTH = 12
_MODULE_STATE = frozenset(
    {"_parameters", "_buffers", "_modules", "training"}
)  # how deep the reachability walk follows references (closures of closures, attributes)


def copy_together(
    modules: Sequence[nn.Module], loss_fn: Any, hooks: Iterable[Callable[..., Any]]
) -> tuple[list[nn.Module], Any, dict[int, Callable[..., Any]]]:
    """Deep copies of ``modules`` and ``loss_fn``, and of each hook (by the original's id), in one memo."""
    hooks = list(hooks)
    memo: dict[int, Any] = {}
    cells: list[tuple[types.CellType, types.CellType]] = []
    functions = [(fn, _fresh_function(fn, cells)) for fn in _functions((*modules, loss_fn, *hooks))]
    memo.update((id(fn), fresh) for fn, fresh in functions)
    copies, loss_copy, hook_copies = copy.deepcopy((list(modules), loss_fn, hooks), memo)
    # Filled after the copy, so that the stages' own copies are in the memo first. A cell
    # reaching no tensor (a list the hook logs to, a counter) stays the caller's own object.
    for old, new in cells:
        if _filled(old):
            new.cell_contents = _copied(old.cell_contents, memo)
    # Default arguments capture as cells do (``lambda g, p=p: ...``): copied the same way.
    for fn, fresh in functions:
        if fn.__defaults__:
            fresh.__defaults__ = tuple(_copied(d, memo) for d in fn.__defaults__)
        if fn.__kwdefaults__:
            fresh.__kwdefaults__ = {k: _copied(d, memo) for k, d in fn.__kwdefaults__.items()}
    return copies, loss_copy, {id(h): c for h, c in zip(hooks, hook_copies)}


def _copied(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` for a copied function: deep-copied in ``memo`` where it reaches a tensor."""
    return copy.deepcopy(value, memo) if _reaches_tensor(value) else value


def _fresh_function(fn: types.FunctionType, cells: list[Any]) -> types.FunctionType:
    fresh_cells = tuple(types.CellType() for _ in fn.__closure__ or ())
    cells += zip(fn.__closure__ or (), fresh_cells)
    fresh = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fresh_cells or None
    )
    fresh.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(fresh, fn, updated=())
    fresh.__dict__.update(fn.__dict__)
    return fresh


def _functions(roots: Iterable[Any]) -> list[types.FunctionType]:
    """The Python functions with a closure or default arguments reachable from ``roots`` (the
    ones a deep copy would share)."""
    found: dict[int, types.FunctionType] = {}
    for _, value in _walk(roots, follow_globals=False):
        if isinstance(value, types.FunctionType) and (
            value.__closure__ or value.__defaults__ or value.__kwdefaults__
        ):
            found[id(value)] = value
    return list(found.values())


def _reaches_tensor(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for _, v in _walk([value], follow_globals=False))


def caller_tensors(modules: Sequence[nn.Module]) -> dict[int, str]:
    """The caller's parameters, buffers and their gradients, by id, with the names a report uses."""
    prefixes = [f"{s}." if len(modules) > 1 else "" for s in range(len(modules))]
    named: dict[int, str] = {}
    for prefix, module in zip(prefixes, modules):
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            named.setdefault(id(t), prefix + name)
            for attr in ("grad", "main_grad"):
                extra = getattr(t, attr, None)
                if isinstance(extra, torch.Tensor):
                    named.setdefault(id(extra), f"{prefix}{name}.{attr}")
    return named


def refuse_reaching_caller(what: str, roots: Iterable[Any], caller: dict[int, str]) -> None:
    """Raise if ``roots`` (the copies' loss and hooks) reach one of the ``caller`` tensors."""
    for path, value in _walk(roots, follow_globals=True):
        if id(value) in caller:
            raise ValueError(
                f"verify cannot isolate {what}: {path} reaches your {caller[id(value)]}, which a "
                "copy cannot remap (a module-level global, or an object copied as itself), so "
                "running it would change your model. Pass it as an argument, a closure over the "
                "stages or an attribute of the loss object instead (those are copied with the stages)."
            )


def loss_parameters(loss_fn: Any, stage: nn.Module) -> dict[str, nn.Parameter]:
    """Leaf tensors requiring grad that the loss holds besides ``stage``'s (a learned temperature)."""
    own = {id(p) for p in stage.parameters()}
    found: dict[str, nn.Parameter] = {}
    for path, value in _walk([loss_fn], follow_globals=False, label="loss_fn"):
        if (
            isinstance(value, torch.Tensor)
            and value.is_leaf
            and value.requires_grad
            and id(value) not in own
        ):
            found.setdefault(path, value)  # type: ignore[arg-type]
    return found


def _walk(roots: Iterable[Any], follow_globals: bool, label: str = "") -> Iterator[tuple[str, Any]]:
    """(path, object) for what ``roots`` reach through closures, attributes, containers and modules."""
    seen: set[int] = set()
    stack = [(label or getattr(r, "__qualname__", type(r).__name__), r, 0) for r in roots]
    while stack:
        path, value, depth = stack.pop()
        if id(value) in seen or depth > _DEPTH or value is None:
            continue
        seen.add(id(value))
        yield path, value
        stack += [(f"{path}{step}", v, depth + 1) for step, v in _children(value, follow_globals)]


def _children(value: Any, follow_globals: bool) -> list[tuple[str, Any]]:
    if isinstance(value, (types.ModuleType, type, str, bytes, int, float, bool)):
        return []
    if isinstance(value, torch.Tensor):
        return [(f".{a}", getattr(value, a, None)) for a in ("grad", "main_grad")]
    if isinstance(value, types.FunctionType):
        kids = [
            (f" closure {name}", cell.cell_contents)
            for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ())
            if _filled(cell)
        ]
        kids += [(" default", d) for d in value.__defaults__ or ()]
        kids += [(f" default {k}", d) for k, d in (value.__kwdefaults__ or {}).items()]
        if follow_globals:
            kids += [
                (f" global {n}", value.__globals__[n])
                for n in _global_names(value.__code__)
                if n in value.__globals__
            ]
        return kids
    if isinstance(value, types.MethodType):
        return [(" self", value.__self__), ("", value.__func__)]
    if isinstance(value, functools.partial):
        return [(" func", value.func), *((" arg", a) for a in value.args)] + [
            (f" {k}=", v) for k, v in value.keywords.items()
        ]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, nn.Module):
        # Its tensors by name, and every other attribute of it and its submodules (hook
        # dicts, functions kept as attributes: a deep copy shares those functions).
        kids = [(f".{n}", t) for n, t in [*value.named_parameters(), *value.named_buffers()]]
        return kids + [
            (f".{name}{'.' if name else ''}{k}", v)
            for name, sub in value.named_modules()
            for k, v in vars(sub).items()
            if k not in _MODULE_STATE
        ]
    attrs = getattr(value, "__dict__", None)
    return [(f".{k}", v) for k, v in attrs.items()] if isinstance(attrs, dict) else []


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


@contextlib.contextmanager
def python_rng_kept() -> Iterator[None]:
    """Puts back Python's and (if loaded) NumPy's global RNG state on exit; torch's is
    put back per run (``torch.random.fork_rng``). Not per run: a model drawing from them
    must show up as not reproducible, not pass by being reseeded."""
    state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
