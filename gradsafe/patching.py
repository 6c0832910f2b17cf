"""Explicit, reversible, reference-counted monkeypatching of torch.

Every capability declares one :class:`Patch`: a name, and a ``plan`` that
probes the installed torch and returns either the :class:`Target` slots to
replace or a :class:`Skip` with the reason. :func:`patch` applies patches and
returns a :class:`PatchHandle` that is also a context manager; the last
reference released puts back exactly the object that was there before.

The design follows pytest's ``MonkeyPatch`` (an undo record per slot) and
gevent's ``monkey`` (``get_original``, ``is_object_patched``), with reference
counting so that nested users (a library and its caller) compose.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import warnings
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from types import TracebackType
from typing import Final, Hashable, Literal, Union

from typing_extensions import Self, TypeAlias

__all__ = [
    "AttrTarget",
    "ItemTarget",
    "MISSING",
    "Patch",
    "PatchConflictWarning",
    "PatchHandle",
    "PatchState",
    "Patcher",
    "Skip",
    "Status",
    "Target",
    "TargetState",
    "get_original",
    "is_object_patched",
    "patch",
    "patch_names",
    "status",
    "unpatch",
]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


#: Stands for "the slot held nothing" (a mapping key that was absent).
MISSING: Final = _Missing()


class PatchConflictWarning(UserWarning):
    """Something other than gradsafe replaced a slot gradsafe had patched."""


@dataclasses.dataclass(frozen=True)
class AttrTarget:
    """Attribute ``attr`` of the module ``module``, replaced by ``replacement``."""

    module: str
    attr: str
    replacement: object

    @property
    def where(self) -> str:
        return f"{self.module}.{self.attr}"

    def read(self) -> object:
        return getattr(importlib.import_module(self.module), self.attr)

    def write(self, value: object) -> None:
        setattr(importlib.import_module(self.module), self.attr, value)


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


@dataclasses.dataclass(frozen=True)
class Skip:
    """A patch does not apply to the installed torch, and why."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Patch:
    """One capability's patch.

    ``plan`` probes the installed torch (features, not version numbers) when
    the patch is applied and returns the slots to replace, or a :class:`Skip`.
    ``after_change`` runs after applying and after restoring (cache clearing).
    """

    name: str
    summary: str
    plan: Callable[[], Sequence[Target] | Skip]
    after_change: Callable[[], None] = lambda: None


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
    """Where one patch stands: active (with its slots), skipped, or idle."""

    name: str
    summary: str
    active: bool
    refcount: int
    targets: tuple[TargetState, ...]
    skipped: str | None
    conflicts: tuple[str, ...]

    def __str__(self) -> str:
        if self.active:
            head = f"{self.name}: active (refcount {self.refcount})"
        elif self.skipped is not None:
            head = f"{self.name}: skipped: {self.skipped}"
        else:
            head = f"{self.name}: not applied"
        lines = [head] + [f"    {t}" for t in self.targets]
        lines += [f"    conflict: {c}" for c in self.conflicts]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Status:
    """The report returned by :func:`status`; ``str()`` renders it."""

    patches: tuple[PatchState, ...]

    def __getitem__(self, name: str) -> PatchState:
        for state in self.patches:
            if state.name == name:
                return state
        raise KeyError(name)

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.patches)


@dataclasses.dataclass
class _Applied:
    target: Target
    original: object


