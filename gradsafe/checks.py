"""What a hazard reproduction is: a :class:`Check` run against upstream and with gradsafe.

Each capability writes its reproductions once, in
``gradsafe/<capability>/_hazards.py``, as ``CHECKS``; the doctor, the tests
and the benchmarks run the same ones. This module sits below the
capabilities and above :mod:`gradsafe.patching` only: a check names the patch
it needs (``patch``), and running it applies that patch from the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gradsafe import patching

__all__ = ["Check", "Outcome", "Probe", "patched_check"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one run of a reproduction found.

    ``correct`` is True when the gradients (or behaviour) matched the
    reference, False when they did not, None when the run was not possible
    (e.g. gradsafe already active in this process).
    """

    correct: bool | None
    detail: str

    @property
    def label(self) -> str:
        verdict = {True: "right", False: "WRONG", None: "n/a"}[self.correct]
        return f"{verdict}: {self.detail}" if self.detail else verdict


@dataclasses.dataclass(frozen=True)
class Probe:
    """A behaviour of the installed torch a capability relies on, checked on tiny tensors.

    ``run`` returns None where torch behaves as relied on, else how it differs;
    ``fallback`` says what gradsafe does then (an exact other path, or a
    refusal). The doctor runs each and names the fallbacks in force.
    """

    name: str
    capability: str
    fallback: str
    run: Callable[[], str | None]


@dataclasses.dataclass(frozen=True)
class Check:
    """One hazard's reproduction, run against upstream and with gradsafe.

    ``upstream_source`` says what the upstream column ran: the installed torch
    (the default), or a model of another library's behaviour when that library
    is not what is being measured (e.g. TransformerEngine's wgrad policy).

    ``patch`` names the ``gradsafe.patch()`` the gradsafe run needs (None: the
    two runs differ on their own, as for the ``wgrad`` library). With a
    patch, :meth:`gradsafe` runs ``run_gradsafe`` inside it, and
    :meth:`upstream` reports n/a while the patch is active in this process.
    """

    hazard: str
    capability: str
    run_upstream: Callable[[], Outcome]
    run_gradsafe: Callable[[], Outcome]
    upstream_source: str = "installed torch"
    patch: str | None = None
    note: str = ""  # what a reader of the upstream figure should know (why it varies run to run)

    def upstream(self, registry: patching.PatchRegistry | None = None) -> Outcome:
        """The reproduction against upstream (``registry``: the process's one by default)."""
        registry = registry or patching.REGISTRY
        if self.patch is not None and registry.status()[self.patch].active:
            return Outcome(None, f"not measured: gradsafe.patch({self.patch!r}) is active here")
        return self.run_upstream()

    def gradsafe(self, registry: patching.PatchRegistry | None = None) -> Outcome:
        """The reproduction with gradsafe (inside ``registry.patch(self.patch)`` when it names one)."""
        registry = registry or patching.REGISTRY
        if self.patch is None:
            return self.run_gradsafe()
        with registry.patch(self.patch) as handle:
            applied = self.patch in handle.names
            outcome = self.run_gradsafe()
        if applied:
            return outcome
        # A skipped patch (e.g. upstream already right) must still be measured.
        reason = registry.status()[self.patch].skipped
        return Outcome(outcome.correct, f"{outcome.detail} (patch skipped: {reason})")


def patched_check(
    hazard: str, capability: str, patch_name: str, repro: Callable[[], Outcome], note: str = ""
) -> Check:
    """A check whose gradsafe run is ``repro`` under ``gradsafe.patch(patch_name)``."""
    return Check(hazard, capability, repro, repro, patch=patch_name, note=note)
