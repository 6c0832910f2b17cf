"""The patch registry: every patch's cached plan, reference count and exact-object undo records."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from gradsafe.patching._handle import PatchHandle
from gradsafe.patching._status import PatchState, Status, TargetState, observe, peek
from gradsafe.patching._targets import AttrTarget, Patch, Plan, Skip, Target, owner_of, slot_of

__all__ = ["PatchConflictWarning", "PatchRegistry"]


class PatchConflictWarning(UserWarning):
    """Something other than gradsafe replaced a slot gradsafe had patched."""


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


class PatchRegistry:
    """Every patch of one process: plans, reference counts, exact-object undo.

    ``patches`` are the names :meth:`patch` accepts; ``testing`` patches (the
    CUDA-graph emulation) are applied only through :meth:`hold`, but share the
    bookkeeping, so :meth:`get_original` and :meth:`is_object_patched` see
    them too. One re-entrant lock guards everything: threads may patch and
    release concurrently.
    """

    def __init__(self, patches: Sequence[Patch] = (), *, testing: Sequence[Patch] = ()) -> None:
        self._lock = threading.RLock()
        self._public: tuple[str, ...] = ()
        self._entries: dict[str, _Entry] = {}
        # The last object found in each slot that was not gradsafe's, keyed by
        # slot, with gradsafe's replacement: lets a slot left holding
        # gradsafe's object (a foreign patch undone out of order) still reach
        # torch's function, and be restored by the next patch cycle.
        self._originals: dict[tuple[str, Hashable], tuple[object, object]] = {}
        # Handles holding references from patch() that no with block owns yet,
        # oldest first: what unpatch() can release.
        self._holders: list[PatchHandle] = []
        self.register(*patches)
        self.register(*testing, testing=True)

    # -- public API ------------------------------------------------------------------

    def register(self, *patches: Patch, testing: bool = False) -> None:
        """Add patches: ``patch()`` names, or ``testing`` ones applied only through :meth:`hold`.

        Raises:
            ValueError: a patch of that name is registered already.
        """
        with self._lock:
            for patch in patches:
                if patch.name in self._entries:
                    raise ValueError(f"a gradsafe patch named {patch.name!r} is registered already")
                self._entries[patch.name] = _Entry(patch)
                if not testing:
                    self._public += (patch.name,)

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
        requested = self.validate(names)
        with self._lock:
            handle = PatchHandle(self, requested, self.acquire(requested))
            self._holders = [h for h in self._holders if h.bare]
            if handle.bare:
                self._holders.append(handle)
            return handle

    def unpatch(self, *names: str) -> None:
        """Undo the calling thread's newest bare ``patch()`` reference per name (none named: every name).

        Bare means not entered as a context manager. References held by
        ``with`` blocks are released only by leaving the block, and other
        threads' ``patch()`` calls are theirs to undo (``handle.release()``
        works from any thread), so an ``unpatch()`` can never remove a patch
        someone else still relies on. A name with no such reference is left as
        it is: ``unpatch()`` with nothing of this thread's to release is a
        no-op, so a clean-up ``unpatch()`` is always safe.

        Raises:
            ValueError: a name is not one of :meth:`names`.
        """
        chosen = self.validate(names)
        me = threading.get_ident()
        with self._lock:
            for name in chosen:
                for handle in reversed(self._holders):
                    if handle.thread == me and name in handle.bare:
                        handle.release(name)
                        break
            self._holders = [h for h in self._holders if h.bare]

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
                if isinstance(target, AttrTarget) and (target.module, target.attr) == (
                    module,
                    attr,
                ):
                    return record.original
            owner, name = owner_of(module, attr)
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

    # -- the references handles take and give back (gradsafe.patching.References) --

    @property
    def lock(self) -> threading.RLock:
        """The one re-entrant lock guarding every patch's state; handles take it too."""
        return self._lock

    def validate(self, names: Sequence[str]) -> tuple[str, ...]:
        """``names`` without repeats (none: every patch name).

        Raises:
            ValueError: a name is not one of :meth:`names`.
        """
        unknown = [n for n in names if n not in self._public]
        if unknown:
            raise ValueError(
                f"unknown gradsafe patch {unknown[0]!r}; valid names: {', '.join(self._public)}"
            )
        return tuple(dict.fromkeys(names or self._public))

    def acquire(self, names: Sequence[str]) -> tuple[str, ...]:
        """Take one reference per name (all or none); returns the names applied (skipped ones left out)."""
        with self._lock:
            held: list[str] = []
            try:
                for name in names:
                    if self._acquire(name):
                        held.append(name)
            except BaseException:
                self.release(tuple(reversed(held)))
                raise
            return tuple(held)

    def release(self, names: Sequence[str]) -> None:
        """Give back one reference per name, every name even if one restore fails (then re-raise the first failure)."""
        with self._lock:
            failure: BaseException | None = None
            for name in names:
                try:
                    self._release(name)
                except BaseException as exc:  # the others must not stay installed with no holder
                    failure = failure or exc
            if failure is not None:
                raise failure

    # -- internals (callers hold the lock) ---------------------------------------------

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
                self._refuse_sharedslot_of(entry, target)
                current = target.read()
                known = self._originals.get(slot_of(target))
                original = known[1] if known is not None and current is known[0] else current
                target.write(target.replacement)
                done.append(_Applied(target, original))
                self._originals[slot_of(target)] = (target.replacement, original)
            entry.applied = done
            entry.patch.after_change()
        except BaseException:
            # All slots or none, also when after_change fails.
            entry.applied = []
            for record in reversed(done):
                record.target.write(record.original)
            raise

    def _refuse_sharedslot_of(self, entry: _Entry, target: Target) -> None:
        # Each undo record assumes it is the only patch in its slot: a second
        # one would restore torch's object under the first.
        for other in self._entries.values():
            if other is not entry and any(
                slot_of(r.target) == slot_of(target) for r in other.applied
            ):
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
            targets = tuple(observe(r.target) for r in entry.applied)
        elif entry.plan is None:
            state = "unplanned"
        elif isinstance(entry.plan, Skip):
            state, skipped = "skipped", entry.plan.reason
        else:
            state = "idle"
            targets = tuple(TargetState(t.where, "planned", peek(t)) for t in entry.plan)
        return PatchState(
            name=entry.patch.name,
            summary=entry.patch.summary,
            state=state,
            refcount=entry.refcount,
            targets=targets,
            skipped=skipped,
            conflicts=tuple(entry.conflicts),
            testing=entry.patch.name not in self._public,
        )
