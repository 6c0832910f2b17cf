"""Explicit, reversible, reference-counted monkeypatching of torch.

The pieces, smallest first:

* a :class:`Target` is one slot (a module attribute or a table entry) and the
  object gradsafe puts there;
* a :class:`Patch` is one capability's set of slots: its ``plan`` probes the
  installed torch (features, never version numbers) and returns the targets
  or a :class:`Skip` with the reason;
* a :class:`PatchRegistry` owns every patch's reference count and undo
  records, like pytest's ``MonkeyPatch`` owns its undo stack. The one registry
  of the process is ``gradsafe.REGISTRY``, built in :mod:`gradsafe.capabilities`;
  ``gradsafe.patch()``, ``unpatch()``, ``status()``, ``get_original()`` and
  ``is_object_patched()`` are its methods.

A plan is computed once per process (it depends only on the installed torch)
and always under plain tensor semantics: grad mode on, no inference mode, CPU
as default device, whatever the caller's context.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Final, Literal, Union

from typing_extensions import Self, TypeAlias

__all__ = [
    "AttrTarget",
    "ItemTarget",
    "MISSING",
    "Patch",
    "PatchConflictWarning",
    "PatchHandle",
    "PatchRegistry",
    "PatchState",
    "Plan",
    "Skip",
    "Status",
    "Target",
    "TargetState",
]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


#: Stands for "the slot held nothing" (a mapping key that was absent).
MISSING: Final = _Missing()


class PatchConflictWarning(UserWarning):
    """Something other than gradsafe replaced a slot gradsafe had patched."""


def _owner(module: str, attr: str) -> tuple[object, str]:
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
        owner, name = _owner(self.module, self.attr)
        return getattr(owner, name)

    def write(self, value: object) -> None:
        owner, name = _owner(self.module, self.attr)
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


@dataclasses.dataclass(frozen=True)
class Skip:
    """A patch does not apply to the installed torch, and why."""

    reason: str


Plan: TypeAlias = Union[Sequence[Target], Skip]


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
    """

    name: str
    summary: str
    state: Literal["active", "skipped", "idle", "unplanned"]
    refcount: int
    targets: tuple[TargetState, ...]
    skipped: str | None
    conflicts: tuple[str, ...]

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
        lines = [f"{self.name}: {head}"] + [f"    {t}" for t in self.targets]
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


@contextmanager
def _plain_torch_context() -> Iterator[None]:
    """Probe as in a fresh process: grad mode on, no inference mode, CPU default device.

    The caller's dispatch modes (FakeTensorMode while tracing, FLOP or memory
    counters) are set aside too: they must neither change the decision nor
    see the probes.
    """
    import torch  # not at module import: `import gradsafe` leaves importing torch to its caller
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
        with torch.device("cpu"):
            yield


def _slot(target: Target) -> tuple[str, Hashable]:
    return (target.where, target.key if isinstance(target, ItemTarget) else "")


@dataclasses.dataclass
class _Applied:
    target: Target
    original: object


class _Entry:
    """One patch's cached plan, reference count and undo records (guarded by the registry's lock)."""

    def __init__(self, patch: Patch) -> None:
        self.patch = patch
        self.refcount = 0
        self.plan: Plan | None = None
        self.applied: list[_Applied] = []
        self.conflicts: list[str] = []


