"""Counting, on ``verify``'s copies, every call of the hooks a backward runs.

A deep copy keeps a module's own hook dicts but not a parameter's tensor,
post-accumulate or AccumulateGrad-node hooks, so those are read from the
caller's parameters and registered, wrapped, on the copies. Hooks created
during a forward (tensor hooks, node hooks, module full-backward machinery,
custom Functions) are wrapped in the graph each forward builds. Every wrapper
counts its calls under a label that names the hook and where it sits, so two
runs (fused and split) compare label by label. Nothing of the caller's is
wrapped: its dicts are only read.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node, get_gradient_edge

from gradsafe.pipelining.inspection import (
    is_python_node,
    module_backward_hook_dicts,
    multi_grad_hook_codes,
    tensor_hook_dicts,
)

__all__ = ["HookCounter", "parameter_hooks"]

_COUNTED = "_gradsafe_verify_label"


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _node_hook_dicts(node: Node) -> tuple[dict[Any, Any] | None, dict[Any, Any] | None]:
    """A node's Python post-hook and pre-hook dicts (a node exposes them only through a handle)."""
    found: list[dict[Any, Any] | None] = []
    for register in (node.register_hook, node.register_prehook):
        handle = register(_no_hook)
        hooks = handle.hooks_dict_ref()
        handle.remove()
        found.append(hooks)
    return found[0], found[1]


def _no_hook(*args: object) -> None:
    return None


def _parameter_hook_dicts(param: torch.Tensor) -> list[dict[Any, Any] | None]:
    """A parameter's tensor, post-accumulate, AccumulateGrad post- and pre-hook dicts."""
    with torch.enable_grad():
        post, pre = _node_hook_dicts(get_gradient_edge(param).node)
    return [*tensor_hook_dicts(param), post, pre]


def parameter_hooks(modules: Sequence[nn.Module]) -> list[Callable[..., Any]]:
    """Every hook on the modules' parameters (a deep copy drops them: the copies get them anew)."""
    return [
        fn
        for module in modules
        for p in module.parameters()
        if p.requires_grad
        for hooks in _parameter_hook_dicts(p)
        for fn in (hooks or {}).values()
    ]


