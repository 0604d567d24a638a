"""The LMDB backend: rows in a memory-mapped B+tree, one named database per table.

A tier directory holds one LMDB environment (``data.mdb``, ``lock.mdb``, created with mode
0600) shared by the tables of the tier; table `t` is the named database ``t:<t>``, and the
named database ``embstore:meta`` holds one JSON record per table (dim, dtype, format) checked
on reopen. A batch is read in one read transaction and written in one write transaction. The
map grows by itself: a write that fills it is rolled back, the map is doubled and the whole
transaction is retried.

A read-only handle reads beside a writer in another process, each batch in a read transaction
of its own, so it sees every write the writer had committed when the batch began. It changes
nothing but its slot in ``lock.mdb``, LMDB's table of readers (which keeps the writer from
reusing the pages a reader reads).

Keys are 8 bytes, big-endian with the sign bit flipped, so a scan yields ids in numeric order.
Stored value layout (R = BackendSpec.row_bytes), imported by the corruption tests:

    offset  size  field
    0       4     CRC-32C, uint32 little-endian, of the id (8 bytes little-endian) ++ payload
    4       R     payload: the row, BackendSpec.dtype, C order

LMDB has no checksums of its own; the per-row CRC detects any change of a stored value.

Durability (default `sync_commits=True`): each write transaction syncs its data pages on commit
but not the meta page (MDB_NOMETASYNC), so a crash of the process or of the OS may undo the
last committed batch (D), never mix two (A, C). `flush()` syncs everything: after it returns
no crash loses an earlier write. `sync_commits=False` (MDB_NOSYNC) skips the per-commit sync:
a process crash still loses nothing, but an OS crash or power loss between flushes may lose or
damage the environment (A, C and D), as LMDB documents for MDB_NOSYNC.
"""

from __future__ import annotations

import contextlib
import errno
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final, NoReturn, TypeVar, final

import lmdb
import numpy as np

from embstore.backend import BackendSpec, foreign_error
from embstore.errors import (
    CapacityError,
    ConfigError,
    CorruptStoreError,
    StorageIOError,
    StoreLockedError,
    StoreNotFoundError,
)
from embstore.manifest import fsync_dir

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

__all__ = ["CRC_OFFSET", "CRC_SIZE", "FILE_MODE", "PAYLOAD_OFFSET", "VALUE_LAYOUT",
           "LMDBBackend"]

FILE_MODE: Final = 0o600
DB_PREFIX: Final = b"t:"
META_DB: Final = b"embstore:meta"

_HANDLES: SharedHandles[lmdb.Environment] = SharedHandles("lmdb")
_SYNCED: dict[str, int] = {}
"""Per open environment (by directory), the last transaction a flush synced."""
T = TypeVar("T")
# Upper bounds of the options LMDB's C API takes. Past them py-lmdb raised an OverflowError
# (it passes them as C ints; map sizes as size_t), which read as a damaged store.
_SIZE_T_MAX: Final = 2**64 - 1
# max_dbs (MDB_dbi, an unsigned int): LMDB allocates ~50 bytes per named database for the
# environment and again for every transaction, so 2**31 - 1 failed with ENOMEM, and 2**20
# (50 MiB) is still far more tables than a store opens.
_MAX_TABLES: Final = 1 << 20
# max_readers (unsigned int): each slot is 64 bytes of lock.mdb, which every process maps;
# 2**31 - 1 made a 128 GiB lock file.
_MAX_READERS: Final = 1 << 20


