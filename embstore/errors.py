"""Errors raised by embstore. Every class derives from `EmbstoreError`.

Messages say what was wrong, what was expected, what was received and what to do about it.
A call that raises one of these (other than `CorruptStoreError` found mid-way and I/O errors
from the medium) has changed nothing.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CapacityError",
    "ConfigError",
    "CorruptStoreError",
    "DeviceMismatchError",
    "DimensionMismatchError",
    "DtypeMismatchError",
    "EmbstoreError",
    "InvalidIdsError",
    "InvalidValuesError",
    "NonFiniteValueError",
    "PeerFailedError",
    "ReadOnlyError",
    "ShardsDivergedError",
    "StoreClosedError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StorageIOError",
    "SyncFailedError",
    "UnknownNameError",
    "UnknownTableError",
]


class EmbstoreError(Exception):
    """Base class of every error embstore raises on purpose."""


class ConfigError(EmbstoreError, ValueError):
    """A TableSpec, TierSpec or option is invalid or contradicts the stored manifest."""


class UnknownNameError(ConfigError):
    """A backend, policy, initializer or optimizer name is not registered."""


class UnknownTableError(EmbstoreError, LookupError):
    """The table named in a call does not exist in this store."""

    def __init__(self, table: str, known: list[str]) -> None:
        what = (f"unknown table {table!r}" if isinstance(table, str)
                else f"table names are str, got {type(table).__name__} {table!r}")
        super().__init__(
            f"{what}: this store has {sorted(known)!r}; "
            "declare it with a TableSpec when opening the store"
        )
        self.table = table


class InvalidIdsError(EmbstoreError, ValueError):
    """Ids are not a 1-D array of integers representable as int64, or out of range."""


class InvalidValuesError(EmbstoreError, ValueError):
    """Rows or gradients have the wrong shape or cannot be used as given."""


class DimensionMismatchError(InvalidValuesError):
    """Rows or gradients do not have the table's embedding dimension."""


class DtypeMismatchError(InvalidValuesError, TypeError):
    """Rows or gradients are not of the table's dtype."""


class DeviceMismatchError(InvalidValuesError):
    """A tensor is on another device than the module it is given to (torch adapter)."""


class NonFiniteValueError(InvalidValuesError):
    """NaN or infinity where the table forbids it."""


class StoreClosedError(EmbstoreError):
    """The store or backend was closed by its owner; open it again to use it."""


class ReadOnlyError(EmbstoreError):
    """A write was attempted on a store or backend opened read-only."""


class StoreLockedError(EmbstoreError):
    """Another process (or another open handle) holds the store's lock.

    Attributes:
        holder_pid: the process that holds it, when the lock file names one (else None).
    """

    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class StoreNotFoundError(EmbstoreError, FileNotFoundError):
    """The path holds no embstore store (no manifest)."""


class StoreExistsError(EmbstoreError, FileExistsError):
    """A store already exists where a new one was to be created."""


class CorruptStoreError(EmbstoreError):
    """Stored data failed a checksum or structural check; the bad bytes are never returned."""


class CapacityError(EmbstoreError):
    """A tier or medium cannot hold what was asked of it.

    Attributes:
        hint: what to change to make it fit (a larger capacity, more disk, ...).
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(f"{message}; {hint}" if hint else message)
        self.hint = hint


class BackendUnavailableError(EmbstoreError, ImportError):
    """A registered backend or policy cannot be loaded on this machine."""


class PeerFailedError(EmbstoreError):
    """A collective call of a sharded store failed on another rank.

    That rank died, raised, or did not make the same call within the group's timeout.
    """


class ShardsDivergedError(PeerFailedError):
    """A sharded store's shards may no longer agree.

    A write failed on one rank's shards after its exchange, where the other ranks may have
    applied their parts. The rank where it failed raised that write's own error; from the
    next call on, every call on every rank raises this one (a checkpoint too, so none saves
    shards that disagree). Restart every rank from the last checkpoint.
    """


class StorageIOError(EmbstoreError, OSError):
    """The medium failed a read, a write or a sync (EIO, ENOSPC, ...).

    An `OSError` too, with the medium's `errno` and the file in `filename`. What the call
    wrote may or may not be applied; nothing acknowledged by an earlier `flush()` is lost.
    """


class SyncFailedError(EmbstoreError):
    """A flush failed, so writes acknowledged since the one before may be lost.

    The handle refuses every later flush (a retried fsync can report success after the
    kernel dropped the unwritten pages: the fsyncgate lesson); close it and reopen the store,
    which then holds what the last successful flush made durable.
    """


def brief(value: object) -> str:
    """`value` for a one-line message: its repr, cut short (a damaged file's field may be huge)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
