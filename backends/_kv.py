"""What the ordered key-value backends (rocksdb, lmdb) share beyond the key and value codecs.

`KeyValueBackend` turns a medium's values of a batch's distinct ids into rows, pages through
the keys in order (each backend reads one page its own way, `_scan_page`), and builds
`items`/`ids` on that scan. `check_table_meta` is the dim/dtype check of a reopened table.
"""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from embstore.backend import Backend, BackendSpec
from embstore.errors import ConfigError, CorruptStoreError, StorageIOError, StoreNotFoundError

from ._keys import decode_keys, decode_values

__all__ = ["KeyValueBackend", "check_table_meta", "flag_option", "int_option", "missing_medium",
           "table_meta"]

FORMAT = 1  # of the per-table metadata record


def missing_medium(what: str, directory: object) -> StoreNotFoundError:
    """The error of a read-only open that finds no database (`what`) in `directory`.

    In a store that is a lost or removed file, not one to make: opening the store for
    writing would make an empty one, whose written rows then read as lost.
    """
    return StoreNotFoundError(
        f"no {what} in {directory}: never made, or its files were removed or lost (`embstore "
        "fsck STORE` checks a store); a read-only open makes none")


def refuse_special_files(directory: Path, what: str) -> None:
    """Refuse a database directory holding links, named pipes, sockets or devices.

    The library (`what`) opens its files itself: a named pipe in a file's place (RocksDB's
    CURRENT, LMDB's data.mdb) would block its open for ever, and a link would lead it out of
    the store.

    Raises:
        CorruptStoreError: naming the first such entry.
    """
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageIOError(exc.errno, f"cannot list {what} directory {directory}: "
                             f"{exc.strerror or exc}", str(directory)) from exc
    for entry in entries:
        if not (entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False)):
            kind = "a symbolic link" if entry.is_symlink() else "a named pipe, socket or device"
            raise CorruptStoreError(
                f"{entry.path} is {kind}, not a file {what} wrote; put the file itself back or "
                "restore the tier from a checkpoint")


def flag_option(backend: str, option: str, value: Any) -> bool:
    """`value` of the True/False option `option` of `backend`, as a bool.

    0 and 1 (numpy's too) are taken as well: stores made when any truthy value turned the
    option on hold them in their manifests, and must still open.

    Raises:
        ConfigError: anything else; bool("no") is True, so a string is never read as one.
    """
    if not (isinstance(value, (bool, np.bool_, int, np.integer)) and value in (0, 1)):
        raise ConfigError(f"{backend} option {option} must be True or False, got {value!r}")
    return bool(value)


def int_option(backend: str, option: str, value: Any, low: int, high: int) -> int:
    """`value` of the whole-number option `option` of `backend`, checked to lie in [low, high].

    A plain int only: options are kept in the manifest as JSON, and True is no count.

    Raises:
        ConfigError: anything else.
    """
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{backend} option {option} must be an int from {low} to {high}, got "
                          f"{value!r}")
    return value


def table_meta(spec: BackendSpec) -> dict[str, Any]:
    """The metadata record stored with a table: format, dim, dtype."""
    return {"format": FORMAT, "dim": spec.dim, "dtype": spec.dtype.str}


def check_table_meta(spec: BackendSpec, where: object, stored: bytes | None) -> None:
    """Raise ConfigError if the stored metadata record (None: new table) is of another spec."""
    if stored is None:
        return
    found = json.loads(bytes(stored))
    if (found.get("dim"), found.get("dtype")) != (spec.dim, spec.dtype.str):
        raise ConfigError(
            f"table {spec.table!r} in {where} holds rows of dim {found.get('dim')} dtype "
            f"{found.get('dtype')}, the spec asks for dim {spec.dim} dtype {spec.dtype.str}; "
            "open it with its own spec"
        )


class KeyValueBackend(Backend):
    """A backend whose rows are checksummed values under order-preserving 8-byte keys."""

    _rec: np.dtype  # the stored value layout (`_keys.record_dtype`)

    @abstractmethod
    def _where(self) -> str:
        """Where the table lives, for error messages."""

    @abstractmethod
    def _scan_page(self, after: bytes | None, limit: int, values: bool
                   ) -> tuple[list[bytes], list[Any]]:
        """One page of keys in order, and their values if `values`.

        Up to `limit` keys after `after` (None: from the first); raises on a damaged medium rather
        than returning a short page.
        """

    def _assemble(self, uniq: np.ndarray, inverse: np.ndarray,
                  values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Rows and found mask of a batch from the values of its distinct ids (None: absent)."""
        where = self._where()
        if None not in values:
            # Every id stored (the common case): one gather from the checked buffer.
            rows_u = decode_values(uniq, values, self._rec, table=self.spec.table, file=where)
            return rows_u[inverse], np.ones(len(inverse), dtype=bool)
        found_u = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        rows_u = np.zeros((len(uniq), self.spec.dim), dtype=self.spec.dtype)
        if found_u.any():
            rows_u[found_u] = decode_values(uniq[found_u], [v for v in values if v is not None],
                                            self._rec, table=self.spec.table, file=where)
        return rows_u[inverse], found_u[inverse]

    def _scan(self, batch_rows: int, *, values: bool) -> Iterator[tuple[list[bytes], list[Any]]]:
        """Yield (keys, values) in key order, `batch_rows` at a time.

        One page per batch: no iterator or transaction stays open while the caller works.
        """
        after: bytes | None = None
        while True:
            self._check_open()
            keys, vals = self._scan_page(after, batch_rows, values)
            if not keys:
                return
            yield keys, vals
            if len(keys) < batch_rows:
                return
            after = keys[-1]

    def _items(self, batch_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        # in id order, one page per batch
        for keys, vals in self._scan(batch_rows, values=True):
            ids = decode_keys(keys)
            rows = decode_values(ids, vals, self._rec, table=self.spec.table,
                                 file=self._where())
            yield ids, rows.copy()

    def _ids(self) -> np.ndarray:
        parts = [decode_keys(keys) for keys, _ in self._scan(1 << 16, values=False)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
