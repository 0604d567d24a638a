"""Fault injection for tests of code built on embstore (shipped, so applications can use it).

`FaultyBackend` wraps any backend and fails the N-th call of a chosen method with a chosen
error, once (a transient fault) or from then on (a persistent one, until `disarm`). It is a
`Backend` itself, so a tier, a background writer or a checkpoint can be handed one.

Example::

    faulty = FaultyBackend(backend, method="put", nth=2, persistent=True)
    faulty.put(ids, rows)            # call 1: applied
    faulty.put(ids, rows)            # call 2: raises OSError(EIO), nothing applied
    faulty.disarm()                  # the medium recovers

`inject(store, table, ...)` puts one under a table's store of record inside an open store, so
that flushes, write-backs and checkpoints meet the fault; `method="any"` counts every call.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, final

import numpy as np

from .._writeback import DrainedBackend
from ..backend import Backend
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..store import EmbeddingStore

__all__ = ["METHODS", "FaultyBackend", "inject"]

METHODS = ("get", "put", "delete", "contains", "ids", "items", "flush", "len", "close")
"""The calls a `FaultyBackend` can fail (`len` is `len(backend)`); "any" counts them all."""


@final
class FaultyBackend(Backend):
    """`wrapped`, whose `nth` call of `method` (and, if `persistent`, every later one) raises.

    A failing call raises before it reaches `wrapped`, so it changes nothing there. Calls are
    counted per wrapper from 1, on any thread.

    Args:
        wrapped: the backend to wrap; the wrapper closes it on close.
        method: one of `METHODS`.
        nth: the first call that fails (>= 1).
        error: the exception raised (default: `OSError(EIO)`, as a failing disk gives).
        persistent: fail every call from the `nth` on, not only that one.

    Raises:
        ConfigError: an unknown method or nth < 1.
    """

    name: ClassVar[str] = "faulty"

    def __init__(self, wrapped: Backend, *, method: str, nth: int = 1,
                 error: BaseException | None = None, persistent: bool = False) -> None:
        if method not in METHODS and method != "any":
            raise ConfigError(f"FaultyBackend method must be one of {METHODS}, got {method!r}")
        if nth < 1:
            raise ConfigError(f"FaultyBackend nth must be >= 1, got {nth}")
        super().__init__(wrapped.spec)
        self.wrapped = wrapped
        self.method = method
        self.nth = nth
        self.error = error if error is not None else OSError(
            errno.EIO, f"injected I/O error in {method} of {wrapped.name}")
        self.persistent = persistent
        self.calls = 0
        """Calls of `method` so far."""
        self.faults = 0
        """Calls that raised."""
        self.wrapped_flush_failed = False
        """Whether a `flush` call raised (injected or from `wrapped`)."""
        self._armed = True
        self._lock = threading.Lock()

    def disarm(self) -> None:
        """Fail no further call (the medium has recovered)."""
        self._armed = False

    def _hit(self, method: str) -> None:
        if method != self.method and self.method != "any":
            return
        with self._lock:
            self.calls += 1
            fail = self._armed and (self.calls == self.nth
                                    or (self.persistent and self.calls > self.nth))
            if fail:
                self.faults += 1
        if fail:
            raise self.error

    def _get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._hit("get")
        return self.wrapped.get(ids)

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self._hit("put")
        self.wrapped.put(ids, rows)

    def _delete(self, ids: np.ndarray) -> np.ndarray:
        self._hit("delete")
        return self.wrapped.delete(ids)

    def _contains(self, ids: np.ndarray) -> np.ndarray:
        self._hit("contains")
        return self.wrapped.contains(ids)

    def _ids(self) -> np.ndarray:
        self._hit("ids")
        return self.wrapped.ids()

    def _items(self, batch_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        self._hit("items")
        return self.wrapped.items(batch_rows)

    def _len(self) -> int:
        self._hit("len")
        return len(self.wrapped)

    def _flush(self) -> None:
        try:
            self._hit("flush")
            self.wrapped.flush()
        except BaseException:
            self.wrapped_flush_failed = True
            raise

    def _close(self) -> None:
        try:
            self._hit("close")
        finally:
            self.wrapped.close()

    def nbytes(self) -> int:
        # docstring inherited
        return self.wrapped.nbytes()

    def statistics(self) -> dict[str, Any]:
        # docstring inherited
        return {**self.wrapped.statistics(), "faults": self.faults}

    def __repr__(self) -> str:
        return (f"FaultyBackend({self.wrapped!r}, method={self.method!r}, nth={self.nth}, "
                f"persistent={self.persistent})")


def inject(store: EmbeddingStore, table: str, *, method: str, nth: int = 1,
           error: BaseException | None = None, persistent: bool = False) -> FaultyBackend:
    """Wrap the store of record of `table` in an open `store` in a `FaultyBackend`.

    Every use of the medium from then on (reads, write-backs on the background thread,
    flushes, checkpoints, close) goes through the wrapper; arguments as for `FaultyBackend`.
    Returns the wrapper, whose `calls`, `faults` and `disarm()` the test can use.

    Raises:
        UnknownTableError: no such table.
        ConfigError: an unknown method or nth < 1.
    """
    store.table_spec(table)  # raises UnknownTableError
    tier = store._tables[table].chain.tiers[-1]
    view = tier.backend
    if isinstance(view, DrainedBackend):
        view.drain()
        faulty = FaultyBackend(view.wrapped, method=method, nth=nth, error=error,
                               persistent=persistent)
        view.wrapped = faulty
        view.writer_backend(faulty)
    else:
        faulty = FaultyBackend(view, method=method, nth=nth, error=error,
                               persistent=persistent)
        tier.backend = faulty
    return faulty
