"""The pmem backend: a file of fixed-size slot records, mapped byte-addressably.

Each table is one file, `<path>/<table>.pmem`, mapped whole with libpmem's `pmem_map_file`
(bound with cffi, see `embstore._libpmem`). Rows are read and written in place in the mapping,
with no block layer in between. `flush()` makes writes durable with pmem_flush/pmem_drain
(`pmem_persist`) of the dirty cache lines where the file is on persistent memory (a DAX file
system), and elsewhere by writing back only the dirty pages: the msync path (see
`PmemBackend._persist_slots` for why it is sync_file_range of each dirty range plus one
fdatasync rather than one msync per range). Without libpmem, or with
`EMBSTORE_PMEM_FORCE_MMAP=1`, the file is mapped with Python's `mmap` instead; `statistics()`
says which (`libpmem`, `is_pmem`). The file format is the same either way.

Updates of flushed rows are out of place: a put writes a complete new record, with a higher
sequence number, to a free slot; the slot of the previous version is retired (its seq word
zeroed) only at the next flush, after the new version is durable. A row written again before
that flush is rewritten in its new slot, which holds nothing a flush has promised. A delete
retires the row's slot at flush the same way. Reopening scans every record (vectorised) and
keeps, per id, the valid record with the highest seq. So a crash never loses a row acknowledged
by a flush and never yields a torn row.

The file layout (header, state blocks, records) is documented, with its byte offsets, in
`backends/_pmem_format.py`; the names are re-exported here for the corruption tests.

Caveats:
    - One writer per table file (an exclusive `flock`). Read-only handles take no lock and
      read beside the writer, in this process or another: each scan sees every row as of
      the writer's last flush (or later), and rows are checked as they are copied out, so
      a slot the writer retires or reuses meanwhile makes the reader scan again, never
      return a torn or foreign row.
    - The mapping is advised MADV_RANDOM so that the page cache holds the file in 4 KiB pages:
      write-back is by whole cached folio, and a file cached in large folios (e.g. after `cp`
      or `cat` of it) costs up to a folio per dirty row on the msync path until evicted.
    - A flush of scattered updates writes about one 4 KiB page per row on the msync path (the
      retired old versions; new versions are packed, see `PmemBackend._alloc`), one cache
      line or two on persistent memory. An update is written twice (new record, retirement).
    - Crash safety against power loss on the msync path assumes what fdatasync promises; a
      process crash (SIGKILL) loses nothing the page cache holds.
    - At most 2**31 - 1 slots per table file (the slot index stores int32 slots).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import struct
from pathlib import Path
from typing import Any, ClassVar, final

import numpy as np

from embstore import _libpmem
from embstore._kernels import _pmem_records
from embstore._unique import unique_sorted
from embstore.backend import Backend, BackendSpec
from embstore.checksum import crc32c, row_checksums
from embstore.errors import CapacityError, ConfigError, CorruptStoreError, StoreLockedError

from ._pmem_format import (
    _DIRTY,
    _FREE,
    _LIVE,
    _RETIRE,
    CACHE_LINE,
    DATA_OFFSET,
    GATHER_GROUP,
    HEADER,
    HEADER_CRC_OFFSET,
    KIND_ROW,
    MAGIC,
    MAX_SLOTS,
    PAGE_SIZE,
    READER_SCAN_SLOTS,
    READER_SCANS,
    REC_CRC,
    REC_ID,
    REC_KIND,
    REC_PAYLOAD,
    REC_SEQ,
    SCAN_SLOTS,
    SEGMENT_SLOTS,
    STATE,
    STATE_OFFSETS,
    VERSION,
    _merge_ranges,
    _SlotIndex,
    current_state,
    record_size,
    seq_counters,
    seq_words,
)

# the backend, and the file-format names the corruption tests import (see _pmem_format)
__all__ = ["DATA_OFFSET", "HEADER_CRC_OFFSET", "REC_CRC", "REC_ID", "REC_KIND", "REC_PAYLOAD",
           "REC_SEQ", "STATE", "STATE_OFFSETS", "PmemBackend", "record_size", "seq_counters",
           "seq_words"]

ffi, lib = _pmem_records.ffi, _pmem_records.lib

@final
class PmemBackend(Backend):
    """Rows in a file of slot records mapped with libpmem (or mmap), durable on flush."""

    name: ClassVar[str] = "pmem"
    supports_persistence: ClassVar[bool] = True

    def __init__(self, spec: BackendSpec, *, growth_factor: float = 2.0,
                 seq_reserve: int = 1 << 20) -> None:
        """Open or create `<spec.path>/<spec.table>.pmem`.

        Args:
            spec: path, dim, dtype, table; `capacity_bytes` sizes a new file (it grows).
            growth_factor: the file grows to at least this multiple of its slots when full.
            seq_reserve: seqs handed out per durable header update (see the module doc).

        Raises:
            ConfigError: no path, or an invalid option.
            CorruptStoreError: the file is not a pmem table of this spec, or a record that a
                flush made durable fails its checksum.
            StoreLockedError: another handle writes the table (or reads it, for a writer).
            CapacityError: the disk cannot hold the initial file.
        """
        super().__init__(spec)
        if spec.path is None:
            raise ConfigError("the pmem backend stores a file; give BackendSpec a path")
        if growth_factor < 1.1:
            raise ConfigError(f"growth_factor must be at least 1.1, got {growth_factor}")
        if seq_reserve < 1:
            raise ConfigError(f"seq_reserve must be positive, got {seq_reserve}")
        self._growth = growth_factor
        self._seq_reserve_step = seq_reserve
        self._row_bytes = spec.row_bytes
        self._rec = record_size(self._row_bytes)
        self._file = Path(spec.path) / f"{spec.table}.pmem"
        self._lib = None if _libpmem.force_mmap() else _libpmem.load()
        self._map: _libpmem.Mapping | None = None
        self._mem: np.ndarray | None = None  # uint8 view of the mapping; None once unmapped
        self._fd = -1
        self._capacity = 0
        self._index = _SlotIndex()
        self._state = np.zeros(0, dtype=np.uint8)
        self._seg_free = np.zeros(0, dtype=np.int64)  # free slots per segment
        self._free_count = 0
        self._touched: list[np.ndarray] = []
        self._retire: list[np.ndarray] = []
        self._gen = 0
        self._watermark = 0
        self._reserve = 0
        self._next_seq = 1
        self._torn_ignored = 0
        self._stale_retired = 0
        try:
            self._open_file()
        except BaseException:
            self._release()
            raise

    # --- files and mapping ----------------------------------------------------------------

    def _open_file(self) -> None:
        created = False
        if not self._file.exists():
            if self.spec.read_only:
                return  # nothing written yet: an empty, unmapped table
            self._file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            created = self._create()
        flags = os.O_RDONLY if self.spec.read_only else os.O_RDWR
        not_a_file = CorruptStoreError(
            f"{self._file} is not a regular file (a directory or a device was put in its "
            "place); restore the table's file from a checkpoint (`embstore fsck` lists "
            "what is damaged)")
        try:
            # O_NONBLOCK: a named pipe put in the file's place would block the open until a
            # writer came (it changes nothing for a regular file)
            self._fd = os.open(self._file, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except IsADirectoryError:
            raise not_a_file from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            self._fd = -1
            raise not_a_file
        if not self.spec.read_only:
            # one writer per table file; readers take no lock and read beside it
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreLockedError(
                    f"{self._file} is open for writing in another handle or process; close "
                    "it there first (one writer per pmem table; readers may join it)"
                ) from None
        size = os.fstat(self._fd).st_size
        if size < DATA_OFFSET:
            raise CorruptStoreError(f"{self._file}: truncated header ({size} bytes)")
        if (size - DATA_OFFSET) // self._rec > MAX_SLOTS:
            # never written so (the slot index is 32-bit): grown by damage (a truncate out
            # to a terabyte, say), refused before a scan of it would read it all
            raise CorruptStoreError(
                f"{self._file}: {size} bytes hold more than the {MAX_SLOTS} slots a table file "
                "has at most; the file is damaged or not embstore's: restore the table from "
                "a checkpoint (`embstore fsck` lists what is damaged)")
        self._map_file(size)
        self._check_header()
        if self.spec.read_only:
            self._scan_beside_writer()
        else:
            self._scan(empty=created)

    def _create(self) -> bool:
        """Write a new file under a temporary name and link it into place.

        A crash during creation leaves no half-written table behind. Returns False where
        another process created the file first.
        """
        hint = self.spec.capacity_bytes
        if hint is not None:
            slots = max(64, (hint - DATA_OFFSET) // self._rec)
            asked = hint // self.spec.row_bytes  # the tier's capacity in rows
            if asked > MAX_SLOTS:
                raise CapacityError(
                    f"table {self.spec.table!r}: a pmem file holds at most {MAX_SLOTS} rows, "
                    f"and the tier's capacity asks for {asked}",
                    "give the pmem tier a smaller capacity, or split the table across shards "
                    "or tiers")
        else:
            # 64 KiB; it grows geometrically. Small, so that a store of many tables does not
            # hold a megabyte of file per table it has not written yet
            slots = max(64, (64 << 10) // self._rec)
        head = bytearray(DATA_OFFSET)
        HEADER.pack_into(head, 0, MAGIC, VERSION, self.spec.dim, self.spec.dtype.str.encode(),
                         self._rec, REC_PAYLOAD, 0)
        struct.pack_into("<I", head, HEADER_CRC_OFFSET, crc32c(bytes(head[:HEADER_CRC_OFFSET])))
        self._pack_state(head, gen=1, watermark=0, reserve=0)
        tmp = self._file.with_name(f"{self._file.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            os.pwrite(fd, bytes(head), 0)
            self._fallocate(fd, DATA_OFFSET + slots * self._rec, DATA_OFFSET, tmp)
            os.fsync(fd)
            created = True
            try:
                os.link(tmp, self._file)
            except FileExistsError:  # another process created it first
                created = False
        finally:
            os.close(fd)
            tmp.unlink(missing_ok=True)
        dir_fd = os.open(self._file.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return created

    def _fallocate(self, fd: int, size: int, old_size: int, file: Path) -> None:
        """Reserve disk blocks for `size` bytes, or raise CapacityError leaving `old_size`.

        The blocks must exist before the mapping covers them: a store into a sparse page
        that the disk cannot back kills the process with SIGBUS instead of raising.
        """
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            with contextlib.suppress(OSError):
                os.ftruncate(fd, old_size)
            raise CapacityError(
                f"table {self.spec.table!r}: cannot grow {file} from {old_size} to {size} "
                f"bytes ({os.strerror(exc.errno or 0)})",
                "free disk space or give the pmem tier a larger device; the table keeps "
                "every row it had",
            ) from exc

    def _map_file(self, size: int) -> None:
        self._map = _libpmem.map_file(self._lib, str(self._file), self._fd, size,
                                      writable=not self.spec.read_only)
        # 4 KiB page-cache pages keep msync to the pages actually dirtied (see Caveats)
        lib.rec_madvise(ffi.cast("void *", self._map.address), self._map.length,
                        mmap.MADV_RANDOM)
        self._mem = np.frombuffer(self._map.buffer(), dtype=np.uint8)
        if self.spec.read_only:
            self._mem.flags.writeable = False
        self._capacity = (self._map.length - DATA_OFFSET) // self._rec

    def _unmap(self) -> None:
        # drop every view before unmapping: the sentinel None makes any later use fail
        # loudly instead of touching unmapped memory
        self._mem = None
        if self._map is not None:
            m, self._map = self._map, None
            m.unmap()

    def _release(self) -> None:
        try:
            self._unmap()
        finally:
            if self._fd >= 0:
                fd, self._fd = self._fd, -1
                os.close(fd)

    def _records(self) -> np.ndarray:
        """The record array as uint8[capacity, record size] (a view of the mapping)."""
        assert self._mem is not None
        return self._mem[DATA_OFFSET : DATA_OFFSET + self._capacity * self._rec].reshape(
            self._capacity, self._rec)

    def _field(self, offset: int, dtype: str) -> np.ndarray:
        """One header field of every record, as a strided view of the mapping."""
        assert self._mem is not None
        item = np.dtype(dtype)
        return np.ndarray((self._capacity,), dtype=item, buffer=self._mem,
                          offset=DATA_OFFSET + offset, strides=(self._rec,))

    def _base(self) -> Any:
        return ffi.cast("char *", self._map.address + DATA_OFFSET if self._map else 0)

    # --- header ---------------------------------------------------------------------------

    @staticmethod
    def _pack_state(buf: Any, *, gen: int, watermark: int, reserve: int) -> None:
        block = bytearray(STATE.pack(gen, watermark, reserve, 0))
        struct.pack_into("<I", block, 24, crc32c(bytes(block[:24])))
        off = STATE_OFFSETS[gen % 2]
        buf[off : off + STATE.size] = block

    def _check_header(self) -> None:
        assert self._mem is not None
        head = self._mem[:DATA_OFFSET].tobytes()
        magic, version, dim, dtype_s, rec, payload, crc = HEADER.unpack_from(head)
        if magic != MAGIC:
            raise CorruptStoreError(f"{self._file} is not a pmem table (bad magic {magic!r})")
        if crc32c(head[:HEADER_CRC_OFFSET]) != crc:
            raise CorruptStoreError(f"{self._file}: header checksum mismatch; the file is "
                                    "damaged: restore the table from a checkpoint")
        if version != VERSION:
            raise CorruptStoreError(f"{self._file}: unsupported format version {version}")
        dtype = np.dtype(dtype_s.rstrip(b"\0").decode())
        if (dim, dtype) != (self.spec.dim, self.spec.dtype):
            raise CorruptStoreError(
                f"{self._file} holds rows of dim {dim} {dtype}, the table expects "
                f"{self.spec.dim} {self.spec.dtype}: the file belongs to another table"
            )
        if rec != self._rec or payload != REC_PAYLOAD:
            raise CorruptStoreError(f"{self._file}: record size {rec}/{payload}, expected "
                                    f"{self._rec}/{REC_PAYLOAD}; the header is damaged")
        best = current_state(head)
        if best is None:
            raise CorruptStoreError(f"{self._file}: both header state blocks are damaged; "
                                    "restore the table from a checkpoint")
        self._gen, self._watermark, self._reserve = best

    def _write_state(self) -> None:
        """Persist (gen+1, watermark, reserve) into the older state block.

        A crash mid-write damages only that block; the other still holds the previous state,
        which is safe: an older watermark only makes fewer damaged records provable, and the
        reserve is raised before any seq above the old one is written.
        """
        assert self._mem is not None and self._map is not None
        self._gen += 1
        self._pack_state(self._mem, gen=self._gen, watermark=self._watermark,
                         reserve=self._reserve)
        self._map.persist(STATE_OFFSETS[self._gen % 2], STATE.size)

    # --- open-time scan -------------------------------------------------------------------

    def _scan(self, *, empty: bool = False) -> None:
        """Rebuild the index from every record.

        Numpy over the mapped record array, in chunks of SCAN_SLOTS slots so the temporaries stay
        bounded whatever the file's size. A file this handle just created (`empty`) holds no
        record: its pages are left untouched.
        """
        assert self._map is not None
        n = self._capacity
        self._state = np.zeros(n, dtype=np.uint8)
        if n == 0:
            return
        if not empty:
            lib.rec_madvise(ffi.cast("void *", self._map.address), self._map.length,
                            mmap.MADV_WILLNEED)  # readahead in small pages for the scan
        none = np.zeros(0, dtype=np.int64)
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [
            (none, none, np.zeros(0, dtype=np.uint64))]
        torn_parts: list[np.ndarray] = [none]
        step = READER_SCAN_SLOTS if self.spec.read_only else SCAN_SLOTS  # readers copy
        for lo in range(0, 0 if empty else n, step):
            live, live_ids, live_seq, torn = self._scan_chunk(lo, min(n, lo + step))
            parts.append((live, live_ids, live_seq))
            torn_parts.append(torn)
        live = np.concatenate([p[0] for p in parts])
        live_ids = np.concatenate([p[1] for p in parts])
        live_seq = np.concatenate([p[2] for p in parts])
        torn = np.concatenate(torn_parts)
        order = np.lexsort((live_seq, live_ids))  # by id, then seq
        live, live_ids = live[order], live_ids[order]
        newest = np.ones(len(live), dtype=bool)
        newest[:-1] = live_ids[1:] != live_ids[:-1]
        winners, stale = live[newest], live[~newest]
        if len(winners):
            self._index.upsert(np.ascontiguousarray(live_ids[newest]),
                               winners.astype(np.int32))
        self._state[winners] = _LIVE
        self._torn_ignored = len(torn)
        self._stale_retired = len(stale)
        max_seq = int(live_seq.max()) if len(live_seq) else 0
        self._next_seq = max(max_seq, self._reserve, self._watermark) + 1
        if not self.spec.read_only:
            # retire superseded versions and cut-short writes before their slots are reused:
            # otherwise a later crash during reuse could leave them looking valid or damaged
            dead = np.concatenate([stale, torn]).astype(np.int64)
            if len(dead):
                lib.rec_zero_seq(self._base(), self._rec, REC_SEQ,
                                 ffi.cast("int64_t *", dead.ctypes.data), len(dead))
                self._persist_slots(dead, REC_SEQ, 8)
            self._watermark = self._next_seq - 1
            self._reserve = self._watermark + self._seq_reserve_step
            self._write_state()
        self._count_segments()

    def _scan_chunk(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                      np.ndarray]:
        """The valid records in slots [lo, hi), and the writes a crash cut short.

        Returns (slots, ids, seq counters) of the valid records and the slots of torn writes;
        raises CorruptStoreError on a damaged record.
        """
        if self.spec.read_only:
            # one copy of each record, every field then read from it: a writer may change a
            # record between two reads of the mapping
            recs = self._records()[lo:hi].copy()
            seq_word = np.ascontiguousarray(recs[:, REC_SEQ:REC_SEQ + 8]).view("<u8")[:, 0]
        else:
            # copies, not views: an exception raised here must not keep the mapping exported
            seq_word = self._field(REC_SEQ, "<u8")[lo:hi].copy()
        used = np.flatnonzero(seq_word)
        top = lo + (int(used[-1]) + 1 if len(used) else 0)  # nothing written past it
        seq_word = seq_word[: top - lo]
        if self.spec.read_only:
            recs = recs[: top - lo]
            ids = np.ascontiguousarray(recs[:, REC_ID:REC_ID + 8]).view("<i8")[:, 0]
            stored_crc = np.ascontiguousarray(recs[:, REC_CRC:REC_CRC + 4]).view("<u4")[:, 0]
            kind = np.ascontiguousarray(recs[:, REC_KIND:REC_KIND + 4]).view("<u4")[:, 0]
            calc = row_checksums(ids, recs[:, REC_KIND : REC_PAYLOAD + self._row_bytes])
        else:
            ids = self._field(REC_ID, "<i8")[lo:top].copy()
            stored_crc = self._field(REC_CRC, "<u4")[lo:top].copy()
            kind = self._field(REC_KIND, "<u4")[lo:top].copy()
            calc = row_checksums(
                ids, self._records()[lo:top, REC_KIND : REC_PAYLOAD + self._row_bytes])
        seq, intact = seq_counters(seq_word)
        valid = (seq_word != 0) & (calc == stored_crc) & (kind == KIND_ROW)
        bad = np.flatnonzero((seq_word != 0) & ~valid)
        torn = bad[intact[bad] & (seq[bad] > self._watermark) & (seq[bad] <= self._reserve)]
        damaged = np.setdiff1d(bad, torn, assume_unique=True)
        if len(damaged):
            s = int(damaged[0])
            raise CorruptStoreError(
                f"table {self.spec.table!r}: the record of id {int(ids[s])} in slot {lo + s} "
                f"(byte offset {DATA_OFFSET + (lo + s) * self._rec}) of {self._file} fails its "
                f"checksum ({len(damaged)} damaged record(s) in slots {lo}..{top - 1}); the "
                "data is damaged: restore the table from a checkpoint, or run `embstore fsck` "
                "to list every damaged row"
            )
        live = np.flatnonzero(valid)
        return live + lo, ids[live], seq[live], torn + lo

    # --- slots ----------------------------------------------------------------------------
    #
    # New records go to the free slots of the segment (SEGMENT_SLOTS consecutive slots) with
    # the most free slots, in ascending order, so a batch of new rows is packed into as few
    # pages as the free space allows. On the msync path every page a flush touches is 4 KiB
    # of I/O: a flush of scattered updates then costs about one page per row for retiring
    # the old versions plus a fraction of a page for the new ones, where reusing the freed
    # slot nearest at hand would cost two pages per row. (Putting the new version in the
    # old one's page would need that page written twice, to keep the new version durable
    # before the old one is retired.)

    def _count_segments(self) -> None:
        n_seg = -(-self._capacity // SEGMENT_SLOTS)
        padded = np.ones(n_seg * SEGMENT_SLOTS, dtype=bool)  # slots past the end: not free
        padded[: self._capacity] = self._state != _FREE
        self._seg_free = SEGMENT_SLOTS - padded.reshape(n_seg, SEGMENT_SLOTS).sum(axis=1)
        self._free_count = int(self._seg_free.sum())

    def _push_free(self, slots: np.ndarray) -> None:
        """Count `slots` (already marked free) back into their segments."""
        if len(slots):
            np.add.at(self._seg_free, slots // SEGMENT_SLOTS, 1)
            self._free_count += len(slots)

    def _ensure_free(self, n: int) -> None:
        """Grow the file until `n` slots are free; CapacityError leaves everything as it was."""
        if n <= self._free_count:
            return
        old = self._capacity
        new = min(max(int(old * self._growth), old + n - self._free_count, 64), MAX_SLOTS)
        if new - old < n - self._free_count:
            raise CapacityError(
                f"table {self.spec.table!r}: {self._file} would need more than {MAX_SLOTS} "
                "slots", "split the table across shards or tiers")
        old_size = DATA_OFFSET + old * self._rec
        self._fallocate(self._fd, DATA_OFFSET + new * self._rec, old_size, self._file)
        # the new size and extents must be durable before a flush can promise rows in them:
        # pmem_persist syncs no file metadata (once per growth, so cheap)
        os.fsync(self._fd)
        # the file is larger now; remap it (no view of the old mapping is kept anywhere)
        self._unmap()
        self._map_file(DATA_OFFSET + new * self._rec)
        state = np.zeros(self._capacity, dtype=np.uint8)
        state[:old] = self._state
        self._state = state
        self._count_segments()

    def _alloc(self, n: int) -> np.ndarray:
        """`n` distinct free slots, densest free segments first; marks them dirty."""
        out = np.empty(n, dtype=np.int64)
        got = 0
        while got < n:
            seg = int(np.argmax(self._seg_free))
            lo = seg * SEGMENT_SLOTS
            free = np.flatnonzero(self._state[lo : lo + SEGMENT_SLOTS] == _FREE)[: n - got]
            if not len(free):
                raise AssertionError("free slot counts out of step with the slot states")
            out[got : got + len(free)] = free + lo
            self._seg_free[seg] -= len(free)
            got += len(free)
        self._state[out] = _DIRTY
        self._free_count -= n
        return out

    def _take_seqs(self, n: int) -> int:
        """Hand out counters [first, first + n); returns first."""
        first = self._next_seq
        if first + n - 1 > self._reserve:
            # durable before any record carries a seq above the old reserve (module doc)
            self._reserve = first + n - 1 + self._seq_reserve_step
            self._write_state()
        self._next_seq += n
        return first

    def _supersede(self, slots: np.ndarray) -> None:
        """Give up the records in `slots`.

        Durable ones are retired at the next flush (after what replaces them is durable); ones never
        flushed are freed now.
        """
        state = self._state[slots]
        durable = slots[state == _LIVE]
        if len(durable):
            self._state[durable] = _RETIRE
            self._retire.append(durable)
        volatile = np.ascontiguousarray(slots[state == _DIRTY])
        if len(volatile):
            lib.rec_zero_seq(self._base(), self._rec, REC_SEQ,
                             ffi.cast("int64_t *", volatile.ctypes.data), len(volatile))
            self._state[volatile] = _FREE
            self._touched.append(volatile)  # the zeroed seq is persisted by the next flush
            self._push_free(volatile)

    def _persist_slots(self, slots: np.ndarray, offset: int, length: int) -> None:
        """Make bytes [offset, offset+length) of each slot's record durable.

        On persistent memory: pmem_flush of each range (cache lines), one pmem_drain.
        Elsewhere: write-back of each dirty range is started with sync_file_range and waited
        for with one fdatasync, which also flushes the device cache and commits the extents
        the writes converted from preallocated to written. (msync of each range would do the
        same I/O but flush the device cache once per range: 16 s for 82K scattered rows.)
        Only the pages of the ranges are written: the mapping is MADV_RANDOM, so the page
        cache holds the file in 4 KiB pages, and these are the only dirty pages of the file.

        Raises:
            OSError: the write-back failed (EIO, ...): the flush did not happen.
        """
        if not len(slots) or self._map is None:
            return
        starts = DATA_OFFSET + slots.astype(np.int64) * self._rec + offset
        if self._map.is_pmem:
            lo, hi = _merge_ranges(starts, starts + length, CACHE_LINE)
            for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
                self._map.flush(a, min(b, self._map.length) - a)
            self._map.drain()
            return
        lo, hi = _merge_ranges(starts, starts + length, PAGE_SIZE)
        lens = np.minimum(hi, self._map.length) - lo
        err = lib.rec_sync_ranges(self._fd, ffi.cast("int64_t *", lo.ctypes.data),
                                  ffi.cast("int64_t *", lens.ctypes.data), len(lo))
        if err:
            raise OSError(err, f"sync_file_range: {os.strerror(err)}", str(self._file))
        os.fdatasync(self._fd)

    # --- Backend --------------------------------------------------------------------------

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        return self._index.find(ids).astype(np.int64)

    def _get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.spec.read_only:
            return self._get_beside_writer(ids)
        out, found, bad, first_bad = self._gather(ids)
        if bad:
            raise self._damaged_row(ids, first_bad, f"({bad} bad row(s) in this batch)")
        return out, found

    def _gather(self, ids: np.ndarray, *, copied: bool = False
                ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Rows of `ids` and found, by the C kernel: (rows, found, bad records, first bad).

        `copied`: check each record in a copy of it (a reader beside a writer), not in place.
        """
        n = len(ids)
        out = np.empty((n, self.spec.dim), dtype=self.spec.dtype)
        found = np.zeros(n, dtype=bool)
        if not n or not len(self._index):
            out[:] = 0
            return out, found, 0, -1
        keys, vals, mask = self._index.pointers()
        first_bad = ffi.new("int64_t *")
        scratch = (np.empty(GATHER_GROUP * (REC_PAYLOAD + self._row_bytes), dtype=np.uint8)
                   if copied else None)
        bad = lib.rec_gather(self._base(), self._rec, REC_PAYLOAD, self._row_bytes,
                             keys, vals, mask, ffi.cast("int64_t *", ids.ctypes.data), n,
                             ffi.cast("char *", out.ctypes.data),
                             ffi.cast("uint8_t *", found.ctypes.data), first_bad,
                             ffi.NULL if scratch is None
                             else ffi.cast("char *", scratch.ctypes.data))
        return out, found, int(bad), int(first_bad[0])

    def _damaged_row(self, ids: np.ndarray, j: int, how: str) -> CorruptStoreError:
        s = int(self._lookup(ids[j : j + 1])[0])
        return CorruptStoreError(
            f"table {self.spec.table!r}: row of id {int(ids[j])} in slot {s} (byte offset "
            f"{DATA_OFFSET + s * self._rec}) of {self._file} fails its checksum {how}; the "
            "data is damaged: restore the table from a checkpoint, or run `embstore fsck` to "
            "list every damaged row"
        )

    # --- reading beside a writer -----------------------------------------------------------
    #
    # A read-only handle takes no lock, so a writer in another process may change the file
    # under it. What a flush promised changes only by retirement (its seq word zeroed), and
    # only after a newer state block (see `_flush`); new records go to free slots or over
    # records no flush promised. So a scan during which the state did not change saw every
    # row as of the writer's last flush or later, and a row read afterwards is checked as
    # copied: a slot retired or reused since the scan fails its id or checksum, and the
    # handle scans again and retries.

    def _mapped_state(self) -> tuple[int, int, int]:
        assert self._mem is not None
        state = current_state(self._mem[:DATA_OFFSET].tobytes())
        if state is None:
            raise CorruptStoreError(f"{self._file}: both header state blocks are damaged; "
                                    "restore the table from a checkpoint")
        return state

    def _scan_beside_writer(self) -> None:
        """Index every record, again until no state was written meanwhile (see above).

        Raises:
            CorruptStoreError: a damaged record (one no writer was writing).
            StoreLockedError: the writer wrote a new state during each of READER_SCANS scans.
        """
        damage: CorruptStoreError | None = None
        for _ in range(READER_SCANS):
            state = self._mapped_state()
            size = os.fstat(self._fd).st_size
            if self._map is None or size != self._map.length:  # the writer grew the file
                self._unmap()
                self._map_file(size)
            self._gen, self._watermark, self._reserve = state
            self._index = _SlotIndex()
            try:
                self._scan()
            except CorruptStoreError as exc:
                # damage is there at the next scan too; a record the writer changed while it
                # was copied (a slot retired, or the reserve moved on) is not
                if damage is not None and str(damage) == str(exc):
                    raise
                damage = exc
                continue
            if self._mapped_state() == state:
                return
        raise StoreLockedError(
            f"{self._file}: its writer flushed during each of {READER_SCANS} scans of this "
            "read-only handle; open it again when the writer flushes less often")

    def _get_beside_writer(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`get` of a read-only handle: each record checked and read in a copy of it.

        A record the writer retired, reused or rewrote while it was copied fails its check:
        the handle then scans again and retries.
        """
        for _ in range(READER_SCANS):
            out, found, bad, first_bad = self._gather(ids, copied=True)
            if not bad:
                return out, found
            self._scan_beside_writer()
        raise self._damaged_row(ids, first_bad, f"on {READER_SCANS} reads")

    def _refresh(self) -> None:
        if self._map is None:
            if self._file.exists():  # its writer created it since
                self._open_file()
            return
        self._scan_beside_writer()

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        # A row written since the last flush is rewritten in its own slot: no flush has
        # promised that version, and the flushed one (if any) waits retired in another slot,
        # so a write cut short there is ignored on reopen like any unflushed one. Every
        # other row gets a new slot (out of place, see the module doc).
        n = len(ids)
        slots = self._index.find(ids).astype(np.int64)
        fresh = slots < 0
        fresh[~fresh] = self._state[slots[~fresh]] != _DIRTY
        k = int(np.count_nonzero(fresh))
        self._ensure_free(k)  # the only step that can fail for lack of space: first
        first = self._take_seqs(n)
        new_slots = self._alloc(k)
        slots[fresh] = new_slots
        lib.rec_write(self._base(), self._rec, REC_PAYLOAD, self._row_bytes,
                      ffi.cast("int64_t *", slots.ctypes.data),
                      ffi.cast("int64_t *", ids.ctypes.data), first, KIND_ROW,
                      ffi.cast("char *", rows.ctypes.data), n)
        if k:
            self._touched.append(new_slots)
            old = self._index.upsert(np.ascontiguousarray(ids[fresh]),
                                     new_slots.astype(np.int32))
            self._supersede(old[old >= 0].astype(np.int64))

    def _delete(self, ids: np.ndarray) -> np.ndarray:
        slots = self._lookup(ids)
        present = slots >= 0
        if present.any():
            self._supersede(slots[present])
            self._index.remove(np.ascontiguousarray(ids[present]))
        return present

    def _contains(self, ids: np.ndarray) -> np.ndarray:
        return self._index.find(ids) >= 0

    def _ids(self) -> np.ndarray:
        return self._index.ids()

    def _len(self) -> int:
        return len(self._index)

    def _flush(self) -> None:
        """Persist new records, then the watermark, then retire what they replace.

        The order is the crash guarantee: a retired slot's row is durable elsewhere first, so
        a crash between the steps leaves two versions (the higher seq wins on open), never
        none. Skipping the flush loses only writes since the previous one (atomicity per row,
        durability at flush, in ACID terms). The watermark goes before the retirements for
        readers beside the writer: a retirement is never seen without a new state.
        """
        if self._map is None or not (self._touched or self._retire):
            return
        touched = (unique_sorted(np.concatenate(self._touched)) if self._touched
                   else np.zeros(0, dtype=np.int64))
        self._persist_slots(touched, 0, self._rec)
        self._watermark = self._next_seq - 1
        # the state before the retirements: a reader in another process that saw a slot
        # retired then sees a new state too, and scans again (`_scan_beside_writer`)
        self._write_state()
        retire = (np.concatenate(self._retire) if self._retire
                  else np.zeros(0, dtype=np.int64))
        if len(retire):
            lib.rec_zero_seq(self._base(), self._rec, REC_SEQ,
                             ffi.cast("int64_t *", retire.ctypes.data), len(retire))
            self._persist_slots(retire, REC_SEQ, 8)
        self._state[touched[self._state[touched] == _DIRTY]] = _LIVE
        self._state[retire] = _FREE
        self._push_free(retire)
        self._touched.clear()
        self._retire.clear()

    def _close(self) -> None:
        self._release()
        self._index = _SlotIndex(16)

    def nbytes(self) -> int:
        # docstring inherited
        file_bytes = DATA_OFFSET + self._capacity * self._rec if self._map is not None else 0
        return file_bytes + self._index.nbytes()

    def statistics(self) -> dict[str, Any]:
        # docstring inherited
        stats = super().statistics()
        stats.update(
            libpmem=(isinstance(self._map, _libpmem.PmemMapping) if self._map is not None
                     else self._lib is not None),
            is_pmem=bool(self._map is not None and self._map.is_pmem),
            file=str(self._file),
            record_bytes=self._rec,
            capacity_rows=self._capacity,
            file_bytes=DATA_OFFSET + self._capacity * self._rec if self._map else 0,
            free_slots=self._free_count,
            torn_records_ignored=self._torn_ignored,
            stale_records_retired=self._stale_retired,
        )
        return stats