class HookCounter:
    """Calls per hook label for one run; ``in_backward`` marks forwards that are recomputations."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.in_backward = False
        self._keep: list[Node] = []  # the copies' AccumulateGrad nodes carrying wrapped hooks
        # Marks the graph nodes already instrumented, in the node's own metadata:
        # keeping them (or their ids) alive would keep every saved tensor of
        # the run alive too, which no schedule does (and skews verify's memory).
        self._seen = object()
        self.hooked: set[str] = set()  # parameters with hooks a W must run

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        if getattr(fn, _COUNTED, None) is not None:
            return fn

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[label] += 1
            return fn(*args, **kwargs)

        setattr(counted, _COUNTED, label)
        return counted

    def _wrap_dict(self, hooks: dict[Any, Any] | None, what: str) -> None:
        for key, fn in list((hooks or {}).items()):
            # register_multi_grad_hook's own functions are recognised by their
            # code (gradsafe refuses one spanning an input and a parameter): left as is.
            if getattr(fn, "__code__", None) not in multi_grad_hook_codes():
                hooks[key] = self.wrap(fn, f"{what} {_name(fn)}")  # type: ignore[index]

    def instrument_copies(
        self,
        named: Sequence[tuple[str, nn.Module, nn.Module]],
        copied: Mapping[int, Callable[..., Any]],
    ) -> None:
        """Give each copy the caller's parameter hooks, wrapped, and wrap the copies' module hooks.

        ``named``: (stage prefix, caller's stage, its copy); ``copied``: each parameter
        hook's copy by the original's id (closing over the copies, not the caller's tensors).
        """
        done: set[int] = set()  # a parameter shared by two stages gets its hooks once
        for prefix, original, copy in named:
            copies = dict(copy.named_parameters())
            for name, param in original.named_parameters():
                target = copies.get(name)
                if target is None or not param.requires_grad or id(target) in done:
                    continue
                done.add(id(target))
                where = f"{prefix}{name}"
                dicts = _parameter_hook_dicts(param)
                with torch.enable_grad():
                    node = get_gradient_edge(target).node
                registers = (
                    (target.register_hook, "tensor hook"),
                    (target.register_post_accumulate_grad_hook, "post-accumulate hook"),
                    (node.register_hook, "AccumulateGrad hook"),
                    (node.register_prehook, "AccumulateGrad pre-hook"),
                )
                for hooks, (register, kind) in zip(dicts, registers):
                    for fn in (hooks or {}).values():
                        if getattr(fn, "__code__", None) in multi_grad_hook_codes():
                            continue  # such a hook spans tensors of one forward, not this parameter
                        fn = copied.get(id(fn), fn)
                        register(self.wrap(fn, f"{kind} {_name(fn)} on {where}"))
                self._keep.append(node)
                if any(dicts):
                    self.hooked.add(where)
            self._instrument_modules(prefix, copy)

    def _instrument_modules(self, prefix: str, copy: nn.Module) -> None:
        for name, module in copy.named_modules():
            where = f"{prefix}{name}" or prefix.rstrip(".") or "module"
            backward_hooks, backward_pre_hooks = module_backward_hook_dicts(module)
            self._wrap_dict(backward_hooks, f"module backward hook on {where}:")
            self._wrap_dict(backward_pre_hooks, f"module backward pre-hook on {where}:")
            module.register_forward_pre_hook(functools.partial(self._forward_called, where))

    def _forward_called(self, where: str, module: nn.Module, args: Any) -> None:
        if self.in_backward:
            self.counts[f"forward of {where} recomputed in backward"] += 1

    @contextlib.contextmanager
    def forward_phase(self) -> Iterator[None]:
        """Wrap tensor hooks this thread registers while the copies run a forward."""
        with _REGISTER_HOOK_TAP.counting(self):
            yield

    def _tensor_hook(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(hook, "__code__", None) in multi_grad_hook_codes():
            return hook
        return self.wrap(hook, f"tensor hook {_name(hook)} (registered in forward)")

    def instrument_graph(self, roots: Sequence[Node], stop: set[Node]) -> None:
        """Wrap the node hooks and custom-Function backwards in the graph behind ``roots``."""
        stack = [n for n in roots if n is not None]
        while stack:
            node = stack.pop()
            if node in stop or self._seen in node.metadata:  # type: ignore[operator]
                continue
            node.metadata[self._seen] = True  # type: ignore[index]
            post, pre = _node_hook_dicts(node)
            self._wrap_dict(post, f"node hook on {node.name()}:")
            self._wrap_dict(pre, f"node pre-hook on {node.name()}:")
            if is_python_node(node) and getattr(node, _COUNTED, None) is None:
                kind = getattr(type(node), "_forward_cls", type(node))
                # The engine looks ``apply`` up on the node object: an instance attribute wraps it.
                node.apply = self.wrap(node.apply, f"custom Function {_name(kind)} backward")  # type: ignore[attr-defined]
                setattr(node, _COUNTED, True)
            stack.extend(kid for kid, _ in node.next_functions if kid is not None)


class _RegisterHookTap:
    """``torch.Tensor.register_hook``, replaced while some thread runs a verify forward.

    The replacement is process-wide (a tensor method), so it consults a
    thread-local counter: a thread that is not inside ``counting`` (a training
    loop beside the verify, a data loader) registers its hooks unchanged and
    uncounted. Nested and concurrent verifies share one replacement, installed
    by the first and removed by the last; if someone else replaced the method
    meanwhile, theirs is left in place (ours then only passes calls through).
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._users = 0
        self._original: Callable[..., Any] | None = None
        self._installed: Callable[..., Any] | None = None

    @contextlib.contextmanager
    def counting(self, counter: HookCounter) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        outer = getattr(self._local, "counter", None)
        self._local.counter = counter
        try:
            yield
        finally:
            self._local.counter = outer
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._uninstall()

    def _install(self) -> None:
        original = torch.Tensor.register_hook
        local = self._local

        def register_hook(tensor: torch.Tensor, hook: Callable[..., Any]) -> Any:
            counter = getattr(local, "counter", None)
            return original(tensor, hook if counter is None else counter._tensor_hook(hook))

        self._original, self._installed = original, register_hook
        torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]

    def _uninstall(self) -> None:
        if self._original is not None and torch.Tensor.register_hook is self._installed:
            torch.Tensor.register_hook = self._original  # type: ignore[method-assign]
        self._original = self._installed = None


_REGISTER_HOOK_TAP = _RegisterHookTap()
