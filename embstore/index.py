"""`IdIndex`, a compact hash map from int64 ids to dense int32 slots, and `RowSlabs`.

`RowSlabs` is the chunked row storage addressed by those slots.

Per entry the index costs 12 bytes (int64 key, int32 slot) at a load factor between 0.375 and
0.75, about 20 bytes per id at 10M ids. There is no Python object per id. The probing loops are
a small C kernel (`_kernels/dram_index.c`); everything here works on whole batches.
`BucketIdIndex`, the DRAM tier's index, keeps the same entries in cache-line buckets at a
higher load: one miss per probe and 13.8-14.7 bytes per id (`_kernels/bucket_index.c`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ._kernels._dram_index import ffi, lib
from ._parallel import run_ranges
from .errors import CapacityError

__all__ = ["BucketIdIndex", "HashTable", "IdGroups", "IdIndex", "RowSlabs", "c_pointer",
           "copy_rows"]

_MAX_LOAD = 0.75
_MAX_SLOTS = 2**31 - 1
_CHUNK_BYTES = 1 << 28  # largest chunk of `RowSlabs` (narrower rows than 4 KiB: 2**16 rows)


def c_pointer(ctype: str, arr: np.ndarray) -> Any:
    """A cffi pointer of type `ctype` (e.g. ``"int64_t *"``) to the data of `arr`."""
    # from_buffer takes a tenth of the time of a cast of `arr.ctypes.data`, which a store
    # pays a dozen times per table and call; a strided view has no buffer of its own
    try:
        return ffi.from_buffer(ctype, arr)
    except ValueError:
        return ffi.cast(ctype, arr.ctypes.data)


_ptr = c_pointer


def _allocate(shape: int | tuple[int, ...], dtype: Any, what: str) -> np.ndarray:
    """`np.empty(shape, dtype)`, or CapacityError where the memory cannot be had."""
    try:
        return np.empty(shape, dtype=dtype)
    except (MemoryError, ValueError) as exc:  # ValueError: past numpy's largest array
        nbytes = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
        raise CapacityError(f"cannot allocate {nbytes:,} bytes for {what} ({exc})",
                            "give the tier a smaller capacity or the table a smaller dim, "
                            "or use a tier below DRAM") from None


def copy_rows(dst: np.ndarray, dst_idx: np.ndarray | None, src: np.ndarray,
              src_idx: np.ndarray | None) -> None:
    """``dst[dst_idx] = src[src_idx]`` in one pass.

    For C-contiguous 2-D arrays of one dtype and width (None: all rows in order). Indices are
    int64 and must be in range.
    """
    n = len(dst_idx) if dst_idx is not None else len(src_idx) if src_idx is not None \
        else len(src)
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:] or not (
            dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError("copy_rows needs C-contiguous arrays of one dtype and row shape")
    if n:
        # keep the converted index arrays bound: a pointer does not keep its array alive
        d = None if dst_idx is None else np.ascontiguousarray(dst_idx, dtype=np.int64)
        s = None if src_idx is None else np.ascontiguousarray(src_idx, dtype=np.int64)
        lib.copy_rows(_ptr("char *", dst), ffi.NULL if d is None else _ptr("int64_t *", d),
                      _ptr("char *", src), ffi.NULL if s is None else _ptr("int64_t *", s),
                      n, dst.strides[0])


class HashTable:
    """The open-addressing table from int64 ids to int32 values (slots).

    The C kernels probe it; subclasses decide which slot an id gets.
    """

    def __init__(self, initial_capacity: int = 1024) -> None:
        cap = 1 << max(4, int(initial_capacity - 1).bit_length())
        self._keys = np.empty(cap, dtype=np.int64)
        self._vals = np.full(cap, -1, dtype=np.int32)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def nbytes(self) -> int:
        """Bytes held by the hash arrays."""
        return self._keys.nbytes + self._vals.nbytes

    def pointers(self) -> tuple[object, object, int]:
        """(keys, vals, mask) for kernels that probe the index themselves."""
        return (_ptr("int64_t *", self._keys), _ptr("int32_t *", self._vals),
                len(self._keys) - 1)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """int32 slots of `ids` (int64[N], C-contiguous), -1 where absent."""
        out = np.empty(len(ids), dtype=np.int32)
        if len(ids):
            keys, vals, mask = self.pointers()
            lib.idx_find(keys, vals, mask, _ptr("int64_t *", ids), len(ids),
                         _ptr("int32_t *", out))
        return out

    def _reserve(self, n_new: int) -> None:
        need = self._count + n_new
        cap = len(self._keys)
        if need <= cap * _MAX_LOAD:
            return
        while need > cap * _MAX_LOAD:
            cap *= 2
        keys = _allocate(cap, np.int64, "the id index")
        vals = _allocate(cap, np.int32, "the id index")
        vals.fill(-1)
        lib.idx_rehash(_ptr("int64_t *", self._keys), _ptr("int32_t *", self._vals),
                       len(self._keys), _ptr("int64_t *", keys), _ptr("int32_t *", vals),
                       cap - 1)
        self._keys, self._vals = keys, vals

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Remove distinct `ids`; returns their int32 slots, -1 where absent."""
        out = np.empty(len(ids), dtype=np.int32)
        if len(ids):
            self._count -= self._remove_entries(ids, out)
        return out

    def _remove_entries(self, ids: np.ndarray, out: np.ndarray) -> int:
        keys, vals, mask = self.pointers()
        return int(lib.idx_remove(keys, vals, mask, _ptr("int64_t *", ids), len(ids),
                                  _ptr("int32_t *", out)))

    def _insert_absent(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Enter distinct `ids`, none present, at `slots` (room reserved by `_reserve`)."""
        keys, vals, mask = self.pointers()
        lib.idx_insert(keys, vals, mask, _ptr("int64_t *", ids), _ptr("int32_t *", slots),
                       len(ids))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64[M], slots int32[M]) of every live entry, in hash-table order."""
        ids = np.empty(self._count, dtype=np.int64)
        slots = np.empty(self._count, dtype=np.int32)
        if self._count:
            lib.idx_items(_ptr("int64_t *", self._keys), _ptr("int32_t *", self._vals),
                          len(self._keys), _ptr("int64_t *", ids), _ptr("int32_t *", slots))
        return ids, slots


class IdIndex(HashTable):
    """Map distinct int64 ids to slots 0..high_water-1; freed slots are reused first."""

    def __init__(self, initial_capacity: int = 1024) -> None:
        super().__init__(initial_capacity)
        self._high_water = 0  # slots ever handed out; slots below it are live or free
        self._free = np.empty(0, dtype=np.int32)
        self._n_free = 0
        self._removals = 0

    @property
    def high_water(self) -> int:
        """One past the largest slot ever handed out."""
        return self._high_water

    def high_water_after(self, n: int) -> int:
        """`high_water` once `n` more ids are added (freed slots are handed out first)."""
        return self._high_water + max(0, n - self._n_free)

    @property
    def removals(self) -> int:
        """Calls of `remove` that freed a slot so far.

        An id keeps its slot until it is removed (inserts and growth move entries, never
        slots), so slots found while this count stands are still the ids' slots.
        """
        return self._removals

    def nbytes(self) -> int:
        """Bytes held by the hash arrays and the free list."""
        return super().nbytes() + self._free.nbytes

    def _allocate(self, n: int) -> np.ndarray:
        from_free = min(n, self._n_free)
        fresh = n - from_free
        if self._high_water + fresh > _MAX_SLOTS:
            raise CapacityError(
                f"an index holds at most {_MAX_SLOTS} rows, {self._count + n} requested",
                "split the table across shards or tiers",
            )
        slots = np.empty(n, dtype=np.int32)
        # reuse the most recently freed slots first: their slab pages are likely still cached
        slots[:from_free] = self._free[self._n_free - from_free : self._n_free][::-1]
        self._n_free -= from_free
        slots[from_free:] = np.arange(self._high_water, self._high_water + fresh, dtype=np.int32)
        self._high_water += fresh
        return slots

    def add(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slots for distinct `ids`, inserting the absent ones.

        Returns:
            slots: int32[N], the slot of every id.
            inserted: bool[N], True where the id was new.
        """
        slots = self.find(ids)
        inserted = slots < 0
        if inserted.any():
            slots[inserted] = self.add_absent(np.ascontiguousarray(ids[inserted]))
        return slots, inserted

    def add_absent(self, ids: np.ndarray) -> np.ndarray:
        """Insert distinct `ids` (int64[N], C-contiguous) that the caller knows are absent.

        Returns their new int32 slots. No probe first: an id already present would be
        entered twice.
        """
        if len(ids):
            self._reserve(len(ids))  # first: a failure to grow then hands out no slot
        slots = self._allocate(len(ids))
        if len(ids):
            self._insert_absent(ids, slots)
            self._count += len(ids)
        return slots

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Remove `ids` (distinct); returns the freed int32 slots, -1 where absent."""
        out = super().remove(ids)
        freed = out[out >= 0]
        if len(freed):
            self._removals += 1
            if self._n_free + len(freed) > len(self._free):
                grown = np.empty(max(2 * len(self._free), self._n_free + len(freed)), np.int32)
                grown[: self._n_free] = self._free[: self._n_free]
                self._free = grown
            self._free[self._n_free : self._n_free + len(freed)] = freed
            self._n_free += len(freed)
        return out


class BucketIdIndex(IdIndex):
    """`IdIndex` over 64-byte buckets of five (id, slot) entries (`_kernels/bucket_index.c`).

    A probe usually costs one cache miss (the bucket), where `IdIndex`'s split key and slot
    arrays cost two; bucket counts need not be powers of two, so the load stays between 0.87
    and 0.93 as the index grows: 12.8 bytes per entry, 13.8-14.7 bytes per id (`IdIndex`:
    16-32).
    Kernels that probe it use `buckets()`, not `pointers()`.
    """

    # Loads stay in [GROWN_LOAD, MAX_LOAD] once the index is past its initial size: growing
    # sizes it for GROWN_LOAD, or by GROWTH = MAX_LOAD / GROWN_LOAD where that is more, so a
    # small batch over MAX_LOAD grows it by 7% (rehashing stays amortised: ~15 moves per id).
    # Measured on 4M ids, 65K probes: hits 1.2 ms at load 0.6, 1.8 at 0.85, 2.2 at 0.93;
    # misses (new ids) 1.6, 5.2, 11.0 ms: the price of 14.7 bytes per id instead of 21.
    MAX_LOAD = 0.93
    GROWN_LOAD = 0.87
    GROWTH = MAX_LOAD / GROWN_LOAD
    FILL_LOAD = 0.25  # the load of a cache at its size in its working room (`__init__`)

    def __init__(self, initial_capacity: int = 1024, *, working_capacity: int = 0) -> None:
        """Make an empty index for `initial_capacity` ids.

        Args:
            initial_capacity: ids it holds before it first grows.
            working_capacity: entries it makes room for as it fills (a cache: four times
                its size). Until it has that room it grows 4x whenever its load passes
                `FILL_LOAD`, so a cache that reaches its size has its working room, and one
                whose size is far beyond its rows (or the machine) holds room for what it
                holds. An empty table costs little.
        """
        self._count = 0
        self._high_water = 0
        self._free = np.empty(0, dtype=np.int32)
        self._n_free = 0
        self._removals = 0
        self._working_buckets = -(-int(working_capacity) // 5)
        self._alloc(max(4, -(-int(initial_capacity) // 5)))

    def _alloc(self, nb: int) -> None:
        raw = _allocate(nb * 64 + 64, np.uint8, "the id index")
        start = -raw.ctypes.data % 64  # one bucket per cache line
        table = raw[start : start + nb * 64].view(np.int32).reshape(nb, 16)
        table[:, 10:15] = -1  # every entry empty
        self._raw, self._table, self._nb = raw, table, nb

    def buckets(self) -> tuple[object, int]:
        """(`bucket_t *`, bucket count) for kernels that probe the index."""
        return _ptr("bucket_t *", self._table), self._nb

    def pointers(self) -> tuple[object, object, int]:
        """Not available: entries live in buckets (see `buckets`)."""
        raise TypeError("a BucketIdIndex has no split key/slot arrays; use buckets()")

    def nbytes(self) -> int:
        """Bytes held by the buckets and the free list."""
        return self._raw.nbytes + self._free.nbytes

    def find(self, ids: np.ndarray) -> np.ndarray:
        """int32 slots of `ids` (int64[N], C-contiguous), -1 where absent."""
        out = np.empty(len(ids), dtype=np.int32)
        if len(ids):
            table, nb = self.buckets()
            ids_p: Any = _ptr("int64_t *", ids)
            out_p: Any = _ptr("int32_t *", out)
            run_ranges(len(ids), lambda start, stop: lib.bk_find(
                table, nb, ids_p + start, stop - start, out_p + start))
        return out

    def _reserve(self, n_new: int) -> None:
        need = self._count + n_new
        filling = self._nb < self._working_buckets
        if need <= self._nb * 5 * (self.FILL_LOAD if filling else self.MAX_LOAD):
            return
        old_raw, (old, old_nb) = self._raw, self.buckets()
        grown = max(int(need / self.GROWN_LOAD / 5), int(old_nb * self.GROWTH))
        if filling:
            grown = max(grown, min(self._working_buckets,
                                   max(4 * old_nb, int(need / self.FILL_LOAD / 5))))
        self._alloc(grown + 1)
        table, nb = self.buckets()
        lib.bk_rehash(old, old_nb, table, nb)
        del old_raw

    def _insert_absent(self, ids: np.ndarray, slots: np.ndarray) -> None:
        table, nb = self.buckets()
        lib.bk_insert(table, nb, _ptr("int64_t *", ids), _ptr("int32_t *", slots), len(ids))

    def _remove_entries(self, ids: np.ndarray, out: np.ndarray) -> int:
        table, nb = self.buckets()
        return int(lib.bk_remove(table, nb, _ptr("int64_t *", ids), len(ids),
                                 _ptr("int32_t *", out)))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64[M], slots int32[M]) of every live entry, in table order."""
        ids = np.empty(self._count, dtype=np.int64)
        slots = np.empty(self._count, dtype=np.int32)
        if self._count:
            table, nb = self.buckets()
            lib.bk_items(table, nb, _ptr("int64_t *", ids), _ptr("int32_t *", slots))
        return ids, slots


class RowSlabs:
    """Rows of a fixed width in chunks of 2**shift rows, addressed by int32 slot.

    Chunks let a table grow without copying its payload or briefly needing twice its memory.
    """

    def __init__(self, dim: int, dtype: np.dtype, shift: int = 16) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.row_bytes = dim * self.dtype.itemsize
        # wide rows take fewer rows a chunk: 2**16 rows of 1 MiB would ask for 64 GiB at the
        # first row. Rows of up to 4 KiB keep 2**16 (a chunk of at most 256 MiB)
        fit = (_CHUNK_BYTES // self.row_bytes).bit_length() - 1 if self.row_bytes else shift
        self.shift = max(0, min(shift, fit))
        self._chunks: list[np.ndarray] = []
        self._ptrs = np.zeros(0, dtype=np.uint64)

    def nbytes(self) -> int:
        """Bytes allocated for rows (whole chunks)."""
        return sum(c.nbytes for c in self._chunks) + self._ptrs.nbytes

    def ensure(self, high_water: int) -> None:
        """Allocate chunks until slots below `high_water` are addressable."""
        need = (high_water + (1 << self.shift) - 1) >> self.shift
        if need <= len(self._chunks):
            return
        if need > _MAX_SLOTS >> self.shift:  # past the slots an index hands out
            raise CapacityError(f"{high_water} rows are more than a table's slots "
                                f"({_MAX_SLOTS})", "split the table across shards or tiers")
        added: list[np.ndarray] = []  # all or none: a failure keeps the chunks as they were
        width = max(self.dim, 1)
        chunk_bytes = (1 << self.shift) * width * self.dtype.itemsize
        while len(self._chunks) + len(added) < need:
            # np.empty of a large block maps fresh pages lazily: untouched rows cost no RSS.
            # Chunks start on a cache line: a 256-byte row then spans 4 lines, not 5
            raw = _allocate(chunk_bytes + 64, np.uint8,
                            f"{1 << self.shift} rows of {self.row_bytes} bytes")
            start = -raw.ctypes.data % 64
            chunk = raw[start : start + chunk_bytes]
            added.append(chunk.view(self.dtype).reshape(1 << self.shift, width))
        self._chunks.extend(added)
        self._ptrs = np.array([c.ctypes.data for c in self._chunks], dtype=np.uint64)

    def pointer(self) -> object:
        """`char **` to the chunk table, for kernels."""
        return _ptr("char **", self._ptrs)

    def gather(self, slots: np.ndarray) -> np.ndarray:
        """Rows at `slots` (int32[N], all valid) as a new array[N, dim]."""
        out = np.empty((len(slots), self.dim), dtype=self.dtype)
        if len(slots) and self.row_bytes:
            lib.slab_gather(self.pointer(), self.shift, self.row_bytes,
                            _ptr("int32_t *", slots), len(slots), _ptr("char *", out))
        return out

    def scatter(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Write C-contiguous `rows` (array[N, dim]) to `slots` (int32[N], all valid)."""
        if len(slots) and self.row_bytes:
            lib.slab_scatter(self.pointer(), self.shift, self.row_bytes,
                             _ptr("int32_t *", slots), len(slots), _ptr("char *", rows))


_GROUP_SLOT_BYTES = 16  # group_slot_t: key int64, group int32, epoch uint32
_KEPT_GROUP_SLOTS = 1 << 20
"""Largest grouping table a thread keeps for its next batch (16 MiB); larger ones are freed."""
_group_tables = threading.local()


def _group_table(cap: int) -> tuple[np.ndarray, int]:
    """A grouping table of at least `cap` slots for this thread, and the epoch to mark it with.

    The table is kept for the thread's next batch: slots of older epochs read as empty, so no
    call pays for clearing it (nor for the page faults of a fresh allocation).
    """
    table = getattr(_group_tables, "table", None)
    epoch = getattr(_group_tables, "epoch", 0) + 1
    if table is None or len(table) < cap * _GROUP_SLOT_BYTES or epoch > 0xFFFFFFFF:
        table = np.zeros(cap * _GROUP_SLOT_BYTES, dtype=np.uint8)  # every epoch 0: empty
        epoch = 1
        if cap > _KEPT_GROUP_SLOTS:
            return table, epoch
        _group_tables.table = table
    _group_tables.epoch = epoch
    return table, epoch


class IdGroups:
    """The distinct ids of a batch, in order of first occurrence, with the map back.

    Attributes:
        unique: int64[U], distinct ids in order of first occurrence.
        inverse: int64[N], group of each input position (`unique[inverse] == ids`).
        last: int64[U], last position of each group (for last-write-wins updates).
    """

    __slots__ = ("inverse", "last", "unique")

    def __init__(self, ids: np.ndarray) -> None:
        n = len(ids)
        unique = np.empty(n, dtype=np.int64)
        self.inverse = np.empty(n, dtype=np.int64)
        last = np.empty(n, dtype=np.int64)
        groups = 0
        if n:
            cap = 1 << max(4, int(2 * n - 1).bit_length())
            table, epoch = _group_table(cap)
            groups = lib.group_ids(_ptr("int64_t *", ids), n, _ptr("group_slot_t *", table),
                                   cap - 1, epoch, _ptr("int64_t *", unique),
                                   _ptr("int64_t *", self.inverse), _ptr("int64_t *", last))
        self.unique = unique[:groups]
        self.last = last[:groups]

    def sum_rows(self, rows: np.ndarray) -> np.ndarray:
        """Sum the rows (array[N, D]) of each group, adding in position order.

        Returns array[U, D]; bit-identical to ``np.add.at(zeros, inverse, rows)``.
        """
        rows = np.ascontiguousarray(rows)
        out = np.zeros((len(self.unique), rows.shape[1]), dtype=rows.dtype)
        kernel = {np.dtype(np.float32): (lib.scatter_add_f32, "float *"),
                  np.dtype(np.float64): (lib.scatter_add_f64, "double *")}.get(rows.dtype)
        if kernel is None:
            np.add.at(out, self.inverse, rows)  # unbuffered: adds in position order too
        elif len(rows):
            fn, ctype = kernel
            fn(_ptr("int64_t *", self.inverse), len(rows), rows.shape[1], _ptr(ctype, rows),
               _ptr(ctype, out))
        return out

    @property
    def has_duplicates(self) -> bool:
        """Whether any id occurs more than once."""
        return len(self.unique) != len(self.inverse)
