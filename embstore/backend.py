"""The storage backend interface: one medium holding the rows of one table.

A backend maps int64 ids to fixed-width rows (weights plus optimizer state) and works on whole
batches. The public methods are concrete here: they check closed and read-only state, ids and
row shapes once, then call the abstract `_get/_put/_delete/...` that each backend implements, so
no backend can forget a guard. Adding a backend is adding `backends/<name>.py` whose module
name equals the class's `name`; the registry finds it and the contract suite tests it.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from .errors import (
    ConfigError,
    CorruptStoreError,
    DimensionMismatchError,
    DtypeMismatchError,
    EmbstoreError,
    InvalidIdsError,
    ReadOnlyError,
    StorageIOError,
    StoreClosedError,
    SyncFailedError,
)

_OURS = (EmbstoreError, MemoryError)  # raised as they are: never wrapped

if TYPE_CHECKING:
    from .index import IdIndex

__all__ = ["Backend", "BackendSpec", "SlottedBackend", "SupportsBulkLoad", "SupportsSlots",
           "foreign_error"]


@dataclass(frozen=True)
class BackendSpec:
    """What every backend is opened with.

    Attributes:
        path: directory the backend owns for its files (shared by the tables of one tier);
            None for a purely in-memory instance.
        dim: elements per stored row (the table's weights plus its optimizer state).
        dtype: element dtype of the rows.
        table: table name; persistent backends key their files or namespaces by it.
        capacity_bytes: size hint for media that preallocate (pmem); None lets it grow.
        read_only: open without write access; every mutating call raises `ReadOnlyError`.
    """

    path: Path | None
    dim: int
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))
    table: str = "default"
    capacity_bytes: int | None = None
    read_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if self.path is not None:
            object.__setattr__(self, "path", Path(self.path))

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row."""
        return self.dim * self.dtype.itemsize


class Backend(ABC):
    """One table's rows on one medium, addressed by int64 ids, batch by batch.

    Contract for implementers:
        - `_get` returns rows for every id (zeros where absent) and a found mask.
        - `_put` receives distinct ids and C-contiguous rows of the spec's dtype and width; it
          must not keep a reference to the caller's buffer.
        - After `flush()` returns, every `put`/`delete` before it survives a process crash on
          backends with `supports_persistence`; a crash never yields a torn row.
        - `close()` is idempotent; every other call after it raises `StoreClosedError`.
        - Instances are not thread-safe; the store serialises calls.
    """

    name: ClassVar[str]
    supports_persistence: ClassVar[bool] = False
    requires_path: ClassVar[bool] = True  # False: can run with BackendSpec.path None (in memory)
    supports_concurrent_reads: ClassVar[bool] = False
    """`get` may run on one thread while `put`, `delete` or `get` run on others (the
    medium's own library serialises them); a prefetch then reads without the store's lock."""
    # a failed `_flush` bars every later flush of the instance (see `flush`); False only for
    # views whose `_flush` fails for reasons of their own before the medium's sync
    bars_flush_after_failure: ClassVar[bool] = True

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self._closed = False
        self._failed_sync: Exception | None = None

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Refuse `options` (TierSpec.options) that opening this backend would refuse.

        The base refuses names the backend does not take; a backend whose options are
        checked apart from its files also checks their values, so that a manifest or a
        command names a bad value before anything is opened.

        Raises:
            ConfigError: an unknown or invalid option.
        """
        known = {p.name for p in inspect.signature(cls.__init__).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown {cls.name} backend option(s) {unknown}; it takes {sorted(known)}: "
                "fix the tier's options"
            )

    @classmethod
    def open(cls, spec: BackendSpec, **options: Any) -> Backend:
        """Open (creating if needed) the backend described by `spec`.

        Backend-specific knobs are keyword-only `options` (TierSpec.options).

        Raises:
            ConfigError: an unknown or invalid option.
            CorruptStoreError: existing files fail their integrity checks.
        """
        cls.check_options(options)
        try:
            return cls(spec, **options)
        except _OURS:
            raise
        except Exception as exc:
            raise foreign_error(exc, f"opening {cls.name} table {spec.table!r} in {spec.path}",
                                spec.path) from exc

    @classmethod
    def opening(cls, specs: Sequence[BackendSpec],
                **options: Any) -> contextlib.AbstractContextManager[None]:
        """Get ready to `open` the tables `specs` (one directory, these options) in the block.

        A store opens a tier's tables inside it, so that a medium with a cost per table and
        directory (RocksDB writes its options file anew for every column family it adds) pays
        it once for all of them. Note for implementers: the default does nothing; errors are
        those `open` would raise, and nothing may stay open after the block.
        """
        return contextlib.nullcontext()

    # --- guards -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(
                f"{self.name} backend of table {self.spec.table!r} is closed; open it again"
            )

    def _check_writable(self) -> None:
        self._check_open()
        if self.spec.read_only:
            raise ReadOnlyError(
                f"{self.name} backend of table {self.spec.table!r} was opened read-only; "
                "reopen it with read_only=False to write"
            )

    @staticmethod
    def _check_ids(ids: np.ndarray) -> np.ndarray:
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1:
            raise InvalidIdsError(
                f"backend ids must be a 1-D int64 numpy array, got {type(ids).__name__} "
                f"{getattr(ids, 'dtype', '')} {getattr(ids, 'shape', '')}; "
                "convert them with embstore's store API, which validates ids"
            )
        return np.ascontiguousarray(ids)

    def _check_rows(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        if not isinstance(rows, np.ndarray) or rows.dtype != self.spec.dtype:
            raise DtypeMismatchError(
                f"rows for table {self.spec.table!r} must be {self.spec.dtype}, "
                f"got {getattr(rows, 'dtype', type(rows).__name__)}"
            )
        if rows.shape != (len(ids), self.spec.dim):
            raise DimensionMismatchError(
                f"rows for table {self.spec.table!r} must have shape ({len(ids)}, "
                f"{self.spec.dim}), got {rows.shape}"
            )
        return np.ascontiguousarray(rows)

    # --- public API ---------------------------------------------------------------------

    @property
    def is_closed(self) -> bool:
        """Whether `close()` has been called."""
        return self._closed

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read the rows of `ids` (int64[N]).

        Returns:
            rows: array[N, dim], zeros where an id is absent; a fresh array the caller owns.
            found: bool[N], whether each id is stored.

        Raises:
            StoreClosedError: after close().
            CorruptStoreError: a stored row failed its checksum.
        """
        self._check_open()
        ids = self._check_ids(ids)
        try:
            return self._get(ids)
        except _OURS:
            raise
        except Exception as exc:
            raise self._foreign(exc, "reading") from exc

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store `rows` (array[N, dim]) under distinct `ids` (int64[N]), replacing old rows.

        Raises:
            StoreClosedError, ReadOnlyError, DtypeMismatchError, DimensionMismatchError.
            CapacityError: the medium is full.
        """
        self._check_writable()
        ids = self._check_ids(ids)
        rows = self._check_rows(ids, rows)
        if len(ids):
            try:
                self._put(ids, rows)
            except _OURS:
                raise
            except Exception as exc:
                raise self._foreign(exc, "writing") from exc

    def delete(self, ids: np.ndarray) -> np.ndarray:
        """Remove `ids`; absent ids are ignored. Returns bool[N], which ids were present."""
        self._check_writable()
        ids = self._check_ids(ids)
        if not len(ids):
            return np.zeros(0, dtype=bool)
        try:
            return self._delete(ids)
        except _OURS:
            raise
        except Exception as exc:
            raise self._foreign(exc, "deleting from") from exc

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """bool[N]: whether each id is stored.

        Raises:
            StoreClosedError: after close().
            InvalidIdsError: `ids` is not a 1-D int64 array.
        """
        self._check_open()
        ids = self._check_ids(ids)
        try:
            return self._contains(ids)
        except _OURS:
            raise
        except Exception as exc:
            raise self._foreign(exc, "reading") from exc

    def ids(self) -> np.ndarray:
        """Every stored id, int64, in no particular order unless the backend says so."""
        self._check_open()
        try:
            return self._ids()
        except _OURS:
            raise
        except Exception as exc:
            raise self._foreign(exc, "scanning") from exc

    def items(self, batch_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (ids, rows) batches of at most `batch_rows` covering every stored row once.

        The checks run at the call, not at the first `next`.

        Raises:
            StoreClosedError: after close() (also between batches).
            ConfigError: `batch_rows` < 1.
            CorruptStoreError: a stored row failed its checks (never an early end).
        """
        self._check_open()
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, (int, np.integer)) \
                or batch_rows < 1:
            raise ConfigError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
        return self._translated(self._items(batch_rows))

    def _translated(self, pages: Iterator[tuple[np.ndarray, np.ndarray]]
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        try:
            yield from pages
        except _OURS:
            raise
        except Exception as exc:
            raise self._foreign(exc, "scanning") from exc

    def __len__(self) -> int:
        self._check_open()
        try:
            return self._len()
        except _OURS:
            raise
        except Exception as exc:
            raise self._foreign(exc, "counting the rows of") from exc

    def flush(self) -> None:
        """Make every write before this call durable (a no-op on volatile media).

        After a flush fails, every later one raises `SyncFailedError` until the backend is
        closed and opened again: a retried sync may report success after the kernel dropped
        the pages it failed to write (fsyncgate), so no later flush can vouch for them.

        Raises:
            StoreClosedError: after close().
            StorageIOError: the sync failed.
            SyncFailedError: an earlier flush of this instance failed.
        """
        self._check_open()
        if self.spec.read_only:
            return
        if self._failed_sync is not None:
            raise SyncFailedError(
                f"a flush of {self.name} table {self.spec.table!r} in {self.spec.path} failed "
                f"({self._failed_sync}); writes since the flush before it may be lost and "
                "none can be made durable through this handle: close the store and reopen it"
            ) from self._failed_sync
        try:
            self._flush()
        except Exception as exc:
            err = exc if isinstance(exc, _OURS) else self._foreign(exc, "syncing")
            if self.bars_flush_after_failure:
                self._failed_sync = err
            if err is exc:
                raise
            raise err from exc

    def close(self) -> None:
        """Flush (unless read-only) and release every resource. Idempotent."""
        if self._closed:
            return
        try:
            if not self.spec.read_only and self._failed_sync is None:
                self._flush()
        except _OURS:
            raise
        except Exception as exc:
            raise self._foreign(exc, "syncing") from exc
        finally:
            self._closed = True
            try:
                self._close()
            except _OURS:
                raise
            except Exception as exc:  # the library's (or the OS's) error, named as ours
                raise self._foreign(exc, "closing") from exc

    def refresh(self) -> None:
        """Catch a read-only handle up with its writer: see what it flushed since the open.

        A read-only handle reads beside a writer in another process (it takes no lock). Some
        media show that writer's flushed writes at once (LMDB: each read is a transaction),
        others as of the open or the last `refresh` (a RocksDB snapshot, a pmem scan). A
        no-op for writable handles and in-memory media.

        Raises:
            StoreClosedError: after close().
            CorruptStoreError: the medium's files are damaged.
        """
        self._check_open()
        if not self.spec.read_only:
            return
        try:
            self._refresh()
        except _OURS:
            raise
        except Exception as exc:
            raise self._foreign(exc, "reopening") from exc

    def _refresh(self) -> None:
        """Re-read what a writer flushed (read-only handles only).

        Note for implementers: the default does nothing, right for media whose reads see
        the writer's durable state at each call.
        """
        return

    def _foreign(self, exc: Exception, what: str) -> Exception:
        """The embstore error for `exc`, raised by the medium while `what` this table."""
        return foreign_error(exc, f"{what} {self.name} table {self.spec.table!r} in "
                                  f"{self.spec.path}", self.spec.path)

    def statistics(self) -> dict[str, Any]:
        """Medium-specific facts: rows, bytes, and e.g. whether libpmem is in use."""
        self._check_open()
        return {"backend": self.name, "rows": self._len(), "bytes": self.nbytes()}

    def nbytes(self) -> int:
        """Bytes this backend holds in memory or on disk for its rows and index."""
        return self._len() * self.spec.row_bytes

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- for implementers ---------------------------------------------------------------

    @abstractmethod
    def _get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    @abstractmethod
    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None: ...

    @abstractmethod
    def _delete(self, ids: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def _ids(self) -> np.ndarray: ...

    @abstractmethod
    def _len(self) -> int: ...

    @abstractmethod
    def _flush(self) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

    def _contains(self, ids: np.ndarray) -> np.ndarray:
        """bool[N] for checked `ids`.

        Note for implementers: the default reads whole rows; override where the medium can
        answer from its index alone.
        """
        return self._get(ids)[1]

    def _items(self, batch_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The batches of `items` (arguments checked).

        Note for implementers: the default reads `_ids()` once, then `_get` per batch; a
        backend with an ordered scan should override it.
        """
        all_ids = self._ids()
        for start in range(0, len(all_ids), batch_rows):
            self._check_open()
            chunk = all_ids[start : start + batch_rows]
            rows, found = self._get(chunk)
            if not found.all():  # deleted since the ids were listed
                chunk, rows = chunk[found], rows[found]
            yield chunk, rows


class SlottedBackend(Backend):
    """A backend whose rows sit in the dense slots of an `IdIndex` it exposes.

    It satisfies `SupportsSlots`: the public slot methods check their arguments here, once,
    and call the `_get_with_slots/_put_slots/_rows_at` hooks.
    """

    @property
    @abstractmethod
    def index(self) -> IdIndex:
        """The id -> slot index; an eviction policy may share it (see `SupportsSlots`)."""

    def get_with_slots(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`get`, plus each id's slot in `index` (int32[N], -1 where absent).

        Raises:
            StoreClosedError, InvalidIdsError.
        """
        self._check_open()
        return self._get_with_slots(self._check_ids(ids))

    def put_with_slots(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray,
                                                                          np.ndarray]:
        """`put` of distinct ids; returns (their slots in `index`, which were inserted).

        Raises:
            StoreClosedError, ReadOnlyError, InvalidIdsError, DtypeMismatchError,
            DimensionMismatchError.
        """
        self._check_writable()
        ids = self._check_ids(ids)
        return self._put_slots(ids, self._check_rows(ids, rows))

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        """The rows at live `slots` (int32[N]) of `index`, a copy; no hash probe.

        Raises:
            StoreClosedError.
        """
        self._check_open()
        return self._rows_at(np.ascontiguousarray(slots, dtype=np.int32))

    @abstractmethod
    def _get_with_slots(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`get_with_slots` of checked ids."""

    @abstractmethod
    def _put_slots(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`put_with_slots` of checked ids and rows."""

    @abstractmethod
    def _rows_at(self, slots: np.ndarray) -> np.ndarray:
        """`rows_at` of int32 slots."""


@runtime_checkable
class SupportsSlots(Protocol):
    """A backend whose rows sit in the dense slots of an `IdIndex` it exposes.

    A tier lets its eviction policy track ids in those same slots (`share_index`) and hands
    it the slots each lookup found, so a hit costs one hash probe, not two.
    """

    @property
    def index(self) -> IdIndex:
        """The backend's id -> slot index (read-only for everyone else)."""

    def get_with_slots(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`get`, plus the slot of each id (int32[N], -1 where absent)."""

    def put_with_slots(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray,
                                                                          np.ndarray]:
        """`put` of distinct ids; returns (their slots int32[N], inserted bool[N])."""

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        """The rows stored at live `slots` (int32[N]), a copy; no hash probe."""


@runtime_checkable
class SupportsLeadingColumns(Protocol):
    """A slotted backend that reads the leading columns of rows alone (weights, not state)."""

    def get_leading(self, ids: np.ndarray, columns: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first `columns` of each row of `get` (C-contiguous), found mask and slots."""


@runtime_checkable
class SupportsBulkLoad(Protocol):
    """A backend with a path for loading many rows at once that beats batches of `put`."""

    def bulk_load(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store `rows` under distinct `ids`, replacing stored rows; durable on return."""


def foreign_error(exc: Exception, what: str, path: object) -> Exception:
    """`exc` as a documented embstore error; `what` says what was being done, `path` where.

    An embstore error passes unchanged; an `OSError` becomes a `StorageIOError` with its errno;
    `MemoryError` stays itself; so does a library's error that names a failing medium (no
    space, EIO, a read-only file system) or that came with the file system of `path` full,
    as a `StorageIOError`. Anything else a library raised (RocksDB's "Corruption", an LMDB
    error, a numpy or struct error on a short or foreign file) means the files are not what
    the backend wrote: `CorruptStoreError`.
    """
    if isinstance(exc, EmbstoreError | MemoryError):
        return exc
    if isinstance(exc, OSError):
        return StorageIOError(exc.errno, f"{what}: {exc.strerror or exc}; {_fix(exc.errno)}",
                              exc.filename or str(path))
    # a library's own words for a failing medium (LMDB's "Input/output error"); a full disk
    # is asked of the file system, since a library may name only its own state after one
    # (RocksDB's "Writer has previous error")
    code = next((c for words, c in _MEDIUM_FAILURES if words in str(exc)), None)
    if path is not None and _file_system_full(Path(str(path))):
        code = errno.ENOSPC
    if code is not None:
        # LMDB reports a write cut short (a disk that filled during it) as EIO too
        fix = ("check the free disk space and the device (dmesg), then reopen the store"
               if code == errno.EIO else _fix(code))
        return StorageIOError(code, f"{what}: {type(exc).__name__}: {exc}; {fix}",
                              str(path) if path is not None else None)
    return CorruptStoreError(
        f"{what}: {type(exc).__name__}: {exc}; the files are damaged or not embstore's: "
        "restore the store from a checkpoint (`embstore fsck` lists what is damaged)")


_MEDIUM_FAILURES = (("No space left on device", errno.ENOSPC),
                    ("Disk quota exceeded", errno.EDQUOT),
                    ("Input/output error", errno.EIO),
                    ("Read-only file system", errno.EROFS))


def _fix(code: int | None) -> str:
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free disk space"
    return "check the device (dmesg), then reopen the store"


def _file_system_full(path: Path) -> bool:
    """Whether the file system holding `path` (or its nearest existing parent) is full."""
    for where in (path, *path.parents):
        try:
            fs = os.statvfs(where)
        except FileNotFoundError:
            continue
        except OSError:
            return False
        return fs.f_bavail * fs.f_frsize < _FULL_BYTES
    return False


_FULL_BYTES = 1 << 20
"""Free bytes below which a file system counts as full: a library's write of a batch fails."""
