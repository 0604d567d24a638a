"""The DRAM backend: rows in chunked numpy slabs behind a compact C hash index.

With a path, `flush()` writes a snapshot of the table (`<table>.dram`) to a temporary file,
fsyncs it and renames it over the previous one, so a crash leaves either the old or the new
snapshot, never a mix. This is how an all-DRAM store persists; as a cache tier above another
backend it is opened without a path.

Snapshot layout (little-endian), imported by the corruption tests:

    offset  size  field
    0       8     magic b"EMBSDRAM"
    8       4     format version (1)
    12      4     dim (elements per row)
    16      8     dtype string, NUL-padded (numpy `dtype.str`, e.g. b"<f4")
    24      8     n, number of rows
    32      4     crc32 of the body
    36      4     crc32 of bytes 0..36
    40      24    reserved (zero)
    64      8*n   ids, int64
    64+8n   n*row_bytes rows
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any, ClassVar, final

import numpy as np

from embstore._kernels._dram_index import ffi, lib
from embstore._parallel import run_ranges
from embstore.backend import BackendSpec, SlottedBackend
from embstore.errors import ConfigError, CorruptStoreError
from embstore.index import BucketIdIndex, IdIndex, RowSlabs, c_pointer

__all__ = ["DRAMBackend"]

MAGIC = b"EMBSDRAM"
VERSION = 1
HEADER = struct.Struct("<8sII8sQII24x")
HEADER_SIZE = 64
assert HEADER.size == HEADER_SIZE
OFFSET_CRC_BODY = 32
OFFSET_IDS = HEADER_SIZE


def _crc(data: memoryview | bytes, start: int = 0) -> int:
    return zlib.crc32(data, start) & 0xFFFFFFFF


@final
class DRAMBackend(SlottedBackend):
    """Rows in host memory; optionally snapshotted to `<path>/<table>.dram` on flush."""

    name: ClassVar[str] = "dram"
    supports_persistence: ClassVar[bool] = True  # durable on flush when given a path
    requires_path: ClassVar[bool] = False

    def __init__(self, spec: BackendSpec, *, chunk_rows_log2: int = 16) -> None:
        super().__init__(spec)
        if not 4 <= chunk_rows_log2 <= 24:
            raise ConfigError(f"chunk_rows_log2 must be in [4, 24], got {chunk_rows_log2}")
        # a cache tier (one with a capacity) moves a batch of ids into and out of its index
        # every batch, and probes and removals slow down as clusters grow with the load:
        # it works with room for four times its capacity (load <= 0.25 at capacity; removal
        # ran 2.1x faster at load 0.33 than at 0.66), about 51 bytes of index per cached row.
        # It takes that room as its rows come, 4x at a time, from a small start: a store of
        # many tables pays nothing for the caches of tables it has not used yet, and a cache
        # sized past the machine's memory only for the rows it holds
        rows_hint = spec.capacity_bytes // spec.row_bytes if spec.capacity_bytes else 0
        self._index: IdIndex = BucketIdIndex(min(1024, 4 * rows_hint) if rows_hint else 1024,
                                             working_capacity=4 * rows_hint)
        self._slabs = RowSlabs(spec.dim, spec.dtype, shift=chunk_rows_log2)
        self._dirty_since_flush = False
        self._file = (spec.path / f"{spec.table}.dram") if spec.path is not None else None
        self._chunk_rows_log2 = chunk_rows_log2
        if self._file is not None:
            if not spec.read_only:
                spec.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self._file.exists():
                self._load(self._file)

    def _refresh(self) -> None:
        # the writer replaces the snapshot with a rename at each flush: load the newest
        if self._file is None:
            return
        self._index = BucketIdIndex(1024)
        self._slabs = RowSlabs(self.spec.dim, self.spec.dtype, shift=self._chunk_rows_log2)
        if self._file.exists():
            self._load(self._file)

    # --- snapshot ---------------------------------------------------------------------

    def _load(self, file: Path) -> None:
        data = file.read_bytes()
        if len(data) < HEADER_SIZE:
            raise CorruptStoreError(f"{file}: truncated snapshot header ({len(data)} bytes)")
        magic, version, dim, dtype_s, n, crc_body, crc_head = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise CorruptStoreError(f"{file} is not a DRAM snapshot (bad magic {magic!r})")
        if _crc(memoryview(data)[:36]) != crc_head:
            raise CorruptStoreError(f"{file}: header checksum mismatch; the file is damaged")
        if version != VERSION:
            raise CorruptStoreError(f"{file}: unsupported snapshot version {version}")
        dtype = np.dtype(dtype_s.rstrip(b"\0").decode())
        if dim != self.spec.dim or dtype != self.spec.dtype:
            raise CorruptStoreError(
                f"{file} holds rows of dim {dim} {dtype}, the table expects "
                f"{self.spec.dim} {self.spec.dtype}: the snapshot belongs to another table"
            )
        body = memoryview(data)[HEADER_SIZE:]
        if len(body) != n * (8 + self.spec.row_bytes):
            raise CorruptStoreError(f"{file}: expected {n} rows, the file is truncated or padded")
        if _crc(body) != crc_body:
            raise CorruptStoreError(
                f"{file}: body checksum mismatch; restore the table from a checkpoint"
            )
        ids = np.frombuffer(data, dtype=np.int64, count=n, offset=HEADER_SIZE)
        rows = np.frombuffer(data, dtype=dtype, count=n * dim, offset=HEADER_SIZE + 8 * n)
        self._put(np.ascontiguousarray(ids), rows.reshape(n, dim))
        self._dirty_since_flush = False

    def _write_snapshot(self, file: Path) -> None:
        ids, slots = self._index.items()
        order = np.argsort(ids, kind="stable")  # sorted ids: byte-identical files for equal tables
        ids = np.ascontiguousarray(ids[order])
        rows = self._slabs.gather(np.ascontiguousarray(slots[order]))
        crc_body = _crc(rows.data, _crc(ids.data)) if len(ids) else 0
        head = bytearray(HEADER.pack(MAGIC, VERSION, self.spec.dim,
                                     self.spec.dtype.str.encode(), len(ids), crc_body, 0))
        struct.pack_into("<I", head, 36, _crc(bytes(head[:36])))
        tmp = file.with_name(file.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as fh:
            fh.write(head)
            fh.write(ids.data)
            fh.write(rows.data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, file)
        dir_fd = os.open(file.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # --- Backend ----------------------------------------------------------------------

    def _gather(self, ids: np.ndarray, slots: np.ndarray | None, columns: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        n = len(ids)
        width = self.spec.dim if columns is None else columns
        out = np.empty((n, width), dtype=self.spec.dtype)
        found = np.empty(n, dtype=bool)
        if n:
            table, nb = self._index.buckets()
            slabs, shift = self._slabs.pointer(), self._slabs.shift
            row_bytes = self._slabs.row_bytes
            out_bytes = width * self.spec.dtype.itemsize
            ids_p = c_pointer("int64_t *", ids)
            out_p = c_pointer("char *", out)
            found_p = c_pointer("uint8_t *", found)
            slots_p = ffi.NULL if slots is None else c_pointer("int32_t *", slots)

            def gather(start: int, stop: int) -> None:
                lib.bk_gather(table, nb, slabs, shift, row_bytes, out_bytes, ids_p + start,
                              stop - start, out_p + start * out_bytes, found_p + start,
                              ffi.NULL if slots is None else slots_p + start)

            run_ranges(n, gather)
        return out, found

    def _get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._gather(ids, None)

    @property
    def index(self) -> IdIndex:
        # docstring inherited
        return self._index

    def _get_with_slots(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        slots = np.empty(len(ids), dtype=np.int32)
        rows, found = self._gather(ids, slots)
        return rows, found, slots

    def get_leading(self, ids: np.ndarray, columns: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first `columns` of each row of `get` (C-contiguous), its found mask and slots.

        For readers of weights alone: the optimizer state stored after them is not copied.

        Raises:
            StoreClosedError, InvalidIdsError, ValueError (`columns` out of 1..dim).
        """
        self._check_open()
        ids = self._check_ids(ids)
        if not 0 < columns <= self.spec.dim:
            raise ValueError(f"columns must lie in 1..{self.spec.dim}, got {columns}")
        slots = np.empty(len(ids), dtype=np.int32)
        rows, found = self._gather(ids, slots, columns)
        return rows, found, slots

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self._put_slots(ids, rows)

    def _put_slots(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        slots = self._index.find(ids)
        inserted = slots < 0
        n_new = int(np.count_nonzero(inserted))
        if n_new:
            # room for the new rows before their ids enter the index: where memory runs
            # out (CapacityError), no id points past the chunks and nothing has changed
            self._slabs.ensure(self._index.high_water_after(n_new))
            slots[inserted] = self._index.add_absent(np.ascontiguousarray(ids[inserted]))
        self._slabs.scatter(slots, rows)
        self._dirty_since_flush = True
        return slots, inserted

    def _rows_at(self, slots: np.ndarray) -> np.ndarray:
        return self._slabs.gather(slots)

    def write_at(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Overwrite the rows at live `slots` (int32[N]) of `index`, in order; no hash probe.

        A slot given twice keeps its last row. The in-place counterpart of `rows_at`: the ids
        keep their slots.
        """
        self._check_writable()
        rows = np.ascontiguousarray(rows)
        if rows.dtype != self.spec.dtype or rows.shape != (len(slots), self.spec.dim):
            raise ValueError(f"write_at needs rows of shape ({len(slots)}, {self.spec.dim}) "
                             f"and dtype {self.spec.dtype}")
        self._slabs.scatter(np.ascontiguousarray(slots, dtype=np.int32), rows)
        self._dirty_since_flush = True

    def slabs_for_reading(self) -> RowSlabs:
        """Return the row storage addressed by `index`'s slots, for kernels reading in place.

        The caller holds the store's lock for as long as it reads: nothing may move rows.
        """
        self._check_open()
        return self._slabs

    def slabs_for_writing(self) -> RowSlabs:
        """Return the row storage addressed by `index`'s slots, to overwrite rows in place.

        For kernels stepping optimizers at live slots: the snapshot is stale from now.
        """
        self._check_writable()
        self._dirty_since_flush = True
        return self._slabs

    def _delete(self, ids: np.ndarray) -> np.ndarray:
        found = self._index.remove(ids) >= 0
        self._dirty_since_flush |= bool(found.any())
        return found

    def _contains(self, ids: np.ndarray) -> np.ndarray:
        return self._index.find(ids) >= 0

    def _ids(self) -> np.ndarray:
        return self._index.items()[0]

    def _len(self) -> int:
        return len(self._index)

    def nbytes(self) -> int:
        # docstring inherited
        return self._index.nbytes() + self._slabs.nbytes()

    def statistics(self) -> dict[str, Any]:
        # docstring inherited
        stats = super().statistics()
        stats["index_bytes"] = self._index.nbytes()
        stats["slab_bytes"] = self._slabs.nbytes()
        stats["snapshot"] = str(self._file) if self._file is not None else None
        return stats

    def _flush(self) -> None:
        if self._file is not None and (self._dirty_since_flush or not self._file.exists()):
            self._write_snapshot(self._file)
            self._dirty_since_flush = False

    def _close(self) -> None:
        self._index = BucketIdIndex(16)
        self._slabs = RowSlabs(self.spec.dim, self.spec.dtype)
