"""``make_graphed_callables`` whose backward never hands a CUDA-graph static buffer to autograd (hazard H3).

``torch.cuda.make_graphed_callables`` returns ``.detach()`` views of the
captured static gradient buffers from the graphed backward. When a
parameter's ``.grad`` is None, AccumulateGrad keeps that view as ``.grad`` and
the next replay overwrites it: two microbatches accumulate ``g2 + g2``
instead of ``g1 + g2``. :func:`make_graphed_callables` runs torch's own
implementation (warm-up, capture, options) and then makes the returned
gradients owned tensors wherever autograd or a user could keep them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Union, cast, overload

import torch
from typing_extensions import TypeAlias

from gradsafe.cuda_graphs._aliasing import refuse_shared_sample_args
from gradsafe.cuda_graphs._collector import no_collection_during_capture
from gradsafe.cuda_graphs._ownership import OWNERSHIP_POLICIES, Ownership, owning_graphed
from gradsafe.cuda_graphs._sample_history import without_sample_history
from gradsafe.cuda_graphs._structure import find_graphed_site, graphed_inputs
from gradsafe.patching import REGISTRY

__all__ = ["ModuleOrCallable", "make_graphed_callables"]


#: What torch graphs: a module or a plain callable (torch's own ``_ModuleOrCallable``).
ModuleOrCallable: TypeAlias = Union[torch.nn.Module, Callable[..., object]]


def _upstream() -> Callable[..., object]:
    upstream = REGISTRY.get_original("torch.cuda.graphs", "make_graphed_callables")
    return cast("Callable[..., object]", upstream)


@overload
def make_graphed_callables(
    callables: ModuleOrCallable,
    sample_args: tuple[torch.Tensor, ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: object = None,
    *newer: object,
    ownership: Ownership = "auto",
    **options: object,
) -> ModuleOrCallable: ...


@overload
def make_graphed_callables(
    callables: tuple[ModuleOrCallable, ...],
    sample_args: tuple[tuple[torch.Tensor, ...], ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: object = None,
    *newer: object,
    ownership: Ownership = "auto",
    **options: object,
) -> tuple[ModuleOrCallable, ...]: ...


def make_graphed_callables(
    callables: ModuleOrCallable | tuple[ModuleOrCallable, ...],
    sample_args: tuple[torch.Tensor, ...] | tuple[tuple[torch.Tensor, ...], ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: object = None,
    *newer: object,
    ownership: Ownership = "auto",
    **options: object,
) -> ModuleOrCallable | tuple[ModuleOrCallable, ...]:
    """Graph ``callables`` exactly as ``torch.cuda.make_graphed_callables`` does, with owned gradients.

    The parameters are torch's (the defaults of every supported torch), plus
    keyword-only ``ownership``. Arguments newer torch releases add
    (``capture_error_mode``, ``enable_annotations``) are passed through
    unchanged, positionally (``newer``) or by keyword (``options``); the returned
    callables behave as upstream's (modules fall back to the eager forward when
    their training flag differs from the graphed one), except for the
    gradients their backward returns.

    Args:
        ownership: which returned gradients are copied out of the static buffers.

            * ``"auto"`` (default): exactly those that would otherwise be kept
              past the next replay -- a leaf's (parameter's or input's)
              gradient when its ``.grad`` is None (AccumulateGrad would keep the
              buffer as ``.grad``), when the leaf has tensor hooks, or when
              ``torch.autograd.grad`` returns it; and a non-leaf input's
              gradient unless it comes from another gradsafe-graphed callable
              (which copies it at once) and has no tensor hooks. With
              ``.grad`` kept allocated across microbatches this costs at most
              one parameter-sized copy per parameter per optimizer step.
            * ``"always"``: copy every returned gradient.
            * ``"never"``: upstream's behaviour (static-buffer views, and no
              check of the call order below).

            A delayed-wgrad mark (:func:`gradsafe.wgrad.markers.mark_delayed_wgrad`,
            TransformerEngine's ``skip_backward_post_hook``) exempts nothing:
            a marked weight used inside the callable returns its real
            gradient here, so its slot follows the same rule.

    A returned callable holds one microbatch at a time (its static buffers
    hold its latest call). Unless ``ownership="never"``, each call bumps the
    autograd version of its outputs, so a tensor saved from an earlier call's
    output raises torch's in-place error at unpack, and a call's backward run
    after a later call, or after an in-place change to its outputs, to a
    parameter or to a sample tensor passed again as the argument (the graphs
    read those in place), raises ``RuntimeError`` (docs/cuda_graphs.md, "What
    is not owned"); ``torch.utils.checkpoint`` around the callable recomputes a
    call before its backward, which is exact.

    A sample tensor with autograd history (a non-leaf that requires grad, such
    as ``hs.clone()``) is captured as a leaf sharing its memory, in every
    mode: upstream captures it as it is given, so a sample derived from
    another sample or from a parameter has its gradient added into that
    tensor's too (docs/cuda_graphs.md).

    Raises:
        UnsupportedTorchError: the installed torch builds graphed callables in
            a shape gradsafe does not recognise (never silently unsafe).
        ValueError: ``ownership`` is not one of ``"auto"``, ``"always"``, ``"never"``;
            or two tensors of one callable's sample arguments (or one and a parameter of
            its module) share memory, e.g. ``sample_args=(h, h)``: upstream would give that
            tensor its gradient twice (refused before anything runs, in every mode; pass
            a separate sample tensor for each).

    Example (two microbatches accumulate: 3 + 6, where upstream's static
    buffer would give 6 + 6)::

        >>> import torch
        >>> from gradsafe.cuda_graphs import make_graphed_callables
        >>> from gradsafe.testing import emulate_cuda_graphs
        >>> with emulate_cuda_graphs():  # a CPU stand-in; on a GPU: CUDA module and tensors
        ...     layer = torch.nn.Linear(2, 2)
        ...     graphed = make_graphed_callables(layer, (torch.ones(3, 2),))
        ...     for microbatch in (1.0, 2.0):
        ...         graphed(torch.full((3, 2), microbatch)).sum().backward()
        >>> layer.weight.grad
        tensor([[9., 9.],
                [9., 9.]])
    """
    # Over 60 lines only by its docstring (the ownership policies and an
    # example); the code below is upstream's call and one probe-then-install pass.
    if ownership not in OWNERSHIP_POLICIES:
        raise ValueError(
            f"make_graphed_callables: ownership must be one of {OWNERSHIP_POLICIES}, got {ownership!r}"
        )
    upstream = _upstream()
    if upstream is make_graphed_callables:
        raise RuntimeError(
            "gradsafe.cuda_graphs.make_graphed_callables: torch.cuda.graphs.make_graphed_callables "
            "was set to gradsafe's function outside gradsafe.patch(); restore torch's function "
            "and use gradsafe.patch('cuda_graphs') instead."
        )
    # Before torch runs anything (its warm-up runs the callables), in every
    # ownership mode: upstream's gradient there is wrong, not just unowned.
    refuse_shared_sample_args(
        callables if isinstance(callables, tuple) else (callables,),
        cast(
            "tuple[tuple[object, ...], ...]",
            sample_args if isinstance(callables, tuple) else (sample_args,),
        ),
    )
    # Also in every mode: a sample's own history would add other slots' gradients
    # into its slot (_sample_history.py); a detached leaf sharing its memory does not.
    sample_args = without_sample_history(sample_args)
    with no_collection_during_capture():
        graphed = cast(
            "ModuleOrCallable | tuple[ModuleOrCallable, ...]",
            upstream(
                callables,
                sample_args,
                num_warmup_iters,
                allow_unused_input,
                pool,
                *newer,
                **options,
            ),
        )
    if ownership == "never":
        return graphed
    returned = graphed if isinstance(graphed, tuple) else (graphed,)
    sample_args_per_callable = cast(
        "tuple[tuple[torch.Tensor, ...], ...]",
        sample_args if isinstance(graphed, tuple) else (sample_args,),
    )
    # Probe every callable before changing any, so a failure leaves none half-made.
    sites = [
        find_graphed_site(c, graphed_inputs(c, a))
        for c, a in zip(returned, sample_args_per_callable)
    ]
    for site in sites:
        site.install(owning_graphed(site.graphed_cls, ownership, site.static_inputs))
    return graphed
