"""What ``gradsafe.status()`` reports: every patch's state and slots, read without side effects."""

from __future__ import annotations

import dataclasses
import sys
from typing import Literal

from gradsafe.patching._targets import MISSING, AttrTarget, Target

__all__ = ["PatchState", "Status", "TargetState", "observe", "peek"]


@dataclasses.dataclass(frozen=True)
class TargetState:
    """One slot of a patch, as found right now.

    ``state`` is ``"replaced"`` (gradsafe's object is there), ``"conflict"``
    (something else replaced gradsafe's object) or ``"planned"`` (the patch is
    not applied; this slot is what applying it would replace).
    """

    where: str
    state: Literal["replaced", "conflict", "planned"]
    current: object

    def __str__(self) -> str:
        if self.state == "conflict":
            return f"{self.where}: CONFLICT, now holds {self.current!r}"
        return f"{self.where}: {self.state}"


@dataclasses.dataclass(frozen=True)
class PatchState:
    """Where one patch stands.

    ``state`` is ``"active"`` (applied, ``refcount`` references held),
    ``"skipped"`` (does not apply to this torch: ``skipped`` says why),
    ``"idle"`` (planned, not applied: ``targets`` are what applying replaces) or
    ``"unplanned"`` (never applied or planned in this process, so not probed).
    ``testing`` marks a patch only :mod:`gradsafe.testing` applies (the CPU
    CUDA-graph emulator, ``cuda_graphs_emulation``): listed so that what it
    replaces and any conflict show, but not a name ``gradsafe.patch()`` takes.
    """

    name: str
    summary: str
    state: Literal["active", "skipped", "idle", "unplanned"]
    refcount: int
    targets: tuple[TargetState, ...]
    skipped: str | None
    conflicts: tuple[str, ...]
    testing: bool = False

    @property
    def active(self) -> bool:
        return self.state == "active"

    def __str__(self) -> str:
        head = {
            "active": f"active (refcount {self.refcount})",
            "skipped": f"skipped: {self.skipped}",
            "idle": "not applied",
            "unplanned": "not applied, not probed yet in this process",
        }[self.state]
        name = f"{self.name} (gradsafe.testing, not a patch() name)" if self.testing else self.name
        lines = [f"{name}: {head}"] + [f"    {t}" for t in self.targets]
        lines += [f"    conflict: {c}" for c in self.conflicts]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Status:
    """The report returned by ``gradsafe.status()``; ``str()`` renders it."""

    patches: tuple[PatchState, ...]

    def __getitem__(self, name: str) -> PatchState:
        for state in self.patches:
            if state.name == name:
                return state
        raise KeyError(name)

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.patches)


def observe(target: Target) -> TargetState:
    current = target.read()
    return TargetState(
        target.where, "replaced" if current is target.replacement else "conflict", current
    )


def peek(target: Target) -> object:
    """The slot's current object without importing anything (status() is passive)."""
    if isinstance(target, AttrTarget):
        if target.module not in sys.modules:
            return MISSING
        try:
            return target.read()
        except AttributeError:
            return MISSING
    return target.read()
