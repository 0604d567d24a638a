"""Per-row CRC-32C over (id, payload), computed for a whole batch in one C call.

Every persistent backend stores this checksum with each row and verifies it on read; a
mismatch raises `CorruptStoreError` naming the table, the id and the file.
"""

from __future__ import annotations

import numpy as np

from ._kernels._checksum import ffi, lib
from .errors import CorruptStoreError

__all__ = ["crc32c", "row_checksums", "uses_hardware", "verify_rows"]


def row_checksums(ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """uint32[N]: CRC-32C of each id (8 little-endian bytes) followed by its row's bytes.

    `rows` is array[N, ...] whose rows are contiguous (rows may be strided records, e.g. a
    view of a structured array, as long as each row's bytes are contiguous).
    """
    ids = np.ascontiguousarray(ids, dtype="<i8")
    n = len(ids)
    out = np.empty(n, dtype=np.uint32)
    if n == 0:
        return out
    if rows.shape[0] != n:
        raise ValueError(f"{n} ids but {rows.shape[0]} rows")
    row_bytes = rows.dtype.itemsize * int(np.prod(rows.shape[1:], dtype=np.int64))
    stride = rows.strides[0] if n > 1 else row_bytes
    if rows.ndim > 1 and not rows[0].flags.c_contiguous:
        rows = np.ascontiguousarray(rows)
        stride = row_bytes
    lib.crc32c_rows(ffi.cast("int64_t *", ids.ctypes.data), ffi.cast("char *", rows.ctypes.data),
                    n, row_bytes, stride, ffi.cast("uint32_t *", out.ctypes.data))
    return out


def verify_rows(ids: np.ndarray, rows: np.ndarray, stored: np.ndarray, *, table: str,
                file: object) -> None:
    """Raise `CorruptStoreError` naming the first id whose stored checksum does not match."""
    bad = np.flatnonzero(row_checksums(ids, rows) != stored)
    if len(bad):
        raise CorruptStoreError(
            f"table {table!r}: row of id {int(ids[bad[0]])} in {file} fails its checksum "
            f"({len(bad)} bad row(s) in this batch); the data is damaged: restore the table "
            "from a checkpoint, or run `embstore fsck` to list every damaged row"
        )


def crc32c(data: bytes | memoryview | np.ndarray) -> int:
    """CRC-32C of a buffer."""
    if isinstance(data, np.ndarray):
        buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    return int(lib.crc32c_buffer(ffi.cast("char *", buf.ctypes.data), len(buf)))


def uses_hardware() -> bool:
    """Whether the CPU's CRC-32C instruction is in use."""
    return bool(lib.crc32c_uses_hardware())