class PatchHandle:
    """The references one :meth:`PatchRegistry.patch` call took, and a reusable context manager.

    ``patch()`` applies at once and the handle holds those references until
    :meth:`release` (or ``unpatch()`` from the thread that called ``patch()``).
    Entering the handle in a ``with`` block makes the block own them: leaving
    the block releases them, also on an exception, and nothing else can. A
    handle entered again (``ctx = gradsafe.patch()`` then ``with ctx:`` in a
    loop, or nested) takes fresh references for that block, so every block
    runs patched.
    """

    def __init__(self, registry: PatchRegistry, requested: tuple[str, ...], held: tuple[str, ...]):
        self._registry = registry
        self._requested = requested
        self._bare = held
        self._blocks: list[tuple[str, ...]] = []
        self._thread = threading.get_ident()

    @property
    def names(self) -> tuple[str, ...]:
        """The patches this handle holds a reference to right now (skipped ones never)."""
        held = [*self._bare, *(name for block in self._blocks for name in block)]
        return tuple(dict.fromkeys(held))

    def release(self, *names: str) -> None:
        """Give back the references ``patch()`` took for ``names`` (default: all); idempotent.

        References owned by a ``with`` block are released by leaving the block.

        Raises:
            ValueError: a name is not one of the registry's patch names.
        """
        with self._registry._lock:
            chosen = set(self._registry._validate(names) if names else self._bare)
            releasing = tuple(n for n in self._bare if n in chosen)
            self._bare = tuple(n for n in self._bare if n not in chosen)
            self._registry._forget_if_done(self)
            self._registry._release_all(releasing)

    def __enter__(self) -> Self:
        with self._registry._lock:
            # The block owns the bare references and fresh ones for every
            # requested name they lack (all of them once released, or those
            # released one by one), so every block runs fully patched.
            missing = tuple(n for n in self._requested if n not in self._bare)
            block = self._bare + self._registry._acquire_all(missing)
            self._bare = ()
            self._registry._forget_if_done(self)
            self._blocks.append(block)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._registry._lock:
            self._registry._release_all(self._blocks.pop())

    def __repr__(self) -> str:
        return f"PatchHandle(names={self.names!r})"


