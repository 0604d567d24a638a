"""Writing a whole store anew beside the old one and swapping it in: compact, migrate, repair.

`write_store` fills a new store directory straight into each table's store of record, page by
page from a row source (bounded memory), then writes its manifest and history.
`replace_store` builds such a copy next to a store and exchanges the two directories with one
atomic `renameat2(RENAME_EXCHANGE)`, so that SIGKILL at any moment leaves at the store's path
either the old store or the new one, each complete; a leftover `.<name>.rebuild-*` directory
of a killed run is removed by the next one, except an old store that a killed run promised to
keep (a repair's backup, `_kept.recover_kept`).

Where the file system cannot exchange directories, the swap is two renames with the old
store parked at `.<name>.swap-old`; `recover_swap` (called by every rebuild first) puts it
back if a crash fell between them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import _counters, _crash, registry
from ._kept import mark_keep, recover_kept, recover_swap, unmark_keep
from ._lmdb_walk import newest_meta
from ._lmdb_walk import walk as walk_lmdb
from ._written import WrittenIds, write_record
from .backend import Backend, BackendSpec, SupportsBulkLoad
from .errors import CapacityError, ConfigError, CorruptStoreError
from .layout import (
    bottom_dir,
    check_inside,
    foreign_entries,
    lock,
    manifest_body,
    parked_store,
    parse_manifest,
    read_manifest,
    release,
    require_directory,
    table_chain,
    write_manifest,
    written_file,
)
from .manifest import fsync_dir, fsync_tree
from .spec import TableSpec, TierSpec

__all__ = ["ClosablePages", "RowSource", "check_chains", "keeps_written_record", "open_bottom",
           "page_rows", "read_store", "replace_store", "store_rows", "write_store"]

BATCH_ROWS = 65536
PAGE_BYTES = 4 << 20
"""Bytes of rows per page when streaming a table: a page is copied a few times on its way
(library values, checks, the new medium), so this bounds the memory of a copy."""


def page_rows(spec: TableSpec) -> int:
    """Rows per page of `spec` when streaming it (about PAGE_BYTES of rows)."""
    row_bytes = int(spec.storage_width * spec.storage_dtype.itemsize)
    return max(256, min(BATCH_ROWS, PAGE_BYTES // row_bytes))
RowSource = Callable[[TableSpec], tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]]
"""For a table: (its row count, pages of (ids int64[N], full rows [N, row_width]))."""


# a one-pass scan gains nothing from caching blocks or rows: small caches keep its memory
# bounded (RocksDB's defaults would grow to 192 MiB of cache)
_SCAN_OPTIONS: dict[str, dict[str, Any]] = {
    "rocksdb": {"block_cache_bytes": 8 << 20, "row_cache_bytes": 0}}


def open_bottom(root: Path, spec: TableSpec, default_tiers: Sequence[TierSpec], *,
                read_only: bool, rows_hint: int | None = None, scan: bool = False) -> Backend:
    """The store of record of table `spec` in the store at `root`.

    `rows_hint` sizes a medium that preallocates (pmem) for that many rows; `scan` opens it
    for one pass over every row (small caches).
    """
    ts = table_chain(spec, default_tiers)[-1]
    path = bottom_dir(root, spec, default_tiers)
    check_inside(root, path)  # as opening the store checks: never through a link
    cls: type[Backend] = registry.load_backend(ts.backend)
    capacity = None
    if rows_hint is not None and ts.backend == "pmem":
        fmt = importlib.import_module("embstore.backends._pmem_format")
        capacity = int(fmt.DATA_OFFSET + max(rows_hint, 1) * fmt.record_size(
            spec.storage_width * spec.storage_dtype.itemsize))
    return cls.open(BackendSpec(path=path, dim=spec.storage_width,
                                dtype=spec.storage_dtype, table=spec.name, read_only=read_only,
                                capacity_bytes=capacity),
                    **{**ts.options, **(_SCAN_OPTIONS.get(ts.backend, {}) if scan else {})})


def read_store(root: Path) -> tuple[dict[str, Any], list[TableSpec], tuple[TierSpec, ...]]:
    """The manifest of the store at `root`, its tables and default chain.

    Raises:
        StoreNotFoundError, CorruptStoreError: no store or a damaged manifest.
        ConfigError: an incremental checkpoint (restore it first).
    """
    require_directory(Path(root), links=True)
    doc = read_manifest(root)
    if (doc.get("checkpoint") or {}).get("kind") == "incremental":
        raise ConfigError(f"{root} is an incremental checkpoint; materialise it with "
                          "embstore.restore(src, new_path) first")
    tiers, tables = parse_manifest(root, doc)
    return doc, tables, tiers


def keeps_written_record(spec: TableSpec, default_tiers: Sequence[TierSpec]) -> bool:
    """Whether table `spec` keeps a written-id record (embstore._written).

    It does where its store of record persists and keeps every row: no policy of its own
    drops writes (admission) or rows (eviction).
    """
    bottom = table_chain(spec, default_tiers)[-1]
    return (registry.load_backend(bottom.backend).supports_persistence
            and bottom.eviction is None and bottom.admission in (None, "always"))


def store_rows(root: Path, default_tiers: Sequence[TierSpec],
               specs: Sequence[TableSpec], *, check_written: bool = True) -> RowSource:
    """A row source reading each table's store of record at `root` (read-only).

    `specs` are the tables as the store at `root` has them; the source is asked by name, so
    the new store may give a table another chain. With `check_written`, a table whose
    written-id record holds ids its store of record lacks (a lost file, lost rows) raises
    `CorruptStoreError` once its last page is read, before anything is swapped in: a copy
    must not turn rows the medium lost into rows that were never written.
    """
    by_name = {s.name: s for s in specs}
    listed = read_manifest(root).get("written_records", []) if check_written else []
    walked: set[Path] = set()  # LMDB files found sound (tables may share one)

    def source(spec: TableSpec) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
        old = by_name[spec.name]
        recorded = None
        if (check_written and isinstance(listed, list) and old.name in listed
                and keeps_written_record(old, default_tiers)):
            recorded = _RecordedIds(_record(root, old), old.num_embeddings)
        where = bottom_dir(root, old, default_tiers)
        if not where.is_dir():  # every store of record has its directory from the start
            raise CorruptStoreError(f"table {old.name!r}: its store of record {where} is "
                                    f"missing; nothing was changed. Run `embstore fsck {root}`")
        if table_chain(old, default_tiers)[-1].backend == "lmdb":
            _refuse_damaged_lmdb(root, old.name, where / "data.mdb", walked)
        backend = open_bottom(root, old, default_tiers, read_only=True, scan=True)
        try:
            count = len(backend)
        except BaseException:
            backend.close()
            raise

        def pages() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            with backend:
                for ids, rows in backend.items(page_rows(spec)):
                    if recorded is not None:
                        recorded.seen(ids)
                    yield ids, rows
                if recorded is not None and recorded.missing():
                    _report_lost(root, old, recorded.missing(), backend)
        return count, ClosablePages(pages(), backend.close)
    return source


def _refuse_damaged_lmdb(root: Path, table: str, file: Path, walked: set[Path]) -> None:
    """Raise CorruptStoreError if the B-trees of the LMDB data file `file` are damaged.

    LMDB trusts the page numbers in its file: a damaged tree read through its memory map
    kills the process with SIGBUS, before any error could be raised, and leaves the copy
    half made. fsck's walk (pure Python, one page at a time, every bound checked; about a
    third of a copy's time) finds that damage first, from the meta page LMDB uses, the one
    of the newest transaction, as fsck does; a fault of that meta page is damage too. A file
    that cannot be opened is left to the open to report.
    """
    if file in walked:
        return
    try:
        current = newest_meta(file)
    except OSError:
        return
    problems = [(current.page * current.page_size, p) for p in current.problems]
    if not problems:
        problems = walk_lmdb(file, current)
    if problems:
        offset, problem = problems[0]
        more = f" and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
        raise CorruptStoreError(
            f"table {table!r}: its LMDB file {file} is damaged (at byte {offset}: "
            f"{problem}{more}); nothing was changed. Run `embstore fsck {root}`, then "
            "repair it (`embstore fsck --repair`) or restore it from a checkpoint")
    walked.add(file)


def _record(root: Path, spec: TableSpec) -> WrittenIds:
    """The written-id record of table `spec` at `root`, read-only; it must exist."""
    return WrittenIds(written_file(root, spec.name), spec.num_embeddings,
                      lambda: np.zeros(0, np.int64), read_only=True, must_exist=True)


class _RecordedIds:
    """A table's written-id record, checked id by id against a scan of its store of record.

    Counting the rows scanned would not do: a row the medium kept that no flush acknowledged
    (a writer killed between its rows and its record) would hide a lost one. The record is
    kept as compactly as it is read: a bounded table's bitmap (a bit an id), an unbounded
    one's sorted ids (8 bytes an id), not a hash index.
    """

    def __init__(self, record: WrittenIds, num_embeddings: int | None) -> None:
        self._expected = record.count()
        self._range = num_embeddings
        # a bounded table's record is its bitmap, asked as it is; an unbounded one's index
        # is traded for its sorted ids
        self._bitmap = record if num_embeddings is not None else None
        self._sorted = None if self._bitmap is not None else record.ids()
        self._held = 0

    def seen(self, ids: np.ndarray) -> None:
        """Count the scanned `ids` (distinct across calls) that the record holds."""
        ids = np.asarray(ids, dtype=np.int64)
        if self._bitmap is not None:
            assert self._range is not None
            # a damaged store of record may hold ids outside the table's range: not written
            held = self._bitmap.holds(ids[(ids >= 0) & (ids < self._range)])
        else:
            assert self._sorted is not None
            if not len(self._sorted):
                return
            at = np.minimum(np.searchsorted(self._sorted, ids), len(self._sorted) - 1)
            held = self._sorted[at] == ids
        self._held += int(np.count_nonzero(held))

    def missing(self) -> int:
        """Ids the record holds that the scan has not shown."""
        return self._expected - self._held


def _report_lost(root: Path, spec: TableSpec, missing: int, backend: Backend) -> None:
    """Raise for a scan of `backend` that read `missing` rows fewer than the record holds."""
    written = _record(root, spec).ids()
    lost = written[~backend.contains(np.ascontiguousarray(written))]
    example = f", e.g. id {int(lost[0])}" if len(lost) else ""
    raise CorruptStoreError(
        f"table {spec.name!r}: {missing} row(s) its written-id record holds are gone from its "
        f"store of record{example} (a lost file or lost rows); nothing was changed. Run "
        f"`embstore fsck {root}` to list them, then restore the table from a checkpoint or "
        "repair the store (`embstore fsck --repair`, which keeps a backup)")


class ClosablePages:
    """An iterator of pages with a `close` (a generator's, where it has one), then `then`.

    A scan's pages pass its backend's `close` as `then`: closing a generator that never
    started runs none of its body, so its ``with backend`` would leave the reader open, its
    directory open in this process with the scan's options (the next open of it with other
    options would be refused).
    """

    def __init__(self, pages: Iterator[tuple[np.ndarray, np.ndarray]],
                 then: Callable[[], None] | None = None) -> None:
        self.pages, self._then = pages, then

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        return next(self.pages)

    def close(self) -> None:
        """Stop the pages and close what they read."""
        close = getattr(self.pages, "close", None)
        if close is not None:
            close()
        if self._then is not None:
            self._then()


def write_store(dest: Path, default_tiers: Sequence[TierSpec], specs: Sequence[TableSpec],
                source: RowSource, *, extras: dict[str, Any] | None = None,
                history: dict[str, Any] | None = None,
                progress: Callable[[str, int], None] | None = None) -> dict[str, int]:
    """Fill the new store directory `dest` with every table's rows; returns rows per table.

    Args:
        dest: an empty directory.
        default_tiers: the new store's default chain.
        specs: its tables (each may carry its own chain).
        source: where each table's rows come from.
        extras: manifest fields to keep beside tables and tiers.
        history: counters to carry over (`_counters`).
        progress: called as progress(table, rows) after each page.
    """
    check_chains(specs, default_tiers)
    counts: dict[str, int] = {}
    for spec in specs:
        total, pages = source(spec)
        bottom = table_chain(spec, default_tiers)[-1]
        cap = bottom.capacity_rows(spec.storage_width * spec.storage_dtype.itemsize)
        if cap is not None and total > cap:
            ClosablePages(pages).close()
            # the bottom's eviction is feature expiry: the first write would drop the rest
            raise CapacityError(
                f"table {spec.name!r} has {total:,} rows but its store of record "
                f"({bottom.backend}) would hold at most {cap:,}; nothing was changed",
                hint="give the last tier no capacity, or one of at least the table's rows")
        n = 0
        written: list[np.ndarray] = []  # the ids of the table's written-id record
        # a failed copy closes the source's reader now: a handle left to the garbage
        # collector would keep its directory open with the reader's options in this process
        with contextlib.closing(ClosablePages(pages)), open_bottom(
                dest, spec, default_tiers, read_only=False, rows_hint=total) as target:
            for ids, rows in pages:
                if not len(ids):
                    continue
                rows = np.ascontiguousarray(rows, dtype=spec.storage_dtype)
                if isinstance(target, SupportsBulkLoad):
                    target.bulk_load(np.ascontiguousarray(ids), rows)
                else:
                    target.put(np.ascontiguousarray(ids), rows)
                written.append(np.array(ids, dtype=np.int64))
                n += len(ids)
                _crash.point("rebuild.page")
                if progress is not None:
                    progress(spec.name, len(ids))
            compact = getattr(target, "compact", None)
            if compact is not None:
                compact()
            target.flush()
            keeps_record = keeps_written_record(spec, default_tiers)
        counts[spec.name] = n
        if keeps_record:  # every row just written counts as written (embstore._written)
            file = written_file(dest, spec.name)
            file.parent.mkdir(mode=0o700, exist_ok=True)
            write_record(file, spec.num_embeddings,
                         np.concatenate(written) if written else np.zeros(0, np.int64))
    body = manifest_body(default_tiers, list(specs))
    # a full checkpoint rewritten (compact, migrate, import) stays one, with its step and
    # seal: the seal's digests are of ids and rows, whatever the layout, so incremental
    # checkpoints made from it still restore
    body.update({k: v for k, v in (extras or {}).items()
                 if k not in ("format", "version", "tiers", "tables")})
    write_manifest(dest, body)
    old = history or {}
    tables = {s.name: {"rows": counts[s.name], "updates_dropped": 0,
                       "tiers": [{"level": lv, "backend": t.backend} for lv, t in
                                 enumerate(table_chain(s, default_tiers))]} for s in specs}
    _counters.save(dest, specs, default_tiers, tables, old, old.get("last_flush"),
                   old.get("last_checkpoint"))
    fsync_tree(dest)  # the backends synced their own data; this is the rest
    return counts


def check_path(root: Path, specs: Sequence[TableSpec], default_tiers: Sequence[TierSpec]
               ) -> None:
    """Refuse to build a store at `root` whose path a backend of its chains cannot open.

    Raises:
        ConfigError: RocksDB and LMDB take their paths as UTF-8 text, and `root` is not.
    """
    needs = {ts.backend for spec in specs for ts in table_chain(spec, default_tiers)} \
        & {"rocksdb", "lmdb"}
    if not needs:
        return
    try:
        os.path.abspath(root).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{str(root)!r} is not a valid UTF-8 path, and "
                          f"{' and '.join(sorted(needs))} can open only such paths; rename the "
                          "directory (or the ones above it) to UTF-8 names") from None


def check_chains(specs: Sequence[TableSpec], default_tiers: Sequence[TierSpec]) -> None:
    """Raise what opening the new store would raise for its chains, before writing anything."""
    from ._build import make_policy
    from .policy import AdmissionPolicy, EvictionPolicy

    for spec in specs:
        for ts in table_chain(spec, default_tiers):
            registry.load_backend(ts.backend).check_options(ts.options)
            ts.capacity_rows(spec.storage_width * spec.storage_dtype.itemsize)
            make_policy(ts.eviction, ts.eviction_options, EvictionPolicy)
            if ts.admission not in (None, "always"):
                make_policy(ts.admission, ts.admission_options, AdmissionPolicy)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap directories `a` and `b` atomically; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def swap_in(root: Path, new: Path) -> Path:
    """Put the complete store `new` at `root`; returns where the old store now lies."""
    if _exchange(root, new):
        fsync_dir(root.parent)
        _crash.point("rebuild.after_swap")
        return new
    parked = parked_store(root)
    os.replace(root, parked)
    _crash.point("rebuild.swap_parked")
    os.replace(new, root)
    fsync_dir(root.parent)
    _crash.point("rebuild.after_swap")
    return parked


def replace_store(root: Path, *, default_tiers: Sequence[TierSpec] | None = None,
                  specs: Sequence[TableSpec] | None = None, source: RowSource | None = None,
                  keep_old: Path | None = None, lock_fd: int | None = None,
                  progress: Callable[[str, int], None] | None = None,
                  dropped: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """Rewrite the store at `root` (another chain, other rows) and swap it in atomically.

    Holds the store's lock throughout. Returns rows per table in the new store.

    Args:
        root: the store.
        default_tiers: the new default chain (default: the store's).
        specs: the new table specs (default: the store's).
        source: the rows (default: each table's store of record as it is).
        keep_old: move the old store there (a backup, beside `root`); by default it is
            deleted. A kill after the swap leaves it for the next rewrite, fsck or open to
            move there (`_kept.recover_kept`).
        lock_fd: the store's lock, already held exclusively by the caller.
        progress: called as progress(table, rows) after each page.
        dropped: with `keep_old`, what the rewrite drops (findings as dicts), recorded
            with the promise to keep the old store, for whoever finishes a killed rewrite.

    Raises:
        StoreNotFoundError, StoreLockedError, CorruptStoreError, ConfigError, OSError.
    """
    root = Path(root)
    recover_swap(root)
    require_directory(root, links=False)
    read_manifest(root)  # no store, no LOCK file left in someone else's directory
    fd = lock(root, read_only=False) if lock_fd is None else lock_fd
    try:
        doc, old_specs, old_tiers = read_store(root)
        check_path(root, specs or old_specs, default_tiers or old_tiers)
        foreign = foreign_entries(root)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more"
                                              if len(foreign) > 5 else "")
            raise ConfigError(
                f"{root} holds files that embstore did not make ({shown}); rewriting the "
                "store swaps in a new directory and would delete them: move them out of the "
                "store directory first")
        recover_kept(root, locked=True)  # before the `.rebuild-*` it may lie in go below
        for stale in root.parent.glob(f".{root.name}.rebuild-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root.parent / f".{root.name}.rebuild-{os.getpid()}-{int(time.time())}"
        tmp.mkdir(mode=0o700)
        try:
            counts = write_store(tmp, default_tiers or old_tiers, specs or old_specs,
                                 source or store_rows(root, old_tiers, old_specs), extras=doc,
                                 history=_counters.load(root), progress=progress)
            fsync_dir(root.parent)
            if keep_old is not None:
                # a kill from the swap on leaves the old store under a name the next rewrite
                # removes: the marker says to keep it instead (`_kept.recover_kept`)
                mark_keep(root, keep_old, dropped or [])
            _crash.point("rebuild.before_swap")
            old = swap_in(root, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if keep_old is not None:
                unmark_keep(root)
            raise
        if keep_old is not None:
            # under the lock: the next rewrite, once it holds it, removes `.rebuild-*`
            try:
                os.replace(old, keep_old)
            except FileNotFoundError:  # kept already by an open that took this repair for dead
                if not keep_old.is_dir():
                    raise
            fsync_dir(keep_old.parent)
            unmark_keep(root)
    finally:
        if lock_fd is None:
            release(fd)
    if keep_old is None:
        shutil.rmtree(old, ignore_errors=True)
    return counts