@final
class LMDBBackend(KeyValueBackend):
    """One table in a named database of the LMDB environment of its tier directory.

    Args:
        spec: the table; `spec.path` is the tier directory.
        map_size_bytes: initial size of the memory map (the file grows only as pages are used).
        max_map_size_bytes: the map never grows past this; a write that needs more raises
            CapacityError.
        sync_commits: sync the data pages of every write transaction (see the module's
            Durability note); False defers every sync to `flush()`.
        max_tables: named databases the environment can hold (LMDB's max_dbs), one per table.
        max_readers: concurrent read transactions across processes.
        readahead: let the OS read ahead on page faults; off suits random lookups in a table
            larger than memory.

    Raises:
        ConfigError: no path or an invalid option, or a table stored with another dim/dtype.
        StoreLockedError: the directory is open read-only in this process and a writer asks.
        StoreNotFoundError: read-only open of a directory or table that does not exist.
    """

    name: ClassVar[str] = "lmdb"
    supports_persistence: ClassVar[bool] = True

    def __init__(self, spec: BackendSpec, *, map_size_bytes: int = 1 << 30,
                 max_map_size_bytes: int = 1 << 40, sync_commits: bool = True,
                 max_tables: int = 64, max_readers: int = 126, readahead: bool = False) -> None:
        super().__init__(spec)
        if spec.path is None:
            raise ConfigError("the lmdb backend stores rows on disk: give its tier a path")
        self._settings = self._check_options(
            map_size_bytes=map_size_bytes, max_map_size_bytes=max_map_size_bytes,
            sync_commits=sync_commits, max_tables=max_tables, max_readers=max_readers,
            readahead=readahead)
        self._dir: Path = spec.path
        self._file = self._dir / "data.mdb"
        self._max_map = max_map_size_bytes
        self._rec = record_dtype(spec.dtype, spec.dim)
        if not spec.read_only:
            # Made here, not by lmdb.open: LMDB would give the directory FILE_MODE, no x bit.
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._key = _HANDLES.key(self._dir)
        self._stale_readers_cleared = 0  # set when this instance opens the env

        def open_env() -> Any:
            env, self._stale_readers_cleared = _open_env(self._dir, self._settings,
                                                         spec.read_only, max_tables)
            return env

        self._env: Any = _HANDLES.acquire(self._key, self._settings, spec.read_only, open_env)
        try:
            self._db = self._open_table()
        except BaseException:
            _HANDLES.release(self._key, _close_env)
            raise

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        # docstring inherited
        super().check_options(options)
        cls._check_options(**options)  # checked apart from the files: a manifest's too

    @staticmethod
    def _check_options(*, map_size_bytes: int = 1 << 30,
                       max_map_size_bytes: int = 1 << 40, sync_commits: bool = True,
                       max_tables: int = 64, max_readers: int = 126,
                       readahead: bool = False) -> tuple[tuple[str, Any], ...]:
        """The settings of an environment from the options (see the class), checked.

        Raises:
            ConfigError: an invalid option.
        """
        for opt, value, low, high in (
                ("map_size_bytes", map_size_bytes, 1 << 16, _SIZE_T_MAX),
                ("max_map_size_bytes", max_map_size_bytes, 1 << 16, _SIZE_T_MAX),
                ("max_tables", max_tables, 2, _MAX_TABLES),
                ("max_readers", max_readers, 1, _MAX_READERS)):
            int_option("lmdb", opt, value, low, high)
        if map_size_bytes > max_map_size_bytes:  # often only one of them was given
            raise ConfigError(f"lmdb option map_size_bytes ({map_size_bytes}) is above "
                              f"max_map_size_bytes ({max_map_size_bytes}), past which the map "
                              "never grows: lower it, or raise max_map_size_bytes with it")
        return (("map_size_bytes", map_size_bytes),
                ("max_map_size_bytes", max_map_size_bytes),
                ("sync_commits", flag_option("lmdb", "sync_commits", sync_commits)),
                ("max_tables", max_tables),
                ("max_readers", max_readers),
                ("readahead", flag_option("lmdb", "readahead", readahead)))

    # --- opening --------------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def opening(cls, specs: Sequence[BackendSpec], **options: Any) -> Iterator[None]:
        # docstring inherited
        # LMDB's max_dbs bounds the named databases a process opens in an environment, fixed
        # when it opens it: the environment is opened here with room for every table, so
        # that a store of more tables than `max_tables` opens as well
        key = None
        paths = {s.path for s in specs}
        if len(specs) > 1 and len(paths) == 1 and None not in paths:
            directory = Path(specs[0].path)  # type: ignore[arg-type]
            try:
                settings = cls._check_options(**options)
            except (ConfigError, TypeError):
                settings = None  # `open` reports it, table by table
            read_only = specs[0].read_only
            if len({s.read_only for s in specs}) > 1:
                settings = None
            if settings is not None and (not read_only or (directory / "data.mdb").exists()):
                max_dbs = max(dict(settings)["max_tables"], len(specs) + 1)
                if not read_only:
                    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                key = _HANDLES.key(directory)
                _HANDLES.acquire(key, settings, read_only,
                                 lambda: _open_env(directory, settings, read_only, max_dbs)[0])
        try:
            yield
        finally:
            if key is not None:
                _HANDLES.release(key, _close_env)

    def _open_table(self) -> Any:
        name = DB_PREFIX + self.spec.table.encode()
        create = not self.spec.read_only
        try:
            meta_db = self._env.open_db(META_DB, create=create)
            with self._env.begin(db=meta_db) as txn:
                stored = txn.get(self.spec.table.encode())
        except lmdb.NotFoundError:
            stored = None
        except lmdb.Error as exc:
            _fail(exc, f"opening table {self.spec.table!r} in {self._dir}")
        check_table_meta(self.spec, self._dir, stored)
        try:
            if create:
                # In a write transaction of ours, so that a full map grows instead of failing.
                db = self._write_txn(lambda txn: self._env.open_db(name, txn=txn, create=True))
            else:
                db = self._env.open_db(name, create=False)
        except lmdb.NotFoundError as exc:
            raise StoreNotFoundError(
                f"table {self.spec.table!r} does not exist in LMDB environment {self._dir}"
            ) from exc
        except lmdb.Error as exc:
            _fail(exc, f"opening table {self.spec.table!r} in {self._dir}")
        if stored is None and create:
            record = json.dumps(table_meta(self.spec)).encode()
            self._write_txn(lambda txn: txn.put(self.spec.table.encode(), record, db=meta_db))
        return db

    # --- transactions ---------------------------------------------------------------------

    def _write_txn(self, body: Callable[[Any], T]) -> T:
        """Run `body(txn)` in one write transaction, growing the map and retrying when full."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    return body(txn)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size and retry.
                self._env.set_mapsize(0)
            except lmdb.Error as exc:
                _fail(exc, f"writing table {self.spec.table!r} in {self._file}")

    def _read_txn(self, body: Callable[[Any], T]) -> T:
        """Run `body(txn)` in one read transaction; values come as bytes copied from the map.

        Copies rather than buffers into the map (py-lmdb's buffers=True): joining thousands of
        memoryviews measured slower than copying each value once.
        """
        while True:
            try:
                with self._env.begin() as txn:
                    return body(txn)
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
            except lmdb.Error as exc:
                _fail(exc, f"reading table {self.spec.table!r} in {self._file}")

    def _grow(self) -> None:
        # The transaction was rolled back, so no transaction of this process is open: LMDB
        # allows set_mapsize only then.
        size = self._env.info()["map_size"]
        if size >= self._max_map:
            raise CapacityError(
                f"LMDB environment {self._dir} is full at its maximum map size of {size} bytes",
                hint="raise the tier's max_map_size_bytes option or free disk space",
            )
        self._env.set_mapsize(min(size * 2, self._max_map))

    # --- Backend --------------------------------------------------------------------------

    def _get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(ids)
        if n == 0:
            return np.zeros((0, self.spec.dim), dtype=self.spec.dtype), np.zeros(0, dtype=bool)
        # Distinct ids in key order: duplicates are read once and neighbours share pages.
        uniq, inverse = np.unique(ids, return_inverse=True)
        keys = encode_keys(uniq)
        db = self._db

        def read(txn: Any) -> tuple[np.ndarray, np.ndarray]:
            get = txn.get
            return self._assemble(uniq, inverse, [get(k, db=db) for k in keys])

        return self._read_txn(read)

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        items = list(zip(encode_keys(ids), encode_values(ids, rows, self._rec), strict=True))
        self._write_txn(lambda txn: txn.cursor(db=self._db).putmulti(items))

    def _delete(self, ids: np.ndarray) -> np.ndarray:
        keys = encode_keys(ids)

        def delete(txn: Any) -> np.ndarray:
            rm = txn.delete
            return np.fromiter((rm(k, db=self._db) for k in keys), dtype=bool, count=len(keys))

        return self._write_txn(delete)

    def _where(self) -> str:
        return str(self._file)

    def _scan_page(self, after: bytes | None, limit: int, values: bool
                   ) -> tuple[list[bytes], list[Any]]:
        # its own read transaction: an open one would block growing the map and pin old pages
        def read(txn: Any) -> tuple[list[bytes], list[Any]]:
            cur = txn.cursor(db=self._db)
            keys: list[bytes] = []
            vals: list[Any] = []
            ok = cur.first() if after is None else cur.set_range(after)
            if ok and after is not None and cur.key() == after:
                ok = cur.next()
            while ok and len(keys) < limit:
                keys.append(cur.key())
                if values:
                    vals.append(cur.value())
                ok = cur.next()
            return keys, vals

        return self._read_txn(read)

    def _len(self) -> int:
        return int(self._read_txn(lambda txn: txn.stat(self._db)["entries"]))

    def nbytes(self) -> int:
        # docstring inherited
        st = self._read_txn(lambda txn: txn.stat(self._db))
        pages = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return int(pages * st["psize"])

    def statistics(self) -> dict[str, Any]:
        # docstring inherited
        stats = super().statistics()
        info = self._env.info()
        stats["path"] = str(self._file)
        stats["map_size"] = info["map_size"]
        stats["stale_readers_cleared"] = self._stale_readers_cleared
        stats["options"] = dict(self._settings)
        return stats

    def _flush(self) -> None:
        # the tables of a directory share its environment: a store's flush flushes each of
        # them, and only the first after a commit has anything to sync
        txnid = self._env.info()["last_txnid"]
        if _SYNCED.get(self._key) == txnid:
            return
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            _fail(exc, f"syncing LMDB environment {self._dir}")
        _SYNCED[self._key] = txnid

    def _close(self) -> None:
        self._db = None
        self._env = None
        key = self._key

        def close(env: Any) -> None:  # the directory's last table
            _SYNCED.pop(key, None)
            _close_env(env)

        _HANDLES.release(key, close)


# LMDB's meta pages (pages 0 and 1, 64-bit build): offsets within a page.
META_MAGIC = 0xBEEFC0DE
META_MAGIC_OFFSET = 16   # uint32 mm_magic, after the 16-byte page header
META_PSIZE_OFFSET = 40   # uint32 md_pad of the free-list database: the page size
META_LAST_PG_OFFSET = 136  # uint64 mm_last_pg: the last page in use
META_TXNID_OFFSET = 144  # uint64 mm_txnid: the meta page with the larger one is current


def check_data_file(file: Path) -> None:
    """Refuse a `data.mdb` shorter than its current meta page says it is.

    LMDB maps the file and reads pages up to the last one in use without comparing with the
    file's size: a truncated file would end the process with SIGBUS instead of an error. It
    takes the page size from the current meta page without checking it either, so a damaged
    one (8192 where the file has 4096-byte pages) addresses pages past the end just as well.
    The check reads the meta pages where LMDB reads them (the second one at the first one's
    page size) and measures the current one's pages in its own page size.

    Raises:
        CorruptStoreError: the file is shorter than the pages it claims, or the current
            meta page's page size is not a power of two from 512 to 65536 bytes.
    """
    size = file.stat().st_size

    def field(meta: bytes, offset: int, width: int) -> int:
        return int.from_bytes(meta[offset:offset + width], "little")

    metas = []  # (txnid, last page, page size) of each meta page with LMDB's magic
    with open(file, "rb") as fh:
        base = 0
        for page in (0, 1):
            fh.seek(base)
            meta = fh.read(META_TXNID_OFFSET + 8)
            if len(meta) < META_TXNID_OFFSET + 8:
                break
            psize = field(meta, META_PSIZE_OFFSET, 4)
            if field(meta, META_MAGIC_OFFSET, 4) == META_MAGIC:
                metas.append((field(meta, META_TXNID_OFFSET, 8),
                              field(meta, META_LAST_PG_OFFSET, 8), psize))
            if page == 0 and not psize:
                break  # LMDB would read the first page again: it reports the damage
            base = psize
    if not metas:
        return  # damaged beyond a meta page: LMDB reports it without reading a page
    _, last_pg, psize = max(metas)
    if not 512 <= psize <= 65536 or psize & (psize - 1):
        raise CorruptStoreError(
            f"{file}: its current meta page gives a page size of {psize} bytes, which LMDB "
            "never writes: the meta page is damaged; restore the tier from a checkpoint")
    if (last_pg + 1) * psize > size:
        raise CorruptStoreError(
            f"{file} has {size} bytes but its current meta page uses {last_pg + 1} pages of "
            f"{psize} bytes: the file was truncated or the meta page is damaged; restore the "
            "tier from a checkpoint")


def _open_env(directory: Path, settings: tuple[tuple[str, Any], ...], read_only: bool,
              max_dbs: int) -> tuple[Any, int]:
    """Open the environment of `directory` (once per directory and process).

    Returns it and the count of reader slots of dead processes it cleared.

    Raises:
        StoreNotFoundError: read-only, and there is none.
        CorruptStoreError, StoreLockedError: from LMDB.
    """
    s = dict(settings)
    refuse_special_files(directory, "LMDB")
    file = directory / "data.mdb"
    if read_only and not file.exists():
        raise missing_medium("LMDB environment", directory)
    created_before = file.exists()
    if created_before:
        check_data_file(file)
        if read_only and not file.stat().st_size:
            # a writer would lay out a new environment in it; a reader cannot open it at all
            raise CorruptStoreError(f"{file} is empty: the environment's pages are gone; "
                                    "restore the tier from a checkpoint")
    try:
        env = lmdb.open(str(directory), map_size=s["map_size_bytes"], subdir=True,
                        readonly=read_only, create=not read_only,
                        mode=FILE_MODE, sync=s["sync_commits"], metasync=False,
                        max_dbs=max_dbs, max_readers=s["max_readers"],
                        readahead=s["readahead"], lock=True)
    except lmdb.Error as exc:
        _fail(exc, f"opening LMDB environment {directory}")
    if not read_only and not created_before:
        # the new data file's directory entry must survive a power cut like its pages
        fsync_dir(directory)
    # Reader slots of dead processes pin old pages and would stop the file from reusing
    # them; a reader leaves them to the writer.
    return env, 0 if read_only else env.reader_check()


def _close_env(env: Any) -> None:
    env.close()


def _fail(exc: lmdb.Error, what: str) -> NoReturn:
    """Re-raise an LMDB error as the embstore error it means (as itself where none fits)."""
    if isinstance(exc, lmdb.CorruptedError | lmdb.InvalidError | lmdb.PageNotFoundError):
        raise CorruptStoreError(
            f"{what}: LMDB reports a damaged environment ({exc}); restore the tier from a "
            "checkpoint"
        ) from exc
    if isinstance(exc, lmdb.LockError | lmdb.ReadersFullError):
        raise StoreLockedError(f"{what}: {exc}; close the other users of the environment") \
            from exc
    if isinstance(exc, lmdb.DbsFullError):
        raise ConfigError(
            f"{what}: the LMDB environment holds more tables than its max_tables option "
            f"allows ({exc}); raise the lmdb tier's max_tables option") from exc
    if isinstance(exc, lmdb.MemoryError):  # a map the address space or the OS cannot give
        raise CapacityError(f"{what}: {exc}", hint="lower the lmdb tier's map_size_bytes "
                            "(and max_map_size_bytes) to what this machine can map") from exc
    if isinstance(exc, lmdb.MapFullError):
        raise CapacityError(f"{what}: {exc}", hint="raise the tier's max_map_size_bytes option") \
            from exc
    if isinstance(exc, lmdb.DiskError | lmdb.ReadonlyError):  # the medium, not the data
        raise StorageIOError(errno.EROFS if isinstance(exc, lmdb.ReadonlyError) else errno.EIO,
                             f"{what}: {exc}; check the device (dmesg), then reopen the "
                             "store") from exc
    raise foreign_error(exc, what, None) from exc
