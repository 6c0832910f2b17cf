"""Hook dicts: silencing a stage's gradient hooks, and reading what hooks are there.

Private torch read here: ``Tensor._backward_hooks`` and
``Tensor._post_accumulate_grad_hooks``, ``nn.Module``'s backward-hook dicts
(per module and global), ``RemovableHandle.hooks_dict_ref`` (a node's Python
post hooks). A leaf's hooks at B's capture: :mod:`._leaf_hooks`;
``register_multi_grad_hook``'s closures: :mod:`._multi_grad_hooks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "has_other_post_hooks",
    "module_backward_hook_dicts",
    "silenced_gradient_hooks",
    "tensor_hook_dicts",
]


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


def _no_hook(*args: object) -> None:
    return None


def has_other_post_hooks(handle: Any) -> bool:
    """Whether the node a hook was just registered on (``handle``) has other hooks of its kind.

    A node keeps all its Python post hooks (and all its pre-hooks) in one
    dict, which the handle of each of them refers to.
    """
    hooks = handle.hooks_dict_ref()
    return hooks is not None and len(hooks) > 1


def tensor_hook_dicts(t: torch.Tensor) -> tuple[dict[Any, Any] | None, dict[Any, Any] | None]:
    """``t``'s tensor-hook dict (``register_hook``) and post-accumulate-grad hook dict, None where it has none."""
    return t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)


def module_backward_hook_dicts(module: torch.nn.Module) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``module``'s full-backward hook dict and backward pre-hook dict (the objects themselves)."""
    return module._backward_hooks, module._backward_pre_hooks
