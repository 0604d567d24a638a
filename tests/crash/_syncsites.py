"""Every sync of the code, by name, and how to remove one from a process (the traced child).

A site is one call that makes something durable (an fsync, fdatasync, msync, a RocksDB WAL sync,
an LMDB env sync, a synced write option, a libpmem persist), named by the function it is in and
its source text. `remove(name)` recompiles that function with the call replaced (so a native
sync, e.g. RocksDB's, goes as surely as a Python one); what replaces it is `instead`.

`point` says which traced workload, backend and acknowledged point the test runs to show that
the check fails without the site, and `expect` what it then reports (the label `setup` is the
opening of the store, where the publishing rule can fail before any point). Sites with no
point say in `why` why no test can fail without them; a redundant one names in `clean` a
workload that exercises it and stays clean without it. The table in the docstring of
tests/crash/test_sync_coverage.py is this one, for people.
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Site:
    """One sync call, and the test that shows it is needed (or why none can)."""

    name: str
    module: str
    function: str
    call: str
    instead: str = "None"
    point: tuple[str, str, str] | None = None
    """(workload, backend, label of the acknowledged point) that fails without the site."""
    expect: str = ""
    """A substring of the problem the check reports at that point without the site."""
    why: str = ""
    """Where there is no point: why removing the site cannot be caught here."""
    clean: tuple[str, str] | None = None
    """A redundant site: the (workload, backend) that exercises it and stays clean without it."""
    needs_libpmem: bool = False


_B, _R, _E, _S = "embstore.backends.", "embstore._rebuild", "embstore._export", "embstore._written"
_A = "embstore._access_log"
_UNSYNCED, _DIRTY = "written but not synced when it returned", "dirty in the page cache"
_NAMES, _PUBLISHED = "created but its directory was not synced", "before its data was synced"
_DAX = ("persistent memory (a DAX file system) only: no test machine has it, and on a page-cache "
        "mapping a cache-line flush makes nothing durable, so no check can run there")

SITES: tuple[Site, ...] = (
    # --- backends ---------------------------------------------------------------------------
    Site("rocksdb.flush_wal", _B + "rocksdb", "RocksDBBackend._flush",
         "self._db.flush_wal(True)", point=("flush", "rocksdb", "flush"),
         expect=_UNSYNCED),
    Site("rocksdb.table_meta_put", _B + "rocksdb", "RocksDBBackend._open_table",
         "sync.sync = True", "sync.sync = False", point=("bulk", "rocksdb", "bulk-load"),
         expect=_UNSYNCED),
    Site("rocksdb.table_metas_put", _B + "rocksdb", "_write_metas",
         "sync.sync = True", "sync.sync = False",
         point=("bulk", "rocksdb", "bulk-load-new-tables"), expect=_UNSYNCED),
    Site("rocksdb.bulk_sst_fsync", _B + "rocksdb", "RocksDBBackend.bulk_load", "os.fsync(fd)",
         why="redundant: RocksDB's SstFileWriter::Finish syncs the file, and ingestion with "
             "move_files syncs the file it links in and the database directory (removing "
             "it leaves the bulk-load point of the rocksdb bulk workload clean)",
         clean=("bulk", "rocksdb")),
    Site("lmdb.env_sync", _B + "lmdb", "LMDBBackend._flush", "self._env.sync(True)",
         point=("flush", "lmdb", "flush"), expect=_UNSYNCED),
    Site("lmdb.commit_sync", _B + "lmdb", "_open_env", 'sync=s["sync_commits"]',
         'sync=False', point=("flush", "lmdb", "flush"),
         expect="LMDB meta page written before the data pages"),
    Site("lmdb.new_file_dir_sync", _B + "lmdb", "_open_env",
         "fsync_dir(directory)", point=("flush", "lmdb", "flush"), expect=_NAMES),
    Site("pmem.create_fsync", _B + "pmem", "PmemBackend._create", "os.fsync(fd)",
         point=("flush", "pmem", "setup"), expect=_PUBLISHED),
    Site("pmem.create_dir_fsync", _B + "pmem", "PmemBackend._create", "os.fsync(dir_fd)",
         point=("flush", "pmem", "flush"), expect=_NAMES),
    Site("pmem.growth_fsync", _B + "pmem", "PmemBackend._ensure_free", "os.fsync(self._fd)",
         why="redundant off persistent memory: the file grows only inside a write, and the "
             "flush that makes rows in the new space durable ends with an fdatasync, which "
             "commits the new size and extents (the flush-new-rows point of the pmem flush "
             "workload grows the file and stays clean without it); on persistent memory, "
             "where a flush is cache-line writes with no system call, it is the only sync "
             "of the metadata (" + _DAX + ")", clean=("flush", "pmem")),
    Site("pmem.state_persist", _B + "pmem", "PmemBackend._write_state",
         "self._map.persist(STATE_OFFSETS[self._gen % 2], STATE.size)",
         point=("flush", "pmem", "flush"), expect=_DIRTY),
    Site("pmem.new_records_persist", _B + "pmem", "PmemBackend._flush",
         "self._persist_slots(touched, 0, self._rec)",
         point=("flush", "pmem", "flush-new-rows"), expect=_DIRTY),
    Site("pmem.retire_persist", _B + "pmem", "PmemBackend._flush",
         "self._persist_slots(retire, REC_SEQ, 8)",
         point=("flush", "pmem", "flush-deletes"), expect=_DIRTY),
    Site("pmem.open_retire_persist", _B + "pmem", "PmemBackend._scan",
         "self._persist_slots(dead, REC_SEQ, 8)",
         why="ordering, not durability at a point: it runs only when an open finds superseded "
             "or torn records (after a crash) and makes their retirement durable before a put "
             "reuses their slots, so that a power cut in the middle of that put cannot leave "
             "a half-new record under the old, valid-looking seq. The next flush's fdatasync "
             "writes the same pages before it returns, so no acknowledged point sees it; "
             "stores into a mapping are invisible to strace, so the order cannot be checked"),
    Site("pmem.sync_file_range", _B + "pmem", "PmemBackend._persist_slots",
         "err = lib.rec_sync_ranges(", "err = 0 and lib.rec_sync_ranges(",
         why="redundant for durability: the fdatasync after it writes every dirty page of the "
             "file anyway; it only starts the write-back of the dirty ranges early (the pmem "
             "flush workload stays clean without it)", clean=("flush", "pmem")),
    Site("pmem.fdatasync", _B + "pmem", "PmemBackend._persist_slots",
         "os.fdatasync(self._fd)", point=("flush", "pmem", "flush"), expect=_UNSYNCED),
    Site("pmem.dax_flush", _B + "pmem", "PmemBackend._persist_slots",
         "self._map.flush(a, min(b, self._map.length) - a)", why=_DAX),
    Site("pmem.dax_drain", _B + "pmem", "PmemBackend._persist_slots", "self._map.drain()",
         why=_DAX),
    Site("libpmem.persist", "embstore._libpmem", "PmemMapping.persist",
         "self._lib.pmem_persist(ptr, length)", why=_DAX),
    Site("libpmem.msync", "embstore._libpmem", "PmemMapping.persist",
         "elif self._lib.pmem_msync(ptr, length) != 0:", "elif 0:",
         point=("flush", "pmem", "flush"), expect=_DIRTY, needs_libpmem=True),
    Site("libpmem.flush", "embstore._libpmem", "PmemMapping.flush",
         "self._lib.pmem_flush(ptr, length)", why=_DAX),
    Site("libpmem.flush_msync", "embstore._libpmem", "PmemMapping.flush",
         "elif self._lib.pmem_msync(ptr, length) != 0:", "elif 0:",
         why="unreachable: the pmem backend calls flush() only on persistent memory "
             "(PmemBackend._persist_slots), where this branch is not taken"),
    Site("libpmem.drain", "embstore._libpmem", "PmemMapping.drain", "self._lib.pmem_drain()",
         why=_DAX),
    Site("mmap.msync", "embstore._libpmem", "MmapMapping.persist",
         "self._mm.flush(start, min(offset + length, self.length) - start)",
         point=("flush", "pmem-mmap", "flush"), expect=_DIRTY),
    Site("dram.snapshot_fsync", _B + "dram", "DRAMBackend._write_snapshot",
         "os.fsync(fh.fileno())", point=("flush", "dram", "flush"), expect=_PUBLISHED),
    Site("dram.snapshot_dir_fsync", _B + "dram", "DRAMBackend._write_snapshot",
         "os.fsync(dir_fd)", point=("flush", "dram", "flush"), expect=_NAMES),
    # --- the engine -------------------------------------------------------------------------
    Site("manifest.fsync_dir", "embstore.manifest", "fsync_dir", "os.fsync(fd)",
         point=("flush", "lmdb", "flush"), expect=_NAMES),
    Site("manifest.write_atomic_fsync", "embstore.manifest", "_write_synced", "os.fsync(fd)",
         point=("flush", "lmdb", "flush"), expect=_PUBLISHED),
    Site("manifest.write_atomic_dir_sync", "embstore.manifest", "write_atomic_many",
         "fsync_dir(directory)", point=("flush", "lmdb", "flush"), expect=_NAMES),
    Site("manifest.make_dirs", "embstore.manifest", "make_dirs", "fsync_dir(d.parent)",
         point=("flush", "lmdb", "flush"), expect=_NAMES),
    Site("manifest.fsync_tree_files", "embstore.manifest", "fsync_tree", "os.fsync(fd)",
         point=("checkpoint", "rocksdb", "restore"), expect=_PUBLISHED),
    Site("manifest.fsync_tree_dirs", "embstore.manifest", "fsync_tree",
         "fsync_dir(Path(dirpath))", point=("checkpoint", "rocksdb", "restore"),
         expect="before its directory entry was synced"),
    Site("written.journal_fsync", _S, "WrittenIds._append_journal", "os.fsync(fd)",
         point=("flush", "lmdb", "flush-deletes"), expect="before the delete journal was synced"),
    Site("written.journal_dir_sync", _S, "WrittenIds._append_journal",
         "fsync_dir(self.journal.parent)", point=("flush", "lmdb", "flush-deletes"),
         expect="before the delete journal's directory entry was synced"),
    Site("written.journal_mkdir_sync", _S, "WrittenIds._append_journal",
         "fsync_dir(self.file.parent.parent)", point=("flush", "lmdb", "journal-new-dir"),
         expect="before the delete journal's directory entry was synced"),
    Site("written.journal_truncate_fsync", _S, "WrittenIds._empty_journal", "os.fsync(fd)",
         point=("flush", "lmdb", "flush-deletes"), expect=_UNSYNCED),
    Site("written.record_mkdir_sync", _S, "_record_bytes", "fsync_dir(file.parent.parent)",
         point=("flush", "lmdb", "flush-reopened"), expect=_NAMES),
    Site("private_dir.publish_dir_sync", "embstore._private_dir", "publish",
         "fsync_dir(dest.parent)", point=("checkpoint", "rocksdb", "checkpoint"),
         expect=_NAMES),
    Site("checkpoint.restore_tree_sync", "embstore.checkpoint", "restore", "fsync_tree(tmp)",
         point=("checkpoint", "rocksdb", "restore"), expect=_PUBLISHED),
    Site("rebuild.recover_swap_dir_sync", "embstore._kept", "recover_swap",
         "fsync_dir(root.parent)",
         why="redundant: recover_swap runs first in replace_store, which syncs the same "
             "directory again before it swaps (the compact point of the rebuild-renames "
             "workload, which recovers a parked store, stays clean without it)",
         clean=("rebuild-renames", "lmdb")),
    Site("rebuild.recover_kept_dir_sync", "embstore._kept", "recover_kept",
         "fsync_dir(keep.parent)",
         why="only after a repair killed after its swap, which no traced workload does: it "
             "makes the old store's backup name durable before the marker leading to it goes "
             "(tests/test_fsck.py kills a repair there and checks the backup is kept)"),
    Site("rebuild.recover_kept_marker_sync", "embstore._kept", "recover_kept",
         "fsync_dir(root.parent)",
         why="a marker whose removal is lost comes back and finds the old store at its "
             "backup name already, which it leaves there: no state it leads to loses data"),
    Site("rebuild.unmark_keep_sync", "embstore._kept", "unmark_keep",
         "fsync_dir(root.parent)",
         why="a marker whose removal is lost comes back and finds the old store at its "
             "backup name already, or the store at its path unswapped, and only removes "
             "itself: no state it leads to loses data"),
    Site("rebuild.clear_killed_repairs_sync", "embstore._kept", "clear_killed_repairs",
         "fsync_dir(root.parent)",
         why="a note whose removal is lost comes back, and the next fsck reports the killed "
             "repairs it lists once more: no state it leads to loses data"),
    Site("rebuild.new_dir_sync", _R, "replace_store", "fsync_dir(root.parent)",
         why="redundant: the sync after the swap covers the new directory's entry too, and a "
             "swap that survives a power cut implies the entry it swaps in survived (the "
             "compact point stays clean without it)", clean=("rebuild", "lmdb")),
    Site("rebuild.write_store_tree_sync", _R, "write_store", "fsync_tree(dest)",
         why="redundant: every file of a rewritten or imported store is synced by what wrote "
             "it (the backends' flush and close, write_atomic) and every directory by what "
             "made an entry in it (the backends, write_atomic, make_dirs); compact, migrate, "
             "fsck --repair and import stay clean without it",
         clean=("rebuild", "rocksdb")),
    Site("rebuild.exchange_dir_sync", _R, "swap_in",
         'fsync_dir(root.parent)\n        _crash.point("rebuild.after_swap")\n        return new',
         'None\n        _crash.point("rebuild.after_swap")\n        return new',
         point=("rebuild", "lmdb", "compact"), expect=_NAMES),
    Site("rebuild.renames_dir_sync", _R, "swap_in",
         'fsync_dir(root.parent)\n    _crash.point("rebuild.after_swap")\n    return parked',
         'None\n    _crash.point("rebuild.after_swap")\n    return parked',
         point=("rebuild-renames", "lmdb", "compact"),
         expect=_NAMES),
    Site("rebuild.keep_old_dir_sync", _R, "replace_store", "fsync_dir(keep_old.parent)",
         why="ordering, not durability at a point: unmark_keep syncs the same directory right "
             "after it, so at the repair's acknowledged point the backup's name is durable "
             "without it; it makes the rename durable before the marker's removal, which only "
             "a power cut between the two would show, and no traced point lies there"),
    Site("access_log.flush_ids_fsync", _A, "AccessRecorder.flush", "os.fsync(log.ids_fd)",
         point=("access", "rocksdb", "access-flush"), expect=_UNSYNCED),
    Site("access_log.flush_offsets_fsync", _A, "AccessRecorder.flush", "os.fsync(log.off_fd)",
         point=("access", "rocksdb", "access-flush"), expect=_UNSYNCED),
    Site("access_log.close_ids_fsync", _A, "AccessRecorder.close", "os.fsync(log.ids_fd)",
         point=("access", "rocksdb", "access-close"), expect=_UNSYNCED),
    Site("access_log.close_offsets_fsync", _A, "AccessRecorder.close", "os.fsync(log.off_fd)",
         point=("access", "rocksdb", "access-close"), expect=_UNSYNCED),
    Site("access_log.new_ids_fsync", _A, "AccessRecorder._open", "os.fsync(log.ids_fd)",
         why="redundant at every acknowledged point: the flush or close after it syncs the "
             "same files; it orders a new table's (empty) files before the header that lists "
             "them", clean=("access", "rocksdb")),
    Site("access_log.new_offsets_fsync", _A, "AccessRecorder._open", "os.fsync(log.off_fd)",
         why="redundant at every acknowledged point, as the ids file's",
         clean=("access", "rocksdb")),
    Site("export.data_fsync", _E, "_export_table", "os.fsync(fh.fileno())",
         point=("export", "lmdb", "export"), expect=_PUBLISHED),
    # --- the command line ---------------------------------------------------------------------
    Site("demo.dense_fsync", "embstore.tools.demo", "_save_dense", "os.fsync(f.fileno())",
         point=("demo", "dram", "demo-save"), expect=_PUBLISHED),
    Site("demo.dense_dir_fsync", "embstore.tools.demo", "_save_dense", "os.fsync(fd)",
         point=("demo", "dram", "demo-save"), expect=_NAMES),
)
BY_NAME = {s.name: s for s in SITES}

NOT_SITES: tuple[tuple[str, str, str], ...] = (
    ("backends/rocksdb.py", "self._write_opt.sync = bool(sync_writes)",
     "an option (off by default) that syncs every write batch; no acknowledged point needs it"),
    ("tools/_bench_backends.py", "", "the raw-library baselines of `embstore bench backends`"),
    ("tools/_bench_hierarchy.py", "os.sync()", "a benchmark settling the disk before timing"),
    ("embstore/hierarchy.py", "self.sync()", "a table chain's flush calling each tier's flush"),
    ("embstore/store.py", "chain.sync()", "a store flush calling each table chain's sync"),
)
"""Calls the inventory scan finds that are not syncs of stored data: (file, text, why)."""


def remove(name: str) -> None:
    """Remove the sync site `name` from this process (recompiles its function without it)."""
    site = BY_NAME[name]
    owner: object = importlib.import_module(site.module)
    module_globals = vars(owner)
    for part in site.function.split("."):
        owner = getattr(owner, part)
    func = owner
    source = textwrap.dedent(inspect.getsource(func))  # type: ignore[arg-type]
    if source.count(site.call) != 1:
        raise AssertionError(f"{name}: {site.call!r} occurs {source.count(site.call)} times in "
                             f"{site.module}.{site.function}; the inventory is out of date")
    namespace: dict[str, object] = {}
    exec(compile(source.replace(site.call, site.instead), f"<{name} removed>", "exec"),  # noqa: S102
         module_globals, namespace)
    new = namespace[func.__name__]  # type: ignore[attr-defined]
    new = getattr(new, "__func__", new)  # a staticmethod's function
    func.__code__ = new.__code__  # type: ignore[attr-defined]  (every reference sees it)