class Patcher:
    """Reference-counted application of one :class:`Patch`.

    The first :meth:`acquire` applies the patch (all slots or none), the last
    :meth:`release` restores the exact originals. The registry keeps one per
    patch name; other reversible replacements (such as
    :func:`gradsafe.testing.emulate_cuda_graphs`) keep their own. Guarded by
    the module's one lock, so it is thread-safe.
    """

    def __init__(self, patch: Patch) -> None:
        self.patch = patch
        self.refcount = 0
        self.skipped: str | None = None
        self.conflicts: list[str] = []
        self._applied: list[_Applied] = []

    def acquire(self) -> bool:
        """Take a reference, applying the patch if it is the first; False if the patch was skipped."""
        with _LOCK:
            if self.refcount == 0:
                self._apply()
                if self.skipped is not None:
                    return False
            self.refcount += 1
            return True

    def release(self) -> None:
        """Give back a reference; the last one restores the originals."""
        with _LOCK:
            self.refcount -= 1
            if self.refcount == 0:
                self._restore()

    @property
    def applied(self) -> tuple[_Applied, ...]:
        return tuple(self._applied)

    def plan(self) -> Sequence[Target] | Skip:
        """The patch's plan, with slots the installed torch lacks turned into a skip."""
        try:
            plan = self.patch.plan()
        except (ImportError, AttributeError) as exc:
            return Skip(f"the installed torch lacks what this patch replaces ({exc})")
        if isinstance(plan, Skip):
            return plan
        for target in plan:
            try:
                target.read()
            except (ImportError, AttributeError) as exc:
                return Skip(f"the installed torch has no {target.where} ({exc})")
        return plan

    def _apply(self) -> None:
        plan = self.plan()
        if isinstance(plan, Skip):
            self.skipped = plan.reason
            return
        self.skipped = None
        self.conflicts.clear()
        done: list[_Applied] = []
        try:
            for target in plan:
                original = target.read()
                target.write(target.replacement)
                done.append(_Applied(target, original))
        except BaseException:
            for record in reversed(done):
                record.target.write(record.original)
            raise
        self._applied = done
        self.patch.after_change()

    def _restore(self) -> None:
        for record in reversed(self._applied):
            current = record.target.read()
            if current is record.target.replacement:
                record.target.write(record.original)
                continue
            message = (
                f"gradsafe patch {self.patch.name!r}: {record.target.where} was replaced by "
                f"{current!r} while gradsafe held it; leaving that in place instead of "
                f"restoring {record.original!r}. Unpatch gradsafe before patching that slot "
                f"yourself, or patch it after gradsafe is released."
            )
            self.conflicts.append(message)
            warnings.warn(message, PatchConflictWarning, stacklevel=5)
        self._applied = []
        self.patch.after_change()


# Each capability lists its patch in one module; imported on first use so
# that ``import gradsafe`` imports no capability code and patches nothing.
_CAPABILITY_MODULES: Final = {
    "pipelining": "gradsafe.pipelining._patch",
    "dtensor": "gradsafe.dtensor._patch",
    "cuda_graphs": "gradsafe.cuda_graphs._patch",
}

_LOCK = threading.RLock()
_ENTRIES: dict[str, Patcher] = {}


def patch_names() -> tuple[str, ...]:
    """The names :func:`patch` accepts."""
    return tuple(_CAPABILITY_MODULES)


def _entry(name: str) -> Patcher:
    if name not in _CAPABILITY_MODULES:
        raise ValueError(
            f"unknown gradsafe patch {name!r}; valid names: {', '.join(_CAPABILITY_MODULES)}"
        )
    entry = _ENTRIES.get(name)
    if entry is None:
        declared: Patch = importlib.import_module(_CAPABILITY_MODULES[name]).PATCH
        entry = _ENTRIES[name] = Patcher(declared)
    return entry


def _resolve(names: Sequence[str]) -> list[str]:
    chosen = list(names) if names else list(_CAPABILITY_MODULES)
    for name in chosen:
        _entry(name)  # validates every name before anything is applied
    return list(dict.fromkeys(chosen))


