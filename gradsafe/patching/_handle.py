"""The handle ``patch()`` returns: the references one call took, and a reusable context manager."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import ContextManager, Protocol

from typing_extensions import Self

__all__ = ["PatchHandle", "References"]

_NO_COPY = (
    "a PatchHandle cannot be copied or pickled: it stands for the references its patch() call "
    "took, and a copy would release them behind the original's back; call gradsafe.patch() "
    "again for an independent handle, or enter the same handle again (with handle:)"
)


class References(Protocol):
    """What a handle needs from its registry: references taken and given back under one lock.

    :class:`~gradsafe.patching.PatchRegistry` is the implementation; the
    handle uses nothing else of it.
    """

    @property
    def lock(self) -> ContextManager[object]: ...

    def validate(self, names: Sequence[str]) -> tuple[str, ...]: ...

    def acquire(self, names: Sequence[str]) -> tuple[str, ...]: ...

    def release(self, names: Sequence[str]) -> None: ...


class PatchHandle:
    """The references one :meth:`PatchRegistry.patch` call took, and a reusable context manager.

    ``patch()`` applies at once and the handle holds those references until
    :meth:`release` (or ``unpatch()`` from the thread that called ``patch()``).
    Entering the handle in a ``with`` block makes the block own them: leaving
    the block releases them, also on an exception, and nothing else can. A
    handle entered again (``ctx = gradsafe.patch()`` then ``with ctx:`` in a
    loop, or nested) takes fresh references for that block, so every block
    runs patched.

    A handle stands for references it took, so it cannot be copied
    (``copy.copy``, ``copy.deepcopy`` and pickling raise ``TypeError``): a copy
    would give back references the original still lists. Call ``patch()``
    again for another, independent handle. Leaving a block the handle was not
    entered for raises ``RuntimeError``.
    """

    def __init__(self, references: References, requested: tuple[str, ...], held: tuple[str, ...]):
        self._references = references
        self._requested = requested
        self._bare = held
        self._blocks: list[tuple[str, ...]] = []
        self._thread = threading.get_ident()

    @property
    def names(self) -> tuple[str, ...]:
        """The patches this handle holds a reference to right now (skipped ones never)."""
        held = [*self._bare, *(name for block in self._blocks for name in block)]
        return tuple(dict.fromkeys(held))

    @property
    def bare(self) -> tuple[str, ...]:
        """The references ``patch()`` took that no ``with`` block owns: what ``unpatch()`` may release."""
        return self._bare

    @property
    def thread(self) -> int:
        """The ident of the thread that called ``patch()``."""
        return self._thread

    def release(self, *names: str) -> None:
        """Give back the references ``patch()`` took for ``names`` (default: all); idempotent.

        References owned by a ``with`` block are released by leaving the block.

        Raises:
            ValueError: a name is not one of the registry's patch names.
        """
        with self._references.lock:
            chosen = set(self._references.validate(names) if names else self._bare)
            releasing = tuple(n for n in self._bare if n in chosen)
            self._bare = tuple(n for n in self._bare if n not in chosen)
            self._references.release(releasing)

    def __enter__(self) -> Self:
        with self._references.lock:
            # The block owns the bare references and fresh ones for every
            # requested name they lack (all of them once released, or those
            # released one by one), so every block runs fully patched.
            missing = tuple(n for n in self._requested if n not in self._bare)
            block = self._bare + self._references.acquire(missing)
            self._bare = ()
            self._blocks.append(block)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._references.lock:
            if not self._blocks:
                raise RuntimeError(
                    "PatchHandle.__exit__ called more often than __enter__: this handle owns no "
                    "with block to leave; call __exit__ once per __enter__ (a with statement does)"
                )
            self._references.release(self._blocks.pop())

    def __copy__(self) -> PatchHandle:
        raise TypeError(_NO_COPY)

    def __deepcopy__(self, memo: dict[int, object]) -> PatchHandle:
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol: object) -> str | tuple[object, ...]:
        raise TypeError(_NO_COPY)

    def __repr__(self) -> str:
        return f"PatchHandle(names={self.names!r})"