class PatchRegistry:
    """Every patch of one process: plans, reference counts, exact-object undo.

    ``patches`` are the names :meth:`patch` accepts; ``testing`` patches (the
    CUDA-graph emulation) are applied only through :meth:`hold`, but share the
    bookkeeping, so :meth:`get_original` and :meth:`is_object_patched` see
    them too. One re-entrant lock guards everything: threads may patch and
    release concurrently.
    """

    def __init__(self, patches: Sequence[Patch], *, testing: Sequence[Patch] = ()) -> None:
        self._lock = threading.RLock()
        self._public = tuple(p.name for p in patches)
        self._entries = {p.name: _Entry(p) for p in (*patches, *testing)}
        # The last object found in each slot that was not gradsafe's, keyed by
        # slot, with gradsafe's replacement: lets a slot left holding
        # gradsafe's object (a foreign patch undone out of order) still reach
        # torch's function, and be restored by the next patch cycle.
        self._originals: dict[tuple[str, Hashable], tuple[object, object]] = {}
        # Handles holding references from patch() that no with block owns yet,
        # oldest first: what unpatch() can release.
        self._holders: list[PatchHandle] = []

    # -- public API ------------------------------------------------------------------

    def names(self) -> tuple[str, ...]:
        """The names :meth:`patch` accepts."""
        return self._public

    def patch(self, *names: str) -> PatchHandle:
        """Apply the named patches now (none named: every patch) and return a handle.

        Each name takes one reference; a patch is installed by the first
        reference and removed when the last is released, so nesting and
        repeated calls are harmless. A patch that does not apply to the
        installed torch is skipped; :meth:`status` says why. Use the handle as
        a context manager to restore on exit (also on an exception), or call
        :meth:`unpatch` later from the same thread.

        Raises:
            ValueError: a name is not one of :meth:`names`.
        """
        requested = self._validate(names)
        with self._lock:
            handle = PatchHandle(self, requested, self._acquire_all(requested))
            if handle._bare:
                self._holders.append(handle)
            return handle

    def unpatch(self, *names: str) -> None:
        """Undo the calling thread's newest bare ``patch()`` reference per name (none named: every name).

        Bare means not entered as a context manager. References held by
        ``with`` blocks are released only by leaving the block, and other
        threads' ``patch()`` calls are theirs to undo (``handle.release()``
        works from any thread), so an ``unpatch()`` can never remove a patch
        someone else still relies on.

        Raises:
            ValueError: a name is not one of :meth:`names`.
        """
        chosen = self._validate(names)
        me = threading.get_ident()
        with self._lock:
            for name in chosen:
                for handle in reversed(self._holders):
                    if handle._thread == me and name in handle._bare:
                        handle.release(name)
                        break

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Apply any registered patch (testing ones included) for the duration of a block.

        Raises:
            RuntimeError: the patch does not apply to the installed torch (the
                reason is in the message).
        """
        if name not in self._entries:
            raise ValueError(f"unknown patch {name!r}; registered: {', '.join(self._entries)}")
        with self._lock:
            if not self._acquire(name):
                raise RuntimeError(
                    f"{name} cannot be applied to the installed torch: {self._skip_reason(name)}"
                )
        try:
            yield
        finally:
            with self._lock:
                self._release(name)

    def plan(self, name: str) -> Plan:
        """What applying ``name`` replaces on this torch, or why it is skipped (probes once per process)."""
        if name not in self._entries:
            raise ValueError(f"unknown patch {name!r}; registered: {', '.join(self._entries)}")
        with self._lock:
            return self._plan(self._entries[name])

    def status(self) -> Status:
        """Where every patch stands; passive: it probes, imports and applies nothing."""
        with self._lock:
            return Status(tuple(self._state(entry) for entry in self._entries.values()))

    def get_original(self, module: str, attr: str) -> object:
        """The object gradsafe replaced at ``module.attr``, or the current one if gradsafe is not there.

        Capability code uses this to delegate to torch's own implementation
        even while its public name points at gradsafe's.
        """
        with self._lock:
            for record in self._records():
                target = record.target
                if isinstance(target, AttrTarget) and (target.module, target.attr) == (module, attr):
                    return record.original
            owner, name = _owner(module, attr)
            current = getattr(owner, name)
            known = self._originals.get((f"{module}.{attr}", ""))
            return known[1] if known is not None and current is known[0] else current

    def is_object_patched(self, module: str, attr: str) -> bool:
        """Whether ``module.attr`` currently holds a replacement gradsafe applied."""
        with self._lock:
            return any(
                isinstance(r.target, AttrTarget)
                and (r.target.module, r.target.attr) == (module, attr)
                and r.target.read() is r.target.replacement
                for r in self._records()
            )

    # -- internals (callers hold the lock) ---------------------------------------------

    def _validate(self, names: Sequence[str]) -> tuple[str, ...]:
        unknown = [n for n in names if n not in self._public]
        if unknown:
            raise ValueError(
                f"unknown gradsafe patch {unknown[0]!r}; valid names: {', '.join(self._public)}"
            )
        return tuple(dict.fromkeys(names or self._public))

    def _forget_if_done(self, handle: PatchHandle) -> None:
        if not handle._bare and handle in self._holders:
            self._holders.remove(handle)

    def _acquire_all(self, names: tuple[str, ...]) -> tuple[str, ...]:
        held: list[str] = []
        try:
            for name in names:
                if self._acquire(name):
                    held.append(name)
        except BaseException:
            self._release_all(tuple(reversed(held)))
            raise
        return tuple(held)

    def _release_all(self, names: Sequence[str]) -> None:
        """Release every name even if one restore fails (then re-raise the first failure)."""
        failure: BaseException | None = None
        for name in names:
            try:
                self._release(name)
            except BaseException as exc:  # the others must not stay installed with no holder
                failure = failure or exc
        if failure is not None:
            raise failure

    def _plan(self, entry: _Entry) -> Plan:
        if entry.plan is None:
            entry.plan = self._probe(entry.patch)
        return entry.plan

    @staticmethod
    def _probe(patch: Patch) -> Plan:
        try:
            with _plain_torch_context():
                plan = patch.plan()
        except (ImportError, AttributeError) as exc:
            return Skip(f"the installed torch lacks what this patch replaces ({exc})")
        except Exception as exc:
            # A changed internal fails in its own way (KeyError, TypeError, ...);
            # like a missing one it is a skip with the reason, decided once.
            return Skip(
                f"probing the installed torch failed ({type(exc).__name__}: {exc}); gradsafe "
                "does not recognise what this patch replaces here, please report it"
            )
        if isinstance(plan, Skip):
            return plan
        for target in plan:
            try:
                target.read()
            except (ImportError, AttributeError) as exc:
                return Skip(f"the installed torch has no {target.where} ({exc})")
        return tuple(plan)

    def _skip_reason(self, name: str) -> str:
        plan = self._entries[name].plan
        return plan.reason if isinstance(plan, Skip) else ""

    def _acquire(self, name: str) -> bool:
        entry = self._entries[name]
        if entry.refcount == 0:
            plan = self._plan(entry)
            if isinstance(plan, Skip):
                return False
            self._apply(entry, plan)
        entry.refcount += 1
        return True

    def _release(self, name: str) -> None:
        entry = self._entries[name]
        if entry.refcount <= 0:
            raise RuntimeError(
                f"gradsafe patch {name!r} released more often than it was acquired; this is a "
                "bug in gradsafe (or code calling its internals), please report it"
            )
        entry.refcount -= 1
        if entry.refcount == 0:
            self._restore(entry)

    def _apply(self, entry: _Entry, plan: Sequence[Target]) -> None:
        entry.conflicts.clear()
        done: list[_Applied] = []
        try:
            for target in plan:
                self._refuse_shared_slot(entry, target)
                current = target.read()
                known = self._originals.get(_slot(target))
                original = known[1] if known is not None and current is known[0] else current
                target.write(target.replacement)
                done.append(_Applied(target, original))
                self._originals[_slot(target)] = (target.replacement, original)
            entry.applied = done
            entry.patch.after_change()
        except BaseException:
            # All slots or none, also when after_change fails.
            entry.applied = []
            for record in reversed(done):
                record.target.write(record.original)
            raise

    def _refuse_shared_slot(self, entry: _Entry, target: Target) -> None:
        # Each undo record assumes it is the only patch in its slot: a second
        # one would restore torch's object under the first.
        for other in self._entries.values():
            if other is not entry and any(_slot(r.target) == _slot(target) for r in other.applied):
                raise RuntimeError(
                    f"gradsafe patches {other.patch.name!r} and {entry.patch.name!r} both replace "
                    f"{target.where}; a slot can belong to one applied patch at a time. Release "
                    f"{other.patch.name!r} first, or give the two patches distinct slots."
                )

    def _restore(self, entry: _Entry) -> None:
        for record in reversed(entry.applied):
            current = record.target.read()
            if current is record.target.replacement:
                record.target.write(record.original)
            elif current is not record.original:  # torch's object put back by hand is fine
                message = (
                    f"gradsafe patch {entry.patch.name!r}: {record.target.where} was replaced by "
                    f"{current!r} while gradsafe held it; leaving that in place instead of "
                    f"restoring {record.original!r}. Undo your own patch of that slot before "
                    "gradsafe's is released, or apply it after."
                )
                entry.conflicts.append(message)
                warnings.warn(message, PatchConflictWarning, stacklevel=4)
        entry.applied = []
        entry.patch.after_change()

    def _records(self) -> Iterator[_Applied]:
        for entry in self._entries.values():
            yield from entry.applied

    def _state(self, entry: _Entry) -> PatchState:
        targets: tuple[TargetState, ...] = ()
        skipped = None
        if entry.refcount > 0:
            state: Literal["active", "skipped", "idle", "unplanned"] = "active"
            targets = tuple(_observe(r.target) for r in entry.applied)
        elif entry.plan is None:
            state = "unplanned"
        elif isinstance(entry.plan, Skip):
            state, skipped = "skipped", entry.plan.reason
        else:
            state = "idle"
            targets = tuple(
                TargetState(t.where, "planned", _peek(t)) for t in entry.plan
            )
        return PatchState(
            name=entry.patch.name,
            summary=entry.patch.summary,
            state=state,
            refcount=entry.refcount,
            targets=targets,
            skipped=skipped,
            conflicts=tuple(entry.conflicts),
        )


def _observe(target: Target) -> TargetState:
    current = target.read()
    return TargetState(
        target.where, "replaced" if current is target.replacement else "conflict", current
    )


def _peek(target: Target) -> object:
    """The slot's current object without importing anything (status() is passive)."""
    if isinstance(target, AttrTarget):
        if target.module not in sys.modules:
            return MISSING
        try:
            return target.read()
        except AttributeError:
            return MISSING
    return target.read()
