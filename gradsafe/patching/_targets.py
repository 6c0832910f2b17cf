"""Targets and plans: the slots a patch replaces, and what probing the installed torch decides."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Hashable, MutableMapping, Sequence
from typing import Final, Union

from typing_extensions import TypeAlias

__all__ = [
    "MISSING",
    "AttrTarget",
    "ItemTarget",
    "Patch",
    "Plan",
    "Skip",
    "Target",
    "owner_of",
    "slot_of",
]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


#: Stands for "the slot held nothing" (a mapping key that was absent).
MISSING: Final = _Missing()


def owner_of(module: str, attr: str) -> tuple[object, str]:
    """The object holding ``module.attr`` (``attr`` may be dotted: ``Class.method``) and the last name."""
    *path, name = attr.split(".")
    owner: object = importlib.import_module(module)
    for part in path:
        owner = getattr(owner, part)
    return owner, name


@dataclasses.dataclass(frozen=True)
class AttrTarget:
    """Attribute ``attr`` of the module ``module``, replaced by ``replacement``.

    ``attr`` may be dotted (``"PipelineStage._forward_metadata_inference"``):
    the last name is replaced on the object the others lead to, which must
    define it itself (a class attribute, not an inherited one).
    """

    module: str
    attr: str
    replacement: object

    @property
    def where(self) -> str:
        return f"{self.module}.{self.attr}"

    def read(self) -> object:
        owner, name = owner_of(self.module, self.attr)
        return getattr(owner, name)

    def write(self, value: object) -> None:
        owner, name = owner_of(self.module, self.attr)
        setattr(owner, name, value)


@dataclasses.dataclass(frozen=True)
class ItemTarget:
    """Key ``key`` of a mapping (e.g. a sharding-strategy table).

    ``mapping`` is called to find the live mapping; ``where`` names it for
    humans. An absent key is read as :data:`MISSING` and restored by deletion;
    a ``replacement`` of :data:`MISSING` removes the key while patched.
    """

    where: str
    mapping: Callable[[], MutableMapping[Hashable, object]]
    key: Hashable
    replacement: object

    def read(self) -> object:
        return self.mapping().get(self.key, MISSING)

    def write(self, value: object) -> None:
        table = self.mapping()
        if value is MISSING:
            table.pop(self.key, None)
        else:
            table[self.key] = value


Target: TypeAlias = Union[AttrTarget, ItemTarget]
"""One slot a patch replaces: an attribute of an object or an item of a table."""


@dataclasses.dataclass(frozen=True)
class Skip:
    """A patch does not apply to the installed torch, and why."""

    reason: str


Plan: TypeAlias = Union[Sequence[Target], Skip]
"""What a patch's planner returns for the installed torch: the slots to replace, or why none."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One capability's patch.

    ``plan`` probes the installed torch when the patch is first applied (or
    planned) and returns the slots to replace, or a :class:`Skip`.
    ``after_change`` runs after applying and after restoring (cache clearing).
    """

    name: str
    summary: str
    plan: Callable[[], Plan]
    after_change: Callable[[], None] = lambda: None


def slot_of(target: Target) -> tuple[str, Hashable]:
    """The slot a target writes, as a key: two targets with one key replace the same object."""
    return (target.where, target.key if isinstance(target, ItemTarget) else "")
