"""What a custom backward returns in a weight's gradient slot, and the flag that says where the gradient went.

Megatron-style data parallelism keeps an fp32 ``param.main_grad`` and hooks
each parameter's AccumulateGrad node: the hook adds ``param.grad`` into
``main_grad`` unless ``param.grad_added_to_main_grad`` is set, then clears
``param.grad``. A fused or delayed weight-gradient kernel must return, in the
weight slot, something that hook handles right. :func:`wgrad_return` is the one
answer for every such kernel.

The flag is per parameter, but one backward may carry several gradients into
the same ``.grad`` (a tied weight: a fused output head and an unfused
embedding). gradsafe keeps one invariant for it:

    ``grad_added_to_main_grad`` is True only while every gradient that
    ``.grad`` holds, or is about to receive, is already in ``main_grad``.

Three places keep it: :func:`wgrad_return` (fused, undelayed) sets it only if
``.grad`` is empty; a tensor hook on the parameter clears it when AccumulateGrad
receives anything but the dummy this backward returned (another use's real
gradient); the W pass (:mod:`gradsafe.wgrad._store`) sets or clears it by the
same rule. The hook then adds exactly the gradients that ``main_grad`` lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradsafe._shared.deprecation import removal_notice
from gradsafe.wgrad._torch import current_graph_task
from gradsafe.wgrad.markers import mark_hook_keeps_no_gradient

__all__ = ["dummy_wgrad", "wgrad_return"]

_FLAG = "grad_added_to_main_grad"
_F = TypeVar("_F", bound=Callable[..., object])


def dummy_wgrad(param: torch.Tensor) -> torch.Tensor:
    """A zero gradient with ``param``'s shape, dtype and device backed by one element of memory.

    It is a zero-stride view (``expand``) of a zero element allocated for this
    call alone, so nothing anyone does to it (a hook's ``fill_``, an
    ``autograd.grad`` caller's ``.data.fill_``) reaches another gradient.
    AccumulateGrad never keeps a zero-stride gradient as ``.grad`` while the
    layout contract is enforced (the default): with ``.grad`` None it copies it
    into a fresh ``param``-layout tensor (the transient ``param``-sized buffer
    any returned gradient costs; Megatron's hook frees it at once), otherwise
    it adds zeros in place. In-place arithmetic on the view itself
    (``mul_``, ``clamp_``, ``add_``) raises torch's "more than one element ...
    refers to a single memory location" error, as on any expanded tensor.
    """
    return torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)


@dataclasses.dataclass
class _FlagWatch:
    """Per flagged parameter: the one dummy the running backward carries into its AccumulateGrad."""

    task: int = -1  # autograd graph task that received ``dummy``
    dummy: torch.Tensor | None = None


_watches: WeakIdKeyDictionary = WeakIdKeyDictionary()
_watch_lock = threading.Lock()


def _on_incoming_grad(
    param_ref: weakref.ref[torch.Tensor], watch: _FlagWatch
) -> Callable[[torch.Tensor | None], None]:
    # Holds the parameter weakly: the hook is stored on the parameter itself.
    def hook(grad: torch.Tensor | None) -> None:
        dummy, watch.dummy = watch.dummy, None
        if grad is None or grad is dummy:
            return  # nothing arrives, or only the zero this backward's fused uses returned
        param = param_ref()
        if param is not None and hasattr(param, _FLAG):
            # A real gradient (another, unfused use) is on its way into .grad and
            # is not in main_grad: the hook must add .grad.
            setattr(param, _FLAG, False)

    mark_hook_keeps_no_gradient(hook)
    return hook


def watch_flag(param: torch.Tensor) -> _FlagWatch | None:
    """Start (once) clearing ``param``'s flag when a real gradient reaches its AccumulateGrad.

    Returns None where there is nothing to keep: no flag, or not a leaf autograd accumulates into.
    """
    if not (hasattr(param, _FLAG) and param.requires_grad and param.grad_fn is None):
        return None
    watch = _watches.get(param)
    if watch is None:
        with _watch_lock:  # two autograd device threads may meet the same parameter
            watch = _watches.get(param)
            if watch is None:
                watch = _FlagWatch()
                # Registered during a backward, it already runs in that backward.
                param.register_hook(_on_incoming_grad(weakref.ref(param), watch))
                _watches[param] = watch
    return watch


def flag_main_grad_written(param: torch.Tensor) -> None:
    """A use's gradient went straight into ``main_grad``: the flag may say so if ``.grad`` is empty."""
    if hasattr(param, _FLAG) and param.grad is None:
        setattr(param, _FLAG, True)


def flag_grad_written(param: torch.Tensor) -> None:
    """A gradient went into ``.grad`` outside autograd (the W pass): ``main_grad`` lacks it."""
    if hasattr(param, _FLAG):
        setattr(param, _FLAG, False)


def _renamed_keyword(old: str, new: str) -> Callable[[_F], _F]:
    """Accept ``old=`` as ``new=`` with a DeprecationWarning (CHANGELOG.md, deprecation policy)."""

    def wrap(func: _F) -> _F:
        @functools.wraps(func)
        def wrapper(*args: object, **kwargs: object) -> object:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{func.__name__}() got {old}= and {new}=; pass only {new}=")
                warnings.warn(
                    f"{func.__name__}({old}=) was renamed {new}= in gradsafe 0.2.0; "
                    + removal_notice(),
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return wrap


@_renamed_keyword("accumulated_into_main_grad", "accumulate_into_main_grad")
def wgrad_return(
    param: torch.Tensor,
    wgrad: torch.Tensor | None,
    *,
    accumulate_into_main_grad: bool,
    delayed: bool,
) -> torch.Tensor | None:
    """What to return in ``param``'s gradient slot of a custom ``backward``.

    Args:
        param: the weight whose gradient slot is being filled.
        wgrad: the weight gradient this backward computed and did not put
            anywhere else (only used in the plain, undelayed, unfused case;
            may be None otherwise).
        accumulate_into_main_grad: this backward (or, when ``delayed``, the
            later W pass) adds the weight gradient straight into
            ``param.main_grad``.
        delayed: the weight gradient is not computed now but by a later W
            pass (see :class:`gradsafe.wgrad.WeightGradStore`).

    Returns, by the one table for every kernel:

    ======= =================== ============================ ==========================
    delayed into ``main_grad``  has ``grad_added_to_main_grad`` return
    ======= =================== ============================ ==========================
    no      no                  –                            ``wgrad``
    yes     no                  –                            None
    no      yes                 no                           None
    no      yes                 yes                          a dummy (flag set)
    yes     yes                 no                           None
    yes     yes                 yes                          None (W does the rest)
    ======= =================== ============================ ==========================

    The dummy (:func:`dummy_wgrad`) is a zero gradient: AccumulateGrad and its
    hooks then run on the same thread as the rest of this device's backward
    and see a non-None ``.grad``, which the hook does not add again because
    ``grad_added_to_main_grad`` is True. Other uses of the same parameter in
    the same backward keep their gradient: a second fused use returns None
    (one dummy per backward is enough), and an unfused use's real gradient
    clears the flag as it reaches AccumulateGrad, so the hook adds ``.grad``.
    Never return a view of ``main_grad``: AccumulateGrad copies it into
    ``.grad`` and a hook adds it a second time.

    Example::

        >>> import torch
        >>> from gradsafe.wgrad import wgrad_return
        >>> weight, wgrad = torch.nn.Parameter(torch.ones(2)), torch.full((2,), 3.0)
        >>> wgrad_return(weight, wgrad, accumulate_into_main_grad=False, delayed=False) is wgrad
        True
        >>> print(wgrad_return(weight, None, accumulate_into_main_grad=False, delayed=True))
        None
        >>> weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(2), False
        >>> wgrad_return(weight, None, accumulate_into_main_grad=True, delayed=False)
        tensor([0., 0.])
        >>> weight.grad_added_to_main_grad
        True
    """
    # Over 60 lines only by its docstring (the one table and an example).
    if delayed:
        return None
    if not accumulate_into_main_grad:
        if wgrad is None:
            raise ValueError(
                "wgrad_return: wgrad is None but the weight gradient was neither delayed nor "
                "accumulated into main_grad; pass the computed weight gradient"
            )
        return wgrad
    if not hasattr(param, _FLAG):
        return None
    flag_main_grad_written(param)
    watch = watch_flag(param)
    if watch is None:  # not a leaf that autograd accumulates into: nothing else to track
        return dummy_wgrad(param)
    task = current_graph_task()
    if task != -1 and watch.task == task:
        return None  # this backward already carries a dummy into param's AccumulateGrad
    watch.task = task
    watch.dummy = dummy_wgrad(param)
    return watch.dummy
