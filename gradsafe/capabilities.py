"""The capability table: every patch and every hazard reproduction gradsafe has, in one place.

``patch()``, ``status()``, the doctor and the tests all read this table.
Each capability keeps its patch targets in ``gradsafe/<capability>/_patch.py``
(a ``plan()`` that probes the installed torch) and its hazard reproductions in
``gradsafe/<capability>/_hazards.py`` (the doctor's ``CHECKS``). Both are
imported only when used, so ``import gradsafe`` loads no capability code and
replaces nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Literal

from gradsafe.patching import REGISTRY, Patch, Plan

if TYPE_CHECKING:
    from gradsafe.checks import Check, Probe

__all__ = ["CAPABILITIES", "Capability", "CapabilityName", "PatchName"]

#: The names ``gradsafe.patch()`` accepts.
PatchName = Literal["pipelining", "dtensor", "cuda_graphs"]
#: The doctor's capabilities: the patches, and ``wgrad`` (a library kernels call; no patch).
CapabilityName = Literal["pipelining", "dtensor", "cuda_graphs", "wgrad"]


def no_probes() -> tuple[Probe, ...]:
    """A capability whose paths no behavioural probe chooses (beyond its patch's plan)."""
    return ()


@dataclasses.dataclass(frozen=True)
class Capability:
    """One capability: its patch (None for ``wgrad``), its doctor rows, and the behaviours
    of torch its paths are chosen by (``probes``; beyond those its patch's plan checks)."""

    name: CapabilityName
    patch: Patch | None
    hazards: Callable[[], tuple[Check, ...]]
    probes: Callable[[], tuple[Probe, ...]] = no_probes


# -- patches: each plan is the capability's own _patch.plan(), imported on first use --


def _pipelining_plan() -> Plan:
    from gradsafe.pipelining import _patch

    return _patch.plan()


def _dtensor_plan() -> Plan:
    from gradsafe.dtensor import _patch

    return _patch.plan()


def _dtensor_after_change() -> None:
    from gradsafe.dtensor import _patch

    _patch.after_change()


def _cuda_graphs_plan() -> Plan:
    from gradsafe.cuda_graphs import _patch

    return _patch.plan()


def _emulation_plan() -> Plan:
    from gradsafe.testing import _cuda_emulation

    return _cuda_emulation.plan()


PIPELINING: Final = Patch(
    "pipelining",
    "split backward (B/W) for zero-bubble schedules that equals a fused backward, "
    "with weight grads through AccumulateGrad (H1)",
    _pipelining_plan,
)
DTENSOR: Final = Patch(
    "dtensor",
    "DTensor new_empty/new_empty_strided keep the input's placements as on torch 2.13 "
    "(Partial where the installed torch can accumulate into it), so autograd's layout "
    "fix-up does not all-reduce a Partial gradient (H2)",
    _dtensor_plan,
    _dtensor_after_change,
)
CUDA_GRAPHS: Final = Patch(
    "cuda_graphs",
    "make_graphed_callables returns owned gradients instead of CUDA-graph static buffers (H3)",
    _cuda_graphs_plan,
)
#: Not one of patch()'s names: applied only by gradsafe.testing.emulate_cuda_graphs().
CUDA_GRAPHS_EMULATION: Final = Patch(
    "cuda_graphs_emulation",
    "CPU stand-ins for torch.cuda's graph, stream and pool API (gradsafe.testing)",
    _emulation_plan,
)

# The process's one registry (created in gradsafe.patching) gets every patch here,
# when `import gradsafe` imports this table.
REGISTRY.register(PIPELINING, DTENSOR, CUDA_GRAPHS)
REGISTRY.register(CUDA_GRAPHS_EMULATION, testing=True)


# -- hazard reproductions (the doctor's rows) ------------------------------------------


def _pipelining_hazards() -> tuple[Check, ...]:
    from gradsafe.pipelining._hazards import CHECKS

    return CHECKS


def _dtensor_hazards() -> tuple[Check, ...]:
    from gradsafe.dtensor._hazards import CHECKS

    return CHECKS


def _cuda_graphs_hazards() -> tuple[Check, ...]:
    from gradsafe.cuda_graphs import _capture_order_hazards, _hazards

    return _hazards.CHECKS + _capture_order_hazards.CHECKS


def _wgrad_hazards() -> tuple[Check, ...]:
    from gradsafe.wgrad._hazards import CHECKS

    return CHECKS


def _pipelining_probes() -> tuple[Probe, ...]:
    from gradsafe.pipelining._patch import PROBES

    return PROBES


def _wgrad_probes() -> tuple[Probe, ...]:
    from gradsafe.wgrad._hazards import PROBES

    return PROBES


#: In the order the doctor shows them.
CAPABILITIES: Final[tuple[Capability, ...]] = (
    Capability("pipelining", PIPELINING, _pipelining_hazards, _pipelining_probes),
    Capability("dtensor", DTENSOR, _dtensor_hazards),
    Capability("cuda_graphs", CUDA_GRAPHS, _cuda_graphs_hazards),
    Capability("wgrad", None, _wgrad_hazards, _wgrad_probes),
)
