"""The RocksDB backend: rows on SSD through rocksdict, one column family per table.

A tier directory holds one RocksDB database shared by the tables of the tier; table `t` lives in
the column family ``t:<t>``, and the default column family holds one small JSON record per
table (``embstore/table/<t>`` -> dim, dtype, format) checked on reopen. rocksdict runs in raw
mode: keys and values are bytes, nothing is pickled.

Keys are 8 bytes, big-endian with the sign bit flipped, so a scan yields ids in numeric order.
Stored value layout (R = BackendSpec.row_bytes), imported by the corruption tests:

    offset  size  field
    0       4     CRC-32C, uint32 little-endian, of the id (8 bytes little-endian) ++ payload
    4       R     payload: the row, BackendSpec.dtype, C order

RocksDB checks its own block checksums on every read; the per-row CRC also covers what those do
not (memtable contents, values written under the wrong key, reads with checksums off).

Durability (default `sync_writes=False`): every write batch goes to the write-ahead log in the
OS's page cache before `put` returns, so a process crash loses nothing that `put` acknowledged.
`flush()` syncs the log: after it returns an OS crash or power loss loses nothing either. A
crash between flushes may lose the writes since the last flush (D), never part of one batch (A):
recovery replays the log up to its first damaged record. `sync_writes=True` syncs every batch.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final, NoReturn, final

import numpy as np
import rocksdict

from embstore._cold_reads import MAX_THREADS as _MAX_COLD_READ_THREADS
from embstore._cold_reads import ColdReads
from embstore.backend import BackendSpec, foreign_error
from embstore.errors import (
    ConfigError,
    CorruptStoreError,
    EmbstoreError,
    InvalidIdsError,
    StoreLockedError,
    StoreNotFoundError,
)

from ._keys import (
    CRC_OFFSET,
    CRC_SIZE,
    PAYLOAD_OFFSET,
    VALUE_LAYOUT,
    SharedHandles,
    encode_keys,
    encode_values,
    record_dtype,
)
from ._kv import (
    KeyValueBackend,
    check_table_meta,
    flag_option,
    int_option,
    missing_medium,
    refuse_special_files,
    table_meta,
)
from ._rocksdb_read import check_log_framing, db_files, error_text, open_read_only

__all__ = ["CRC_OFFSET", "CRC_SIZE", "PAYLOAD_OFFSET", "VALUE_LAYOUT", "RocksDBBackend",
           "check_log_framing", "error_text", "open_read_only"]

CF_PREFIX: Final = "t:"
META_PREFIX: Final = b"embstore/table/"
_COMPRESSION: Final = {
    "none": rocksdict.DBCompressionType.none,
    "snappy": rocksdict.DBCompressionType.snappy,
    "lz4": rocksdict.DBCompressionType.lz4,
    "zstd": rocksdict.DBCompressionType.zstd,
}

_HANDLES: SharedHandles[_Shared] = SharedHandles("rocksdb")
# RocksDB starts this many threads per column family to open its table files when it opens a
# database, even for empty ones: a thousand thread starts for a few hundred tables, most of the
# time the open takes. Spread over the column families, it keeps one large table's parallel
# open and starts at most this many in all.
_FILE_OPENING_THREADS: Final = 16
_MAX_MANIFEST_BYTES: Final = 64 << 20
_COLD_READ_THREADS: Final = 16  # the default: the most the VM's disk gained from (cold reads)
# Upper bounds of the size options, each what RocksDB takes as given. Past them rocksdict
# raised an OverflowError on open, which read as a damaged store, or RocksDB clipped the value.
_SIZE_T_MAX: Final = 2**64 - 1  # cache capacities are size_t
_MAX_BLOOM_BITS: Final = 100  # RocksDB's bloom filter uses 100 bits per key for any more
_MAX_WRITE_BUFFER: Final = 64 << 30  # RocksDB clips write_buffer_size to 64 GiB
_MAX_BLOCK_SIZE: Final = 2**32 - 1  # RocksDB refuses blocks of 4 GiB and more (uint32 offsets)
# max_background_jobs is a C int, but RocksDB starts that many threads when it opens the
# database and keeps them for the life of the process (2000 jobs: 2000 threads); near int's
# maximum the process would die starting them. Far more than any disk has work for.
_MAX_BACKGROUND_JOBS: Final = 1024


def _make_options(settings: tuple[tuple[str, Any], ...], cache: Any, *, db: bool = False,
                  column_families: int = 1) -> Any:
    """Rocksdict options of a column family (or, with `db`, of the database) from settings.

    `column_families` (with `db`): how many the database is opened with.
    """
    s = dict(settings)
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_compression_type(_COMPRESSION[s["compression"]]())
    opts.set_write_buffer_size(s["write_buffer_bytes"])
    if s["memtable_bloom_ratio"]:
        # a read of a key the memtable lacks (most reads under a DRAM cache) skips its
        # skip-list search: the filter answers from one cache line
        opts.set_memtable_prefix_bloom_ratio(s["memtable_bloom_ratio"])
        opts.set_memtable_whole_key_filtering(True)
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(cache)  # one cache for every column family of the directory
    table.set_block_size(s["block_size_bytes"])
    if s["bloom_bits_per_key"]:
        table.set_bloom_filter(s["bloom_bits_per_key"], False)
    opts.set_block_based_table_factory(table)
    if db:
        opts.set_allow_mmap_reads(s["mmap_reads"])
        opts.set_max_background_jobs(s["max_background_jobs"])
        opts.set_max_file_opening_threads(max(1, _FILE_OPENING_THREADS // column_families))
        # RocksDB starts a new MANIFEST past this (its default is 1 GiB): what an open reads,
        # and what `check_log_framing` walks, stays small on a long-lived store
        opts.set_max_manifest_file_size(_MAX_MANIFEST_BYTES)
        if s["row_cache_bytes"]:
            opts.set_row_cache(rocksdict.Cache(s["row_cache_bytes"]))
    return opts


def _settings(block_cache_bytes: int = 128 << 20, row_cache_bytes: int = 64 << 20,
              bloom_bits_per_key: int = 10, compression: str = "none",
              write_buffer_bytes: int = 64 << 20, block_size_bytes: int = 4096,
              max_background_jobs: int = 2, mmap_reads: bool = False,
              memtable_bloom_ratio: float = 0.0) -> tuple[tuple[str, Any], ...]:
    """The checked settings of a tier directory: `RocksDBBackend`'s options but per-table ones.

    Per table (not here): sync_writes and cold_read_threads.

    Raises:
        ConfigError: an invalid option.
    """
    # a string first: a list is no key of the table (unhashable), a TypeError otherwise
    if not isinstance(compression, str) or compression not in _COMPRESSION:
        raise ConfigError(
            f"rocksdb compression must be one of {sorted(_COMPRESSION)}, got {compression!r}"
        )
    for opt, value, low, high in (
            ("block_cache_bytes", block_cache_bytes, 1 << 20, _SIZE_T_MAX),
            ("row_cache_bytes", row_cache_bytes, 0, _SIZE_T_MAX),
            ("bloom_bits_per_key", bloom_bits_per_key, 0, _MAX_BLOOM_BITS),
            ("write_buffer_bytes", write_buffer_bytes, 1 << 16, _MAX_WRITE_BUFFER),
            ("block_size_bytes", block_size_bytes, 512, _MAX_BLOCK_SIZE),
            ("max_background_jobs", max_background_jobs, 1, _MAX_BACKGROUND_JOBS)):
        int_option("rocksdb", opt, value, low, high)
    if not isinstance(mmap_reads, bool):
        raise ConfigError(f"rocksdb option mmap_reads must be True or False, got {mmap_reads!r}")
    if (isinstance(memtable_bloom_ratio, bool)
            or not isinstance(memtable_bloom_ratio, (int, float))
            or not 0.0 <= memtable_bloom_ratio <= 0.25):
        raise ConfigError("rocksdb option memtable_bloom_ratio must be a number from 0 to 0.25 "
                          f"(the filter's share of the write buffer), got {memtable_bloom_ratio!r}")
    return (("block_cache_bytes", block_cache_bytes),
            ("row_cache_bytes", row_cache_bytes),
            ("bloom_bits_per_key", bloom_bits_per_key),
            ("compression", compression),
            ("write_buffer_bytes", write_buffer_bytes),
            ("block_size_bytes", block_size_bytes),
            ("max_background_jobs", max_background_jobs),
            ("mmap_reads", mmap_reads),
            ("memtable_bloom_ratio", float(memtable_bloom_ratio)))


def restrict_modes(directory: Path) -> None:
    """Make the files RocksDB created in `directory` 0600 (it creates them 0644).

    RocksDB has no setting for the mode of its files, and a umask set around its calls would
    neither cover its background threads (flushes and compactions create files whenever they
    run) nor spare other threads' files. So the directory itself is 0700, which keeps everyone
    else out of every file in it whatever its mode, and this pass takes the group and other
    bits off the files on open, on every flush and on close. The tradeoff: between two
    flushes a file a compaction just made may be 0644, inside the 0700 directory.
    """
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mode & 0o077:
                    os.chmod(entry.path, 0o600, follow_symlinks=False)
            except FileNotFoundError:  # removed by a compaction meanwhile
                continue


def _fail(exc: Exception, what: str, directory: Path) -> NoReturn:
    """Re-raise an error of rocksdict as the embstore error it means."""
    msg = error_text(exc, directory)
    if isinstance(exc, EmbstoreError):
        raise exc
    if "Corruption" in msg or "checksum mismatch" in msg:
        raise CorruptStoreError(
            f"{what}: RocksDB reports damaged data ({msg}); restore the table from a checkpoint "
            "or run `embstore fsck` to list the damaged rows"
        ) from exc
    raise exc


@final
class RocksDBBackend(KeyValueBackend):
    """One table in a column family of the RocksDB database of its tier directory.

    Reads fetch the distinct ids of a batch in key order with one multi-get (split over threads
    while the table's reads go to the device: `cold_read_threads`). Measured on 2M rows
    of dim 64 (`embstore bench backends` times every way): a multi-get of a batch with its
    duplicates runs at a third of the speed; on distinct sorted keys a per-key get loop is within
    a few percent, ahead when every row is cached, behind on colder reads, which is what a tier
    under a DRAM cache serves. Writes go in one WriteBatch. `len()` counts keys with a scan
    (RocksDB keeps no exact count) and caches the answer until the database's next write.

    Args:
        spec: the table; `spec.path` is the tier directory.
        block_cache_bytes: LRU cache of uncompressed SST blocks, shared by the directory's tables.
        row_cache_bytes: cache of single rows in front of the block cache; 0 disables it.
        bloom_bits_per_key: bloom filter bits per key (misses skip the SST read); 0 disables.
        compression: "none" (default: rows of floats barely compress), "lz4", "snappy", "zstd".
        write_buffer_bytes: memtable size before it is flushed to an SST file.
        block_size_bytes: SST data block size.
        sync_writes: sync the write-ahead log on every batch, not only on `flush()`.
        max_background_jobs: threads for flushes and compactions.
        mmap_reads: read table files through a memory map rather than `pread` into a block
            buffer. A read of a block the OS has cached then costs no system call, no copy and
            no block-cache insertion: about 30% less per row missed by the DRAM tier above
            (`embstore bench torch --parts demo`); a cold read costs the same page read either
            way. Off by default: every page a read touches stays mapped into the process
            until the database closes, so a pass over a whole table (export, compact,
            migrate, fsck) grows the process's resident memory by the table's size, where a
            `pread` keeps it flat. For a tier that serves random point reads to a trainer.
        memtable_bloom_ratio: share of the write buffer given to a bloom filter of the
            memtable's keys (0 to 0.25; 0, the default, keeps none). A read of a key the
            memtable lacks then skips the skip-list search, which on a memtable of 64 MiB of
            random keys is a chain of cache misses: 9.7 -> 6.2 us per row read while writes
            of other rows go on (a DRAM cache's misses and write-backs). Its memory is
            taken per column family whether the table is used or not, so it is off by
            default, for stores of many tables.
        cold_read_threads: most threads a read of many rows is split over while the
            table's reads go to the device, not the page cache (1: never split). A cold
            read waits on one page at a time per thread, and the device serves many at
            once: 250 rows of a cold table read 2.6-2.9x faster on 16 threads than on one
            (`embstore bench cold`). A read the page cache serves stays on the calling
            thread, where more threads would only take turns on the cores
            (`embstore._cold_reads` says how a read is told cold).

    Raises:
        ConfigError: no path, an invalid option, or a table stored with another dim/dtype.
        StoreLockedError: another process has the directory open.
        StoreNotFoundError: read-only open of a directory or table that does not exist.
    """

    name: ClassVar[str] = "rocksdb"
    supports_persistence: ClassVar[bool] = True
    # RocksDB serialises concurrent reads and writes itself (LMDB would too, but growing its
    # map needs every transaction of the process closed, so it stays False there)
    supports_concurrent_reads: ClassVar[bool] = True

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        # docstring inherited
        super().check_options(options)
        settings = dict(options)
        sync_writes = settings.pop("sync_writes", False)
        int_option("rocksdb", "cold_read_threads",
                   settings.pop("cold_read_threads", _COLD_READ_THREADS), 1,
                   _MAX_COLD_READ_THREADS)
        flag_option("rocksdb", "sync_writes", sync_writes)
        _settings(**settings)

    def __init__(self, spec: BackendSpec, *, block_cache_bytes: int = 128 << 20,
                 row_cache_bytes: int = 64 << 20, bloom_bits_per_key: int = 10,
                 compression: str = "none", write_buffer_bytes: int = 64 << 20,
                 block_size_bytes: int = 4096, sync_writes: bool = False,
                 max_background_jobs: int = 2, mmap_reads: bool = False,
                 memtable_bloom_ratio: float = 0.0,
                 cold_read_threads: int = _COLD_READ_THREADS) -> None:
        super().__init__(spec)
        self._cold_reads = ColdReads(int_option("rocksdb", "cold_read_threads",
                                                cold_read_threads, 1, _MAX_COLD_READ_THREADS))
        if spec.path is None:
            raise ConfigError("the rocksdb backend stores rows on disk: give its tier a path")
        self._settings = _settings(block_cache_bytes, row_cache_bytes, bloom_bits_per_key,
                                   compression, write_buffer_bytes, block_size_bytes,
                                   max_background_jobs, mmap_reads, memtable_bloom_ratio)
        self._dir: Path = spec.path
        self._rec = record_dtype(spec.dtype, spec.dim)
        self._cf_name = CF_PREFIX + spec.table
        self._write_opt = rocksdict.WriteOptions()
        self._write_opt.sync = bool(sync_writes)
        self._count: tuple[int, int] | None = None  # (rows, sequence number it was counted at)
        if not spec.read_only:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._key = _HANDLES.key(self._dir)
        shared = _HANDLES.acquire(self._key, self._settings, spec.read_only,
                                  lambda: _open_db(self._dir, self._settings, spec.read_only))
        try:
            self._shared = shared
            self._db: Any = shared.db
            self._generation = shared.generation
            if shared.read_only and shared.files != db_files(self._dir):
                # another reader of this process opened it, and the writer has written since:
                # a reader opened now reads what the directory holds now
                self._reopen_shared()
            self._cf, self._cf_handle = self._open_table(shared)
        except BaseException:
            _HANDLES.release(self._key, _Shared.close)
            raise

    # --- opening --------------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def opening(cls, specs: Sequence[BackendSpec], **options: Any) -> Iterator[None]:
        # docstring inherited
        # opens the database with every column family the tables need, created at once (one
        # options file), and holds it until the tables have borrowed it
        names = {CF_PREFIX + s.table for s in specs}
        paths = {s.path for s in specs}
        key = None
        if len(names) > 1 and len(paths) == 1 and not any(s.read_only for s in specs):
            directory = Path(specs[0].path)  # type: ignore[arg-type]
            try:
                options.pop("sync_writes", None)
                options.pop("cold_read_threads", None)
                settings = _settings(**options)
            except (ConfigError, TypeError):
                settings = None  # `open` reports it, table by table
            if settings is not None:
                with _as_ours(directory):
                    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                    shared = _HANDLES.acquire(_HANDLES.key(directory), settings, False,
                                              lambda: _open_db(directory, settings, False, names))
                    key = _HANDLES.key(directory)
        try:
            if key is not None:
                with _as_ours(directory):
                    _write_metas(shared.db, specs, directory)
            yield
        finally:
            if key is not None:
                _HANDLES.release(key, _Shared.close)

    def _open_table(self, shared: _Shared) -> tuple[Any, Any]:
        meta_key = META_PREFIX + self.spec.table.encode()
        try:
            stored = self._db.get(meta_key)
        except Exception as exc:
            _fail(exc, f"opening table {self.spec.table!r} in {self._dir}", self._dir)
        check_table_meta(self.spec, self._dir, stored)
        if self._cf_name in shared.column_families:
            cf = self._db.get_column_family(self._cf_name)
        elif self.spec.read_only:
            raise StoreNotFoundError(
                f"table {self.spec.table!r} does not exist in RocksDB directory {self._dir}"
            )
        else:
            cf = self._db.create_column_family(self._cf_name, shared.cf_options())
            shared.column_families.add(self._cf_name)
        if stored is None and not self.spec.read_only:
            # Synced: a reopen must find the spec of every table whose rows it finds.
            sync = rocksdict.WriteOptions()
            sync.sync = True
            self._db.put(meta_key, json.dumps(table_meta(self.spec)).encode(), sync)
        return cf, self._db.get_column_family_handle(self._cf_name)

    # --- Backend --------------------------------------------------------------------------

    def _where(self) -> str:
        return f"{self._dir} (RocksDB column family {self._cf_name!r})"

    def _get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(ids) == 0:
            return np.zeros((0, self.spec.dim), dtype=self.spec.dtype), np.zeros(0, dtype=bool)
        # Distinct ids in key order: duplicates are read once and neighbours share blocks.
        uniq, inverse = np.unique(ids, return_inverse=True)
        try:
            values = self._cold_reads.read(encode_keys(uniq), self._cf.__getitem__)
        except Exception as exc:
            _fail(exc, f"reading table {self.spec.table!r} in {self._where()}", self._dir)
        return self._assemble(uniq, inverse, values)

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._cf_handle)
        put = batch.put
        # in key order: each memtable insert then starts its search where the last one's
        # path is still in cache (about 15% less per row on random ids); the ids are distinct,
        # so the order changes nothing stored
        order = np.argsort(ids)
        ids, rows = ids[order], rows[order]
        for key, value in zip(encode_keys(ids), encode_values(ids, rows, self._rec),
                              strict=True):
            put(key, value)
        self._write(batch)

    def _write(self, batch: Any) -> None:
        try:
            self._db.write(batch, self._write_opt)
        except Exception as exc:
            _fail(exc, f"writing table {self.spec.table!r} in {self._where()}", self._dir)

    def _delete(self, ids: np.ndarray) -> np.ndarray:
        keys = encode_keys(ids)
        try:
            present = np.fromiter((v is not None for v in self._cf[keys]), dtype=bool,
                                  count=len(keys))
        except Exception as exc:
            _fail(exc, f"reading table {self.spec.table!r} in {self._where()}", self._dir)
        if present.any():
            batch = rocksdict.WriteBatch(raw_mode=True)
            batch.set_default_column_family(self._cf_handle)
            for key, hit in zip(keys, present.tolist(), strict=True):
                if hit:
                    batch.delete(key)
            self._write(batch)
        return present

    def _scan_page(self, after: bytes | None, limit: int, values: bool
                   ) -> tuple[list[bytes], list[Any]]:
        # its own iterator, seeking past the previous page: an open iterator keeps the
        # database open
        keys: list[bytes] = []
        vals: list[bytes] = []
        try:
            it = self._cf.iter()
            if after is None:
                it.seek_to_first()
            else:
                it.seek(after)
                if it.valid() and it.key() == after:
                    it.next()
            while len(keys) < limit and it.valid():
                keys.append(it.key())
                if values:
                    vals.append(it.value())
                it.next()
            # An iterator stops (valid() False) on an I/O or checksum error as it does at the
            # end; only status() tells them apart.
            it.status()
            del it
        except Exception as exc:
            _fail(exc, f"scanning table {self.spec.table!r} in {self._where()}", self._dir)
        return keys, vals

    def _len(self) -> int:
        seq = self._db.latest_sequence_number()
        if self._count is None or self._count[1] != seq:
            n = sum(len(keys) for keys, _ in self._scan(1 << 16, values=False))
            self._count = (n, seq)
        return self._count[0]

    def nbytes(self) -> int:
        # docstring inherited
        total = 0
        for prop in ("rocksdb.total-sst-files-size", "rocksdb.cur-size-all-mem-tables"):
            total += self._cf.property_int_value(prop) or 0
        return total

    def statistics(self) -> dict[str, Any]:
        # docstring inherited
        stats = super().statistics()
        stats["path"] = str(self._dir)
        stats["column_family"] = self._cf_name
        stats["options"] = dict(self._settings)
        stats["estimated_keys"] = self._cf.property_int_value("rocksdb.estimate-num-keys")
        return stats

    def bulk_load(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store `rows` (array[N, dim]) under distinct `ids` (int64[N]) by SST ingestion.

        The rows are written in key order into an SST file beside the database, synced, and
        ingested into the table's column family (RocksDB's `SstFileWriter` and
        `IngestExternalFile`): no write-ahead log, no memtable, no compaction of the loaded
        rows. Rows of ids already stored are replaced. Durable when it returns.

        Raises:
            StoreClosedError, ReadOnlyError, DtypeMismatchError, DimensionMismatchError.
            InvalidIdsError: `ids` are not distinct.
        """
        self._check_writable()
        ids = self._check_ids(ids)
        rows = self._check_rows(ids, rows)
        if not len(ids):
            return
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():
            raise InvalidIdsError(f"bulk_load of table {self.spec.table!r} needs distinct ids")
        rows = rows[order]
        file = self._dir / f".bulk-{os.getpid()}-{self._db.latest_sequence_number()}.sst"
        try:
            writer = rocksdict.SstFileWriter(_make_options(self._settings,
                                                           rocksdict.Cache(1 << 20)))
            writer.open(str(file))
            for key, value in zip(encode_keys(ids), encode_values(ids, rows, self._rec),
                                  strict=True):
                writer[key] = value
            writer.finish()
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            ingest = rocksdict.IngestExternalFileOptions()
            ingest.set_move_files(True)
            self._cf.ingest_external_file([str(file)], ingest)
        except Exception as exc:
            _fail(exc, f"bulk loading table {self.spec.table!r} in {self._where()}", self._dir)
        finally:
            file.unlink(missing_ok=True)
        self._count = None

    def compact(self) -> None:
        """Compact the table's column family into its bottom level, dropping overwritten rows.

        Blocks until done; reads and writes may run meanwhile but are slower.

        Raises:
            StoreClosedError: after close().
            ReadOnlyError: opened read-only.
        """
        self._check_writable()
        try:
            self._cf.compact_range(None, None)
        except Exception as exc:
            _fail(exc, f"compacting table {self.spec.table!r} in {self._where()}", self._dir)

    def _flush(self) -> None:
        # one log serves every table of the directory: a flush of the store flushes each
        # table, and only the first of them after a write has anything to sync
        seq = self._db.latest_sequence_number()
        if seq == self._shared.synced_seq:
            return
        try:
            self._db.flush_wal(True)
        except Exception as exc:
            _fail(exc, f"syncing the write-ahead log of {self._dir}", self._dir)
        self._shared.synced_seq = seq
        restrict_modes(self._dir)

    def _refresh(self) -> None:
        """Reopen the read-only database, unless another table of the directory did already.

        The old database stays open while a table of this process still reads through it
        (rocksdict closes it with its last reference).
        """
        shared = self._shared
        if not shared.read_only:
            return  # the writer's own handle, borrowed: it sees every write already
        if shared.generation == self._generation:
            self._reopen_shared()
        self._cf.close()
        self._db, self._generation = shared.db, shared.generation
        self._cf, self._cf_handle = self._open_table(shared)
        self._count = None

    def _reopen_shared(self) -> None:
        """Open the directory's read-only database anew for every table of this process.

        Tables still bound to the old one (by `_db`) read it until their own `_refresh`.
        """
        shared = self._shared
        cache = rocksdict.Cache(dict(self._settings)["block_cache_bytes"])
        settings = self._settings
        files = db_files(self._dir)
        try:
            db, cfs = open_read_only(self._dir, _make_options(settings, cache, db=True),
                                     lambda: _make_options(settings, cache))
        except EmbstoreError:
            raise
        except Exception as exc:
            _fail(exc, f"reopening RocksDB directory {self._dir} read-only", self._dir)
        shared.db, shared.generation = db, shared.generation + 1
        shared.column_families, shared.files = set(cfs), files
        self._db, self._generation = shared.db, shared.generation

    def _close(self) -> None:
        # Drop every reference to the column family first: rocksdict closes the database only
        # when no object refers to it. Released even where closing the column family fails
        # (its write-back of a full disk): a handle kept borrowed would hold the database's
        # files, and the disk space of a removed directory, open until the process ends.
        try:
            self._cf.close()
        finally:
            del self._cf, self._cf_handle, self._shared
            self._db = None
            _HANDLES.release(self._key, _Shared.close)


@contextlib.contextmanager
def _as_ours(directory: Path) -> Iterator[None]:
    """Raise an error of rocksdict as an embstore error (as `Backend.open` does)."""
    try:
        yield
    except (EmbstoreError, MemoryError):
        raise
    except Exception as exc:
        raise foreign_error(exc, f"opening RocksDB directory {directory}", directory) from exc


def _write_metas(db: Any, specs: Sequence[BackendSpec], directory: Path) -> None:
    """Record the spec of every table of `specs` that has none, in one synced write.

    What each table's open would write, synced once for all; tables with a record keep it,
    and their open checks it.
    """
    keys = [META_PREFIX + s.table.encode() for s in specs]
    try:
        stored = db[keys]
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, spec, value in zip(keys, specs, stored, strict=True):
            if value is None:
                batch.put(key, json.dumps(table_meta(spec)).encode())
        if len(batch):
            sync = rocksdict.WriteOptions()
            sync.sync = True
            db.write(batch, sync)
    except Exception as exc:
        _fail(exc, f"recording the tables of RocksDB directory {directory}", directory)


def _open_db(directory: Path, settings: tuple[tuple[str, Any], ...], read_only: bool,
             create: Collection[str] = ()) -> _Shared:
    """Open the database of `directory`, creating the column families `create` it lacks.

    Called once per directory and process, by the first table opened there (or by `opening`).
    """
    cache = rocksdict.Cache(dict(settings)["block_cache_bytes"])
    path = str(directory)
    refuse_special_files(directory, "RocksDB")
    exists = (directory / "CURRENT").exists()
    if read_only and not exists:
        raise missing_medium("RocksDB database", directory)
    if read_only:  # beside a writer, through a private directory of links (_rocksdb_read)
        files = db_files(directory)
        try:
            db, cfs = open_read_only(directory, _make_options(settings, cache, db=True),
                                     lambda: _make_options(settings, cache))
        except EmbstoreError:
            raise
        except Exception as exc:
            _fail(exc, f"opening RocksDB directory {directory} read-only", directory)
        shared = _Shared(db, lambda: _make_options(settings, cache), set(cfs), None,
                         read_only=True)
        shared.files = files
        return shared
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        # rocksdict takes paths as UTF-8 text (a reader goes through links of its own)
        raise ConfigError(f"RocksDB cannot open {path!r} for writing: its path is not valid "
                          "UTF-8; rename the directory (or the ones above it) to UTF-8 names"
                          ) from None
    if exists:
        check_log_framing(directory)
    cfs = rocksdict.Rdict.list_cf(path, rocksdict.Options(raw_mode=True)) if exists else []
    names = (set(cfs) | set(create)) - {"default"}
    access = rocksdict.AccessType.read_write()  # (read-only opens returned above)
    opts = _make_options(settings, cache, db=True, column_families=max(1, len(names)))
    if create:
        opts.create_missing_column_families(True)
    try:
        # RocksDB must open every existing column family; each gets the tier's options.
        db = rocksdict.Rdict(path, opts,
                             column_families={n: _make_options(settings, cache)
                                              for n in sorted(names)} or None,
                             access_type=access)
    except Exception as exc:
        # "While lock file: .../LOCK: Resource temporarily unavailable" (not any message
        # that merely contains "block")
        if "lock file" in str(exc).lower():
            raise StoreLockedError(
                f"RocksDB directory {directory} is open in another process ({exc}); "
                "close the store that uses it first"
            ) from exc
        _fail(exc, f"opening RocksDB directory {directory}", directory)
    restrict_modes(directory)
    return _Shared(db, lambda: _make_options(settings, cache), names | {"default"}, directory)


class _Shared:
    """The database of one directory, with what tables opened later need from it."""

    def __init__(self, db: Any, cf_options: Any, column_families: set[str],
                 writable_dir: Path | None, *, read_only: bool = False) -> None:
        self.db = db
        self.read_only = read_only
        self.cf_options = cf_options
        self.column_families = column_families
        self.writable_dir = writable_dir
        """The directory, where the database is open for writing."""
        self.synced_seq: int | None = None
        """The sequence number the log was last synced at by a flush (None: not yet)."""
        self.generation = 0  # bumped by each reopen of a read-only database (`_refresh`)
        self.files: object = None  # a read-only database's files as it opened them (`db_files`)

    def close(self) -> None:
        """Close the database (the last table of the directory was closed)."""
        db, self.db = self.db, None  # dropped even where closing fails: that frees it
        db.close()
        if self.writable_dir is not None and self.writable_dir.exists():
            restrict_modes(self.writable_dir)  # closing may have written a new log or manifest