class PatchHandle:
    """References to patches taken by one :func:`patch` call.

    Applying happens in :func:`patch`; the handle only gives its references
    back, once each, via :meth:`release` or leaving a ``with`` block.
    """

    def __init__(self, held: list[str]) -> None:
        self._held = held

    @property
    def names(self) -> tuple[str, ...]:
        """The patches this handle still holds a reference to."""
        return tuple(self._held)

    def release(self, *names: str) -> None:
        """Give back this handle's reference to ``names`` (default: all)."""
        with _LOCK:
            for name in list(names or self._held):
                if name in self._held:
                    self._held.remove(name)
                    _ENTRIES[name].release()
            if not self._held and self in _HANDLES:
                _HANDLES.remove(self)

    def __enter__(self) -> Self:
        # The with block owns these references now: unpatch() must not take them.
        with _LOCK:
            if self in _HANDLES:
                _HANDLES.remove(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PatchHandle(names={self.names!r})"


# Handles from bare patch() calls (not entered as context managers), newest
# last, for unpatch() to release.
_HANDLES: list[PatchHandle] = []


def patch(*names: str) -> PatchHandle:
    """Apply the named patches now (none named: every patch) and return a handle.

    Each name takes one reference; a patch is installed by the first reference
    and removed when the last is released, so nesting and repeated calls are
    harmless. A patch that does not apply to the installed torch is skipped;
    :func:`status` says why. Use the handle as a context manager to restore on
    exit (also on an exception), or call :func:`unpatch` later.

    Raises:
        ValueError: a name is not one of :func:`patch_names`.
    """
    with _LOCK:
        held: list[str] = []
        try:
            for name in _resolve(names):
                if _ENTRIES[name].acquire():
                    held.append(name)
        except BaseException:
            PatchHandle(held).release()
            raise
        handle = PatchHandle(held)
        if held:
            _HANDLES.append(handle)
        return handle


def unpatch(*names: str) -> None:
    """Undo one earlier bare :func:`patch` call per name (none named: every name).

    The reference given back is the newest one a bare ``patch()`` call (one
    not used as a context manager) still holds for that name; a name no bare
    call holds is left alone. References held by ``with`` blocks are released
    only by leaving the block, so a patch stays installed while an enclosing
    ``with gradsafe.patch()`` is active.

    Raises:
        ValueError: a name is not one of :func:`patch_names`.
    """
    with _LOCK:
        for name in _resolve(names):
            for handle in reversed(_HANDLES):
                if name in handle.names:
                    handle.release(name)
                    break


def status() -> Status:
    """A structured, printable report of every patch: active slots, skips, conflicts."""
    with _LOCK:
        states = []
        for name in _resolve(()):
            entry = _ENTRIES[name]
            skipped = None
            if entry.applied:
                targets = tuple(_observe(r.target) for r in entry.applied)
            else:
                plan = entry.plan()
                if isinstance(plan, Skip):
                    skipped, targets = plan.reason, ()
                else:
                    targets = tuple(TargetState(t.where, "planned", t.read()) for t in plan)
            states.append(
                PatchState(
                    name=name,
                    summary=entry.patch.summary,
                    active=entry.refcount > 0,
                    refcount=entry.refcount,
                    targets=targets,
                    skipped=skipped,
                    conflicts=tuple(entry.conflicts),
                )
            )
        return Status(tuple(states))


def _observe(target: Target) -> TargetState:
    current = target.read()
    return TargetState(
        target.where, "replaced" if current is target.replacement else "conflict", current
    )


def _records() -> Iterator[_Applied]:
    for entry in _ENTRIES.values():
        yield from entry.applied


def get_original(module: str, attr: str) -> object:
    """The object gradsafe replaced at ``module.attr``, or the current one if unpatched.

    Capability code uses this to delegate to torch's own implementation even
    while its public name points at gradsafe's.
    """
    with _LOCK:
        for record in _records():
            target = record.target
            if isinstance(target, AttrTarget) and (target.module, target.attr) == (module, attr):
                return record.original
        return getattr(importlib.import_module(module), attr)


def is_object_patched(module: str, attr: str) -> bool:
    """Whether ``module.attr`` currently holds a gradsafe replacement."""
    with _LOCK:
        return any(
            isinstance(r.target, AttrTarget)
            and (r.target.module, r.target.attr) == (module, attr)
            and r.target.read() is r.target.replacement
            for r in _records()
        )
