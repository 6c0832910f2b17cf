"""FLOPs of the operators ``torch.utils.flop_counter`` has formulas for, counted per phase.

One counter for verify's work shares, the balance measurement, and (as
:class:`gradsafe.testing.MatmulFlops`) tests, examples and benchmarks.
``FlopCounterMode`` is not usable around a split backward: it hooks every
module's forward with ``register_multi_grad_hook(mode="all")``, which no
``autograd.grad`` (a split's B) accepts, and the ops those hooks add abort a
checkpointed block's recomputation ("encountered during backward but not
found in storage"); this mode only counts.

Private torch read here: ``TorchDispatchMode`` (``torch.utils._python_dispatch``,
no public API for a dispatch mode).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["MatmulFlops"]


class MatmulFlops(TorchDispatchMode):
    """Counts the FLOPs of the ops ``torch.utils.flop_counter.flop_registry`` knows (matmuls,
    convolutions, attention) run while the mode is active, summed under :attr:`phase`.

    Like any dispatch mode it sees the operators run on the thread that entered
    it: a CPU backward's, not a CUDA backward's (autograd runs that on a device
    thread). With ``forwards=True`` it also sums, in :attr:`in_forward`, the
    FLOPs run while some module's forward runs, and per phase in
    :attr:`in_forward_counts`: inside a backward, that is checkpoint
    recomputation (it registers global module forward hooks while active, so
    only then).

    Example::

        counter = MatmulFlops()
        with counter:
            counter.phase = "B"
            (dx,), handoff = stage_backward_input(y, dy, [x], params)
            counter.phase = "W"
            stage_backward_weight(params, handoff)
        print(counter.counts["W"] / counter.total)
    """

    def __init__(self, *, forwards: bool = False) -> None:
        super().__init__()
        #: The key FLOPs are summed under in :attr:`counts`; set it between operators.
        self.phase: Hashable = None
        #: FLOPs per :attr:`phase`.
        self.counts: collections.Counter[Hashable] = collections.Counter()
        #: FLOPs run inside a module's forward (with ``forwards=True``; else 0).
        self.in_forward = 0
        #: :attr:`in_forward` per :attr:`phase`.
        self.in_forward_counts: collections.Counter[Hashable] = collections.Counter()
        self._forwards = forwards
        self._depth = 0
        self._hooks: list[Any] = []

    @property
    def total(self) -> int:
        """FLOPs counted in every phase."""
        return sum(self.counts.values())

    def __enter__(self) -> MatmulFlops:
        if self._forwards:
            self._hooks = [
                nn.modules.module.register_module_forward_pre_hook(self._enter_module),
                # always_call: an early-stopped recomputation leaves the forward by an exception.
                nn.modules.module.register_module_forward_hook(
                    self._leave_module, always_call=True
                ),
            ]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self._depth += 1

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.counts[self.phase] += flops
            if self._depth:
                self.in_forward += flops
                self.in_forward_counts[self.phase] += flops
        return out
