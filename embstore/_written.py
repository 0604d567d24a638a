"""The written-id record: which ids a table's store of record holds, to tell lost rows from new.

A lookup of an id that no tier holds returns the table's initial value. Without a record, a
row the medium lost (a damaged key, a truncated file) would be served that way too, and a
trainer would restart it from scratch. With it, an id that the record holds and no tier
finds raises `CorruptStoreError` naming the table, the id and the file.

File `<store>/written/<table>.ids` (offsets imported by the corruption tests):

    offset  size  field
    0       8     magic b"EMBWRIT1"
    8       4     kind, uint32 little-endian: 0 a bitmap over [0, num_embeddings) (a bounded
                  table of at most `BITMAP_MAX_IDS` ids), 1 an id list (any other table)
    12      4     CRC-32 (zlib), uint32 little-endian, of bytes 16 to the end
    16      8     n, uint64 little-endian: bits of the bitmap, or ids in the list
    24      ...   body: ceil(n / 8) bytes of bitmap (numpy.packbits, little bit order), or n
                  distinct int64 little-endian ids in ascending order

Cost: a bounded table (num_embeddings set, at most `BITMAP_MAX_IDS`) keeps 1 bit per id of
its range on disk and in memory (the file's body, which a flush writes as it is); an
unbounded one, or one of a wider range, 8 bytes per stored row on disk and its hash index in
memory (about 16 bytes per row). Lookups pay only for ids no tier found (one vectorised
probe).

Deletes: `<store>/written/<table>.del`, a journal of deleted ids appended (and fsynced)
before the medium deletes them, entries of

    offset  size  field
    0       4     count, uint32 little-endian
    4       4     CRC-32 (zlib) of the ids, uint32 little-endian
    8       8 * count  ids, int64 little-endian

An entry cut short or failing its checksum ends the journal (a crash mid-append: the medium
delete it announced had not begun). The ids of the journal are taken out of the record on open;
each flush rewrites the record and empties the journal.

Ordering (why a crash never turns the record into a false alarm): the record must never hold
an id the store of record may lack after a crash. A write reaches the record only at a flush,
after the store of record is synced; a delete reaches the journal, durably, before the medium.
A crash between a sync and the record's rewrite leaves an older record, which misses some ids
(their loss would go unnoticed until the next flush) but holds none the medium may lack. A
missing record (a new store that crashed before its first flush, a checkpoint) is rebuilt from
the medium's ids on open. Cost of deletes: one fsync per `delete` call.

Readers beside a writer: a read-only handle reads the record, then the medium, at two
instants. A delete between them (journal, then medium) would show a row the record holds and
the medium lacks. `WrittenIds.held_still` tells whether the record (file and journal) changed
since the handle read it: the store counts a row as lost only where it held still.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import numpy as np

from . import _crash
from ._kernels._dram_index import ffi, lib
from ._unique import unique_sorted
from .errors import CorruptStoreError
from .index import IdIndex, c_pointer
from .manifest import fsync_dir, read_bytes_nofollow, write_atomic, write_atomic_many

__all__ = ["BITMAP", "HEADER", "IDS", "MAGIC", "WrittenIds", "after_sync", "write_missing",
           "write_record"]

MAGIC: Final = b"EMBWRIT1"
HEADER: Final = struct.Struct("<8sII Q")
"""magic, kind, crc32 of the rest, n (24 bytes)."""
BITMAP: Final = 0
IDS: Final = 1
CRC_OFFSET: Final = 12
BODY_OFFSET: Final = 24
BITMAP_MAX_IDS: Final = 1 << 32
"""The widest id range a bounded table's record keeps as a bitmap (512 MiB of it); a wider
one keeps a list of its ids, as an unbounded table does (a bitmap of 2**40 ids would take
128 GiB on disk and in memory, whatever the rows)."""


def bitmap_range(num_embeddings: int | None) -> int | None:
    """The id range of the bitmap a table of `num_embeddings` keeps; None: it keeps a list."""
    if num_embeddings is None or num_embeddings > BITMAP_MAX_IDS:
        return None
    return num_embeddings


class WrittenIds:
    """The written-id record of one table (see the module docstring).

    Args:
        file: the record's file.
        num_embeddings: the table's id range, or None for an unbounded table.
        stored_ids: called for the ids of the store of record when no file exists yet.
        read_only: never write the file.
        must_exist: the manifest lists the table as having a record: a missing file is damage.
        defer_write: write a missing file at `write_missing`, not here (a store opening many
            tables writes their records together).

    Raises:
        CorruptStoreError: the file is damaged, or missing where it must exist.
    """

    def __init__(self, file: Path, num_embeddings: int | None,
                 stored_ids: Callable[[], np.ndarray], *, read_only: bool,
                 must_exist: bool = False, defer_write: bool = False) -> None:
        self.file = file
        self._range = num_embeddings
        self._n = bitmap_range(num_embeddings)  # the bitmap's range; None: a list of ids
        self._read_only = read_only
        self._packed: np.ndarray | None = None  # a bounded table's bitmap, as in the file
        # the bits set in `_packed`, counted on the first `count` (an open must not scan the
        # bitmap) and then moved with the bits by the kernel that changes them
        self._bits_held = np.zeros(1, dtype=np.int64)
        self._bits_counted = False
        self._index: IdIndex | None = None
        self.journal = file.with_suffix(".del")
        self._changed = False  # ids added or removed since the last flush
        self.forgotten = 0
        """Ids the record has forgotten since it was read (deleted, or withdrawn): a scan
        that began when it held n ids must show at least n less those forgotten since."""
        self.missing = False
        """The file does not exist yet (`defer_write`): `write_missing` writes it."""
        stats = self._stats() if read_only else b""  # before the read, for `held_still`
        try:
            raw: bytes | None = read_bytes_nofollow(file, self._size_said)
        except FileNotFoundError:
            raw = None
        except NotADirectoryError:
            raise CorruptStoreError(
                f"{file.parent} is not a directory: the store keeps its written-id records "
                "there, and something else was put in its place. Restore the store from a "
                "checkpoint, or run `embstore fsck --repair` to rebuild the records") from None
        self._read_state = (stats + (b"-" if raw is None else raw[:16]) + self._journal_crc()
                            if read_only else b"")
        if raw is None and must_exist:
            raise CorruptStoreError(
                f"written-id record {file} is missing, and the manifest says the table has "
                "one: files of the store were removed. Restore the store from a checkpoint; "
                "if the table's rows are known to be intact, rebuild the record with "
                "embstore.rebuild_written_records(path)")
        if raw is None:
            _crash.point("recovery.written")
            ids = stored_ids()
            self._load(np.ascontiguousarray(ids, dtype=np.int64))
            if not read_only:
                self.missing = True
                if not defer_write:
                    write_missing([self])
        else:
            parsed = self._parse(raw)
            if self._n is not None:
                self._packed = parsed
            else:
                self._load(parsed)
            deleted = self._read_journal()
            if len(deleted):
                self._forget(deleted)

    # --- beside a writer ------------------------------------------------------------------

    def held_still(self) -> bool:
        """Whether the record and its journal are as this read-only handle read them.

        Compared: each file's inode, size and times (taken before the handle read them; a
        rewrite is a new file, a delete an append, a flush an emptied journal), the record's
        header, whose CRC covers its body, and the journal's CRC-32 (it may be emptied and
        refilled within a timestamp's granularity).
        """
        try:
            fd = os.open(self.file, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            header = b"-"
        except OSError:
            return False  # the reads that follow report damage
        else:
            try:
                header = os.read(fd, 16)
            finally:
                os.close(fd)
        return self._stats() + header + self._journal_crc() == self._read_state

    def _stats(self) -> bytes:
        parts = []
        for path in (self.file, self.journal):
            try:
                st = os.stat(path, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):  # the read after reports the latter
                parts.append(b"-")
                continue
            parts.append(struct.pack("<QQqq", st.st_ino, st.st_size, st.st_mtime_ns,
                                     st.st_ctime_ns))
        return b"".join(parts)

    def _journal_crc(self) -> bytes:
        try:
            return struct.pack("<I", zlib.crc32(read_bytes_nofollow(self.journal, 1 << 40)))
        except (FileNotFoundError, CorruptStoreError):  # the journal's own read reports it
            return b"-"

    # --- the file -------------------------------------------------------------------------

    def _damaged(self, why: str) -> CorruptStoreError:
        return CorruptStoreError(
            f"written-id record {self.file} is damaged ({why}); run `embstore fsck "
            "--repair` to rebuild it from the table's rows, or restore from a checkpoint")

    def _size_said(self, head: bytes, size: int) -> int:
        """The size that the record's first bytes `head` and the table allow it.

        Checked before the rest is read: a file grown past it (a damaged length, a stray write
        far out) would otherwise be read whole, and a record blown up to 20 GiB got the
        process killed for its memory.
        """
        if len(head) < BODY_OFFSET:
            return BODY_OFFSET  # the parse names a header cut short
        magic, kind, _, n = HEADER.unpack_from(head)
        if kind == BITMAP and self._n is None and n == self._range and magic == MAGIC:
            self._n = n  # a wide range's bitmap, written before such ranges took a list
        expected_kind = BITMAP if self._n is not None else IDS
        if magic != MAGIC:
            raise self._damaged("wrong magic")
        if kind != expected_kind:
            raise self._damaged(f"kind {kind}, expected {expected_kind}")
        # a bitmap of the table's ids whatever its header says, or the ids its header counts
        said = BODY_OFFSET + ((self._n + 7) // 8 if self._n is not None else 8 * n)
        if size > said:  # in the parse's words
            body = size - BODY_OFFSET
            raise self._damaged(f"a bitmap of {self._n} bits in {body} bytes" if self._n
                                is not None else f"{n} ids in {body} bytes")
        return int(said)

    def _parse(self, raw: bytes) -> np.ndarray:
        bad = self._damaged
        if len(raw) < BODY_OFFSET:
            raise bad(f"{len(raw)} bytes, shorter than its {BODY_OFFSET}-byte header")
        magic, kind, crc, n = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise bad("wrong magic")
        if zlib.crc32(memoryview(raw)[16:]) != crc:
            raise bad("checksum mismatch")
        body = memoryview(raw)[BODY_OFFSET:]
        expected_kind = BITMAP if self._n is not None else IDS
        if kind != expected_kind:
            raise bad(f"kind {kind}, expected {expected_kind}")
        if kind == BITMAP:
            if n != self._n or len(body) != (n + 7) // 8:
                raise bad(f"a bitmap of {n} bits in {len(body)} bytes, the table has "
                          f"{self._n} ids")
            packed = np.frombuffer(body, np.uint8).copy()
            if n % 8:  # bits past the table's last id stand for no id
                packed[-1] &= (1 << (n % 8)) - 1
            return packed
        if len(body) != 8 * n:
            raise bad(f"{n} ids in {len(body)} bytes")
        return np.frombuffer(body, "<i8").astype(np.int64)

    def _read_journal(self) -> np.ndarray:
        try:
            raw = read_bytes_nofollow(self.journal, 1 << 40)
        except FileNotFoundError:
            return np.zeros(0, np.int64)
        parts, at = [], 0
        while at + 8 <= len(raw):
            count, crc = struct.unpack_from("<II", raw, at)
            body = raw[at + 8: at + 8 + 8 * count]
            if len(body) != 8 * count or zlib.crc32(body) != crc:
                break  # a torn append: the delete it announced never reached the medium
            parts.append(np.frombuffer(body, "<i8").astype(np.int64))
            at += 8 + 8 * count
        return unique_sorted(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def _append_journal(self, ids: np.ndarray) -> None:
        body = np.ascontiguousarray(ids, dtype="<i8").tobytes()
        new = not self.journal.exists()
        if new and not self.file.parent.exists():
            self.file.parent.mkdir(mode=0o700)
            fsync_dir(self.file.parent.parent)
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                     0o600)
        try:
            os.write(fd, struct.pack("<II", len(ids), zlib.crc32(body)) + body)
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            fsync_dir(self.journal.parent)

    def _empty_journal(self) -> None:
        try:
            fd = os.open(self.journal, os.O_WRONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        try:
            if os.fstat(fd).st_size:
                os.ftruncate(fd, 0)
                os.fsync(fd)
        finally:
            os.close(fd)

    # --- in memory ------------------------------------------------------------------------

    def _load(self, ids: np.ndarray) -> None:
        if self._range is not None and len(ids) and (ids.min() < 0 or ids.max() >= self._range):
            raise CorruptStoreError(
                f"written-id record {self.file}: ids outside [0, {self._range}); restore the "
                "table from a checkpoint")
        if self._n is not None:
            self._packed = _bitmap(self._n, ids)  # counted on the first `count`
        else:
            self._index = IdIndex(max(1024, 2 * len(ids)))
            if len(ids):
                self._index.add(ids)

    def ids(self) -> np.ndarray:
        """Every id the record holds, sorted int64."""
        if self._packed is not None:
            return _bitmap_ids(self._packed)
        assert self._index is not None
        ids: np.ndarray = np.sort(self._index.items()[0])
        return ids

    def count(self) -> int:
        """How many ids the record holds (without listing them)."""
        if self._packed is not None:
            if not self._bits_counted:
                self._bits_held[0] = _bitmap_count(self._packed)
                self._bits_counted = True
            return int(self._bits_held[0])
        assert self._index is not None
        return len(self._index)

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """bool[N]: whether each of `ids` (valid for the table) was written and not deleted."""
        if self._packed is not None:
            return _bits_set(self._packed, ids)
        assert self._index is not None
        return self._index.find(np.ascontiguousarray(ids)) >= 0

    def add(self, ids: np.ndarray, *, absent: bool = False,
            into: list[np.ndarray] | None = None) -> np.ndarray:
        """Record distinct `ids` as written (durable in the file from the next flush).

        `absent`: the caller saw `holds` deny every one of them (under the store's lock).
        Returns the ids the record did not hold before, for `withdraw` if the write fails;
        they are appended to `into` too, before the record changes (so a caller whose
        guard is already in place withdraws them whatever interrupts this call).
        """
        if self._packed is not None:
            new = ids if absent else np.asarray(ids[~_bits_set(self._packed, ids)])
            if into is not None:
                into.append(new)
            if len(new):  # none: the common case in training, rows written before
                _set_bits(self._packed, new, self._bits_held)
                self._changed = True
            return new
        assert self._index is not None
        ids = np.ascontiguousarray(ids)
        fresh = ids if absent else np.ascontiguousarray(ids[self._index.find(ids) < 0])
        if into is not None:
            into.append(fresh)
        if len(fresh):
            self._index.add_absent(fresh)
            self._changed = True
        return fresh

    def withdraw(self, ids: np.ndarray) -> None:
        """Forget `ids` that `add` just recorded for a write that then failed.

        The write may have reached a tier for some of them: the record then lacks an id
        the store holds, which leaves that row's loss unnoticed; holding one the store
        lacks would report a row lost that was never written. No journal entry: the
        record file cannot hold these ids yet (it is rewritten only at a flush, and the
        caller withdraws before releasing the store's lock).
        """
        if len(ids):
            self._forget(np.ascontiguousarray(ids))

    def remove(self, ids: np.ndarray) -> None:
        """Forget distinct `ids`; call it before the medium deletes them (it syncs a journal)."""
        held = self.holds(ids)
        if not held.any():
            return
        gone = np.ascontiguousarray(ids[held])
        if not self._read_only:
            self._append_journal(gone)
        self._forget(gone)
        self._changed = True

    def _forget(self, ids: np.ndarray) -> None:
        if self._packed is not None:
            # ids past the table's range (a journal's) are skipped: the bits past its last
            # id, in the last byte, are never set
            self.forgotten += _change_bits(self._packed, ids, clear=True,
                                           held=self._bits_held)[0]
        else:
            assert self._index is not None
            before = len(self._index)
            self._index.remove(np.ascontiguousarray(ids))
            self.forgotten += before - len(self._index)

    def before_sync(self) -> None:
        """Called by a flush before the store of record is synced (a crash point only)."""
        _crash.point("flush.before_written")

    def after_sync(self) -> None:
        """Called once the store of record is synced: the record may hold every id now."""
        after_sync([self])

    def _pending(self) -> tuple[Path, bytes] | None:
        """The file and content to write once the store of record is synced, if changed."""
        _crash.point("flush.after_sync")
        if self._read_only or not (self._changed or self.missing):
            return None
        return self.file, self._file_bytes()

    def _file_bytes(self) -> bytes:
        """The record file of the ids held now (a bitmap is written as it is kept)."""
        if self._packed is not None:
            return _record_bytes(self.file, self._n, packed=self._packed)
        return _record_bytes(self.file, self._n, self.ids())

    def _written(self) -> None:
        self._empty_journal()
        self._changed = self.missing = False


def write_missing(records: Sequence[WrittenIds]) -> None:
    """Write the files of `records` that do not exist yet (`defer_write`), together."""
    todo = [r for r in records if r.missing]
    write_atomic_many([(r.file, r._file_bytes()) for r in todo])
    for r in todo:
        r._written()


def after_sync(records: Sequence[WrittenIds]) -> None:
    """`WrittenIds.after_sync` of several tables, their files written together.

    Each record is replaced atomically on its own, as one would be; the directory is synced
    once for all (see `write_atomic_many`).
    """
    pending = [(r, r._pending()) for r in records]
    changed = [(r, item) for r, item in pending if item is not None]
    write_atomic_many([item for _, item in changed])
    for r, _ in changed:
        r._written()


def _write_file(file: Path, num_embeddings: int | None, ids: np.ndarray) -> None:
    """Write the record file of sorted distinct `ids` atomically (layout: module docstring)."""
    write_atomic(file, _record_bytes(file, num_embeddings, ids))


def _bit_masks(ids: np.ndarray) -> np.ndarray:
    """uint8[N]: each id's bit within its byte of a bitmap (little bit order, as packbits)."""
    return np.left_shift(np.uint8(1), (ids & 7).astype(np.uint8))


def _bitmap(n: int, ids: np.ndarray) -> np.ndarray:
    """The bitmap over [0, n) of `ids` (valid ids of it): ceil(n / 8) bytes."""
    packed = np.zeros((n + 7) // 8, dtype=np.uint8)
    _set_bits(packed, ids)
    return packed


def _change_bits(packed: np.ndarray, ids: np.ndarray, *, clear: bool = False,
                 held: np.ndarray | None = None) -> tuple[int, int]:
    """Set (or clear) the bits of `ids` in the bitmap `packed`.

    Returns (bits changed, ids outside the bitmap, left alone). `held`, an int64[1] count of
    the bits set, moves with the bits in the same C call.
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    outside = np.zeros(1, dtype=np.int64)
    changed = lib.bitmap_set(c_pointer("uint8_t *", packed), 8 * len(packed),
                             c_pointer("int64_t *", ids), len(ids), int(clear),
                             c_pointer("int64_t *", outside),
                             ffi.NULL if held is None else c_pointer("int64_t *", held))
    return int(changed), int(outside[0])


def _set_bits(packed: np.ndarray, ids: np.ndarray, held: np.ndarray | None = None) -> int:
    """Set the bits of `ids` (valid ids of the bitmap `packed`); returns how many were unset."""
    changed, outside = _change_bits(packed, ids, held=held)
    assert not outside, f"{outside} ids outside a bitmap of {8 * len(packed)} bits"
    return changed


def _bits_set(packed: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """bool[N]: whether the bitmap `packed` holds each of `ids` (valid ids of it)."""
    return (packed[ids >> 3] & _bit_masks(ids)) != 0  # type: ignore[no-any-return]


_CHUNK_BYTES: Final = 1 << 20
"""Bytes of a bitmap unpacked at a time: 8 MiB of temporaries, whatever the table's range."""
_ONES: Final = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1)
"""The bits set in each byte value (numpy < 2 has no bitwise_count)."""


def _bitmap_count(packed: np.ndarray) -> int:
    """How many bits the bitmap `packed` holds."""
    return sum(int(_ONES[packed[lo:lo + _CHUNK_BYTES]].sum(dtype=np.int64))
               for lo in range(0, len(packed), _CHUNK_BYTES))


def _bitmap_ids(packed: np.ndarray) -> np.ndarray:
    """The ids the bitmap `packed` holds, sorted int64: unpacked a chunk at a time."""
    parts = [np.flatnonzero(np.unpackbits(packed[lo:lo + _CHUNK_BYTES], bitorder="little"))
             + 8 * lo for lo in range(0, len(packed), _CHUNK_BYTES)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _record_bytes(file: Path, num_embeddings: int | None, ids: np.ndarray | None = None, *,
                  packed: np.ndarray | None = None) -> bytes:
    """The record file of sorted distinct `ids`, or of the bitmap `packed` of a bounded table.

    Makes `file`'s directory if it is missing.
    """
    if num_embeddings is not None:
        if packed is None:
            assert ids is not None
            packed = _bitmap(num_embeddings, ids)
        body = packed.data  # no copy but the file's own: a bitmap may be large
        kind, n = BITMAP, num_embeddings
    else:
        assert ids is not None
        body = np.ascontiguousarray(ids, dtype="<i8").data
        kind, n = IDS, len(ids)
    crc = zlib.crc32(body, zlib.crc32(struct.pack("<Q", n)))
    if not file.parent.exists():
        file.parent.mkdir(mode=0o700)
        fsync_dir(file.parent.parent)
    return b"".join([HEADER.pack(MAGIC, kind, crc, n), body])


def write_record(file: Path, num_embeddings: int | None, ids: np.ndarray) -> None:
    """Write a fresh record holding exactly `ids` at `file` (a checkpoint's, a restore's).

    Written straight from the ids (sorted, distinct), without the in-memory index an open
    record keeps: a rewrite of a large unbounded table costs about 8 bytes per row.

    Raises:
        CorruptStoreError: an id outside [0, num_embeddings).
    """
    ids = unique_sorted(np.asarray(ids, dtype=np.int64))
    if num_embeddings is not None and len(ids) and (ids[0] < 0 or ids[-1] >= num_embeddings):
        raise CorruptStoreError(f"written-id record {file}: ids outside [0, {num_embeddings}); "
                                "restore the table from a checkpoint")
    file.unlink(missing_ok=True)
    file.with_suffix(".del").unlink(missing_ok=True)
    _write_file(file, bitmap_range(num_embeddings), ids)

