"""Helpers shared by the key-value backends (rocksdb, lmdb): keys, the value layout, shared handles.

Keys: an int64 id is stored as 8 big-endian bytes with the sign bit flipped, so the byte order
of keys (what RocksDB and LMDB sort by) is the numeric order of ids: -2**63 maps to 8 zero
bytes, -1 to 0x7fff..ff, 0 to 0x8000..00, 2**63 - 1 to 8 0xff bytes.

Values (byte offsets within one stored value; R = BackendSpec.row_bytes):

    offset  size  field
    0       4     CRC-32C, uint32 little-endian, of the id (8 bytes little-endian) ++ payload
    4       R     payload: the row, BackendSpec.dtype, C order

The checksum comes first so that its offset does not depend on the row width. It covers the id
as well as the payload, so a value copied under another key is detected too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import numpy as np

from embstore.checksum import row_checksums, verify_rows
from embstore.errors import ConfigError, CorruptStoreError, StoreLockedError

__all__ = [
    "CRC_OFFSET",
    "CRC_SIZE",
    "PAYLOAD_OFFSET",
    "VALUE_LAYOUT",
    "SharedHandles",
    "decode_keys",
    "decode_values",
    "encode_keys",
    "encode_values",
]

#: (offset, size, field) of each field of a stored value; size None is BackendSpec.row_bytes.
VALUE_LAYOUT: Final = ((0, 4, "crc32c"), (4, None, "payload"))
CRC_OFFSET: Final = 0
CRC_SIZE: Final = 4
PAYLOAD_OFFSET: Final = 4

_SIGN = np.uint64(1 << 63)


def encode_keys(ids: np.ndarray) -> list[bytes]:
    """The 8-byte order-preserving key of each id in `ids` (int64[N])."""
    flipped = ids.view(np.uint64) ^ _SIGN
    return flipped.astype(">u8").view("V8").tolist()  # type: ignore[no-any-return]


def decode_keys(keys: list[bytes] | bytes) -> np.ndarray:
    """int64 ids of 8-byte keys (a list of keys or their concatenation)."""
    buf = keys if isinstance(keys, bytes) else b"".join(keys)
    return (np.frombuffer(buf, dtype=">u8").astype(np.uint64) ^ _SIGN).view(np.int64)


def record_dtype(dtype: np.dtype, dim: int) -> np.dtype:
    """The packed numpy record of one stored value (see the layout above)."""
    return np.dtype([("crc", "<u4"), ("row", dtype, (dim,))])


def encode_values(ids: np.ndarray, rows: np.ndarray, rec: np.dtype) -> list[bytes]:
    """Stored values for `rows` (array[N, dim]) under `ids` (int64[N]), checksums included."""
    packed = np.empty(len(ids), dtype=rec)
    packed["crc"] = row_checksums(ids, rows)
    packed["row"] = rows
    return packed.view(f"V{rec.itemsize}").tolist()  # type: ignore[no-any-return]


def decode_values(ids: np.ndarray, values: list[Any], rec: np.dtype, *, table: str,
                  file: object) -> np.ndarray:
    """Check the values stored under `ids` and return their rows, array[N, dim].

    `values` are bytes-like, one per id. Raises CorruptStoreError naming the table, the id and
    the file when a value has the wrong length or fails its checksum.
    """
    buf = b"".join(values)
    if len(buf) != len(values) * rec.itemsize:
        for i, v in enumerate(values):
            if len(v) != rec.itemsize:
                raise CorruptStoreError(
                    f"table {table!r}: value of id {int(ids[i])} in {file} has {len(v)} bytes, "
                    f"expected {rec.itemsize} (4-byte checksum + row); the data is damaged or "
                    "was written with another dim/dtype: restore the table from a checkpoint"
                )
    packed = np.frombuffer(buf, dtype=rec)
    verify_rows(ids, packed["row"], packed["crc"], table=table, file=file)
    return packed["row"]


H = TypeVar("H")


@dataclass
class _Entry(Generic[H]):
    handle: H
    options: Hashable
    read_only: bool
    refs: int = 0


class SharedHandles(Generic[H]):
    """One open handle per directory and process, shared by the tables of a tier, refcounted.

    RocksDB and LMDB both refuse (or misbehave) when one process opens the same database twice,
    so every backend instance of a directory borrows the same handle; the last release closes it.
    A read-only instance may borrow a read-write handle (the Backend guards reject its writes);
    a read-write instance cannot borrow a read-only handle.
    """

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[H]] = {}

    @staticmethod
    def key(path: Path) -> str:
        """The identity of a directory: its real path."""
        return os.path.realpath(path)

    def acquire(self, key: str, options: Hashable, read_only: bool,
                opener: Callable[[], H]) -> H:
        """Borrow the handle of directory `key` (see `key()`), calling `opener` if none is open.

        Raises:
            ConfigError: the open handle was opened with other options.
            StoreLockedError: the open handle is read-only and a writer asks for it.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = _Entry(opener(), options, read_only)
                self._entries[key] = entry
            else:
                if entry.options != options:
                    raise ConfigError(
                        f"{self._kind} directory {key} is already open in this process with "
                        f"options {entry.options!r}, not {options!r}; every table of a tier "
                        "shares its directory's options: use the same options for all of them"
                    )
                if entry.read_only and not read_only:
                    raise StoreLockedError(
                        f"{self._kind} directory {key} is open read-only in this process; "
                        "close its read-only tables before opening one for writing"
                    )
            entry.refs += 1
            return entry.handle

    def release(self, key: str, closer: Callable[[H], None]) -> None:
        """Return a borrowed handle; the last borrower's release closes it with `closer`."""
        with self._lock:
            entry = self._entries[key]
            entry.refs -= 1
            if entry.refs == 0:
                del self._entries[key]
                closer(entry.handle)
