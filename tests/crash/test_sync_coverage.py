"""Power loss, simulated by reading the system calls: every acknowledged write is durable.

A SIGKILL keeps the page cache, so crash tests cannot see a missing sync. These tests run a
workload in a child under `strace -f -y` (tests/crash/_syncchild.py) and check its system calls
(tests/crash/_synccheck.py): at each acknowledged point (flush, bulk_load, checkpoint, restore,
compact, migrate, fsck --repair, export, import returning) every file written is synced, no
mapped page is dirty in the page cache, every new name's directory is synced; a rename or link
publishes only synced files; the delete journal is synced before the medium is written; LMDB
writes a meta page only after the pages it commits are synced. Then each sync of the code is
removed alone (`DROP_SYNC`, by recompiling its function without it) to show the check fails.

Inventory: every sync call of the code, what it makes durable, and the test that fails without
it (`test_the_check_fails_when_one_sync_is_removed[<site>]`, slow; the workload, backend and
point in brackets), or why none can; a redundant one is removed in a workload that exercises it
by `test_the_check_stays_clean_without_a_redundant_sync[<site>]` (slow). tests/crash/_syncsites.py
holds the same table as data and `test_every_sync_call_is_in_the_inventory` keeps it complete.

rocksdb.flush_wal  backends/rocksdb.py RocksDBBackend._flush: flush_wal(True). The write-ahead
    log at every flush [flush/rocksdb/flush: the .log written, not synced].
rocksdb.table_meta_put  RocksDBBackend._open_table: the synced put of a new table's spec. The
    first write to a new table's log [bulk/rocksdb/bulk-load: bulk_load ingests SSTs and syncs
    no log, so without it the spec's log record is unsynced when bulk_load returns].
rocksdb.table_metas_put  _write_metas: the same for the tables a tier opens together (one
    synced batch of their specs) [bulk/rocksdb/bulk-load-new-tables].
rocksdb.bulk_sst_fsync  RocksDBBackend.bulk_load: os.fsync of the SST before ingestion.
    Redundant: SstFileWriter::Finish fdatasyncs it, and ingestion (move_files) fdatasyncs the
    file it links in and syncs the directory (stays clean without it: bulk/rocksdb).
lmdb.env_sync  backends/lmdb.py LMDBBackend._flush: env.sync(True). The meta pages LMDB writes
    unsynced (MDB_NOMETASYNC) [flush/lmdb/flush: data.mdb written, not synced].
lmdb.commit_sync  _open_env: lmdb.open(sync=sync_commits). Each commit's data pages
    before its meta page [flush/lmdb/flush: meta page written before its pages were synced].
lmdb.new_file_dir_sync  _open_env: fsync_dir of a new environment. data.mdb's name
    [flush/lmdb/flush: data.mdb created, directory not synced].
pmem.create_fsync  backends/pmem.py PmemBackend._create: fsync of the new file before it is
    linked into place [flush/pmem/setup: published before its data was synced].
pmem.create_dir_fsync  PmemBackend._create: fsync of the directory after the link. The table
    file's name [flush/pmem/flush].
pmem.growth_fsync  PmemBackend._ensure_free: fsync after fallocate. Redundant off persistent
    memory: the flush that promises rows in the new space ends with an fdatasync, which commits
    size and extents (stays clean without it: flush/pmem, whose flush-new-rows point grows the
    file); on persistent memory (DAX) it is the only metadata sync, not testable here.
pmem.state_persist  PmemBackend._write_state: persist of the header's state block (watermark,
    seq reserve) [flush/pmem/flush: one page dirty when flush returns].
pmem.new_records_persist  PmemBackend._flush: persist of the new records
    [flush/pmem/flush-new-rows: the records' pages dirty].
pmem.retire_persist  PmemBackend._flush: persist of the retired records' zeroed seqs
    [flush/pmem/flush-deletes: their pages dirty].
pmem.open_retire_persist  PmemBackend._scan: persist of the records an open retires (after a
    crash). Not caught: ordering, not durability at a point. It makes the retirement durable
    before a put reuses the slot, so a power cut mid-put cannot leave a half-new record under
    an old valid-looking seq; the next flush's fdatasync writes the same pages before it
    returns, and stores into a mapping are invisible to strace, so the order is not checkable.
pmem.sync_file_range  PmemBackend._persist_slots: sync_file_range of the dirty ranges.
    Redundant: the fdatasync after it writes every dirty page of the file; it only starts the
    write-back early (stays clean without it: flush/pmem).
pmem.fdatasync  PmemBackend._persist_slots: fdatasync. Device cache and extents after the
    write-back [flush/pmem/flush: written (sync_file_range) but not synced].
pmem.dax_flush, pmem.dax_drain  PmemBackend._persist_slots: map.flush/drain (pmem_flush and
    pmem_drain), libpmem.persist, libpmem.flush, libpmem.drain  embstore/_libpmem.py
    PmemMapping: pmem_persist, pmem_flush, pmem_drain. Persistent memory (DAX) only: no test
    machine has it, and on a page-cache mapping a cache-line flush makes nothing durable.
libpmem.msync  PmemMapping.persist: pmem_msync (libpmem off persistent memory)
    [flush/pmem/flush: the header page dirty; skipped where libpmem is hidden or forced off].
libpmem.flush_msync  PmemMapping.flush: pmem_msync. Unreachable: the backend calls flush()
    only on persistent memory.
mmap.msync  MmapMapping.persist: mmap.flush (msync, the fallback without libpmem)
    [flush/pmem-mmap/flush: the header page dirty].
dram.snapshot_fsync  backends/dram.py DRAMBackend._write_snapshot: fsync of the snapshot
    before its rename [flush/dram/flush: published before its data was synced].
dram.snapshot_dir_fsync  DRAMBackend._write_snapshot: fsync of the directory after the rename
    [flush/dram/flush: t.dram's name not synced].
manifest.fsync_dir  embstore/manifest.py fsync_dir: the fsync every directory sync below goes
    through [flush/lmdb/flush: the new store's directory not synced].
manifest.write_atomic_fsync  _write_synced (write_atomic, write_atomic_many): fsync of the
    temporary file (the manifest, the
    written-id record, tombstones, STATS.json, export headers, sharded.json)
    [flush/lmdb/flush: written/t.ids published before its data was synced].
manifest.write_atomic_dir_sync  write_atomic_many: fsync_dir after the renames, once per directory
    [flush/lmdb/flush: MANIFEST.json's name not synced].
manifest.make_dirs  make_dirs: fsync_dir of each new directory's parent (open, checkpoint,
    restore, export, import, sharded stores) [flush/lmdb/flush: `stores` not synced].
manifest.fsync_tree_files, manifest.fsync_tree_dirs  fsync_tree: every file, every directory
    (restore's copy, rewrites and imports) [checkpoint/rocksdb/restore: published before the
    copied files' data, or their names, were synced].
written.journal_fsync  embstore/_written.py WrittenIds._append_journal: fsync of the delete
    journal before the medium deletes [flush/lmdb/flush-deletes: the store wrote before it].
written.journal_dir_sync  _append_journal: fsync_dir of a new journal's directory
    [flush/lmdb/flush-deletes: the journal's name unsynced when the store wrote].
written.journal_mkdir_sync  _append_journal: fsync_dir after making the record's directory
    [flush/lmdb/journal-new-dir: `written` unsynced when the store wrote].
written.journal_truncate_fsync  WrittenIds._empty_journal: fsync after emptying the journal
    [flush/lmdb/flush-deletes: t.del truncated, not synced].
written.record_mkdir_sync  _record_bytes: fsync_dir after making the record's directory
    [flush/lmdb/flush-reopened: a store from before written-id records, whose open makes them].
private_dir.publish_dir_sync  embstore/_private_dir.py publish: fsync_dir after the rename
    that publishes a checkpoint, a restore, an export or an import
    [checkpoint/rocksdb/checkpoint: the checkpoint's name not synced].
checkpoint.restore_tree_sync  embstore/checkpoint.py restore: fsync_tree before the rename;
    new, it was missing: the copied base checkpoint was published unsynced
    [checkpoint/rocksdb/restore].
rebuild.recover_swap_dir_sync  embstore/_kept.py recover_swap: fsync_dir after putting a
    parked store back. Redundant: replace_store, its only caller, syncs the same directory
    again before its swap (stays clean without it: rebuild-renames/lmdb).
rebuild.recover_kept_dir_sync  embstore/_kept.py recover_kept: fsync_dir after keeping the
    old store of a repair killed after its swap under its backup name, before its marker goes.
    Not traced: no workload kills a repair there (tests/test_fsck.py does, without power loss).
rebuild.recover_kept_marker_sync  recover_kept: fsync_dir after the marker's removal. A lost
    removal brings the marker back, which finds the backup in place and only removes itself.
rebuild.unmark_keep_sync  unmark_keep: fsync_dir after the marker's removal, as above.
rebuild.clear_killed_repairs_sync  embstore/_kept.py clear_killed_repairs: fsync_dir after
    fsck --repair removes the note of repairs killed after their swaps, having reported them.
    A lost removal brings the note back: the next fsck reports those repairs once more.
rebuild.new_dir_sync  replace_store: fsync_dir after the rewrite. Redundant: the sync after the
    swap covers the new directory's name, and a swap that survives a power cut implies the
    name it swaps in survived (stays clean without it: rebuild/lmdb).
rebuild.write_store_tree_sync  write_store: fsync_tree of the new store. Redundant: each file
    is synced by what wrote it (the backends' flush and close, write_atomic) and each directory
    by what made an entry in it (stays clean without it: rebuild/rocksdb; export/* too).
rebuild.exchange_dir_sync  swap_in: fsync_dir after renameat2(RENAME_EXCHANGE)
    [rebuild/lmdb/compact: the store's name not synced].
rebuild.renames_dir_sync  swap_in: fsync_dir after the two renames (no RENAME_EXCHANGE)
    [rebuild-renames/lmdb/compact].
rebuild.keep_old_dir_sync  replace_store: fsync_dir after moving the old store to keep_old.
    Ordering, not durability at a point: unmark_keep syncs the same directory right after, so
    the backup's name is durable at the repair's point without it; it keeps the rename ahead
    of the marker's removal, which only a power cut between the two would show.
export.data_fsync  embstore/_export.py _export_table: fsync of the ids and rows files
    [export/lmdb/export: published before their data was synced].
demo.dense_fsync, demo.dense_dir_fsync  tools/demo.py _save_dense: fsync of the dense model's
    file before its rename, and of its directory after [demo/dram/demo-save].
access_log.flush_ids_fsync, access_log.flush_offsets_fsync  embstore/_access_log.py
    AccessRecorder.flush: fsync of a table's ids and offsets files at the store's flush
    [access/rocksdb/access-flush].
access_log.close_ids_fsync, access_log.close_offsets_fsync  AccessRecorder.close: the same at
    the store's close [access/rocksdb/access-close].
access_log.new_ids_fsync, access_log.new_offsets_fsync  AccessRecorder._open: fsync of a new
    table's empty files before the header lists them. Redundant at every acknowledged point:
    the flush or close after it syncs the same files (stays clean without it: access/rocksdb).

Not syncs of stored data (the scan knows them): RocksDB's sync_writes option (off by default:
every batch synced; no point needs it), the raw-library baselines of `embstore bench
backends`, and the os.sync that settles the disk in `embstore bench hierarchy`.

Gaps the check found, fixed with it: restore published its copy of the base checkpoint without
syncing it; checkpoint, restore, export and import made missing parent directories without
syncing their names (now manifest.make_dirs; sharded stores and their checkpoints too, found
by reading, not traced here).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _synccheck  # noqa: E402  (beside this file; tests/ is not a package)
import _syncsites  # noqa: E402

from embstore import _libpmem  # noqa: E402

pytestmark = [pytest.mark.crash,
              pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")]

CHILD = Path(__file__).parent / "_syncchild.py"
REPO = Path(__file__).parents[2]
POINTS = {"flush": ["flush", "flush-deletes", "flush-new-rows", "journal-new-dir",
                    "flush-reopened"],
          "bulk": ["bulk-load", "bulk-load-new-tables"],
          "checkpoint": ["checkpoint", "checkpoint-incr", "restore", "restore-incr"],
          "rebuild": ["compact", "migrate"], "rebuild-renames": ["compact", "migrate"],
          "export": ["export", "import"], "demo": ["demo-save"],
          "access": ["access-flush", "access-close"]}


def _trace(tmp_path: Path, workload: str, backend: str, **env: str) -> _synccheck.Report:
    if workload == "demo":
        pytest.importorskip("torch")
    root, log, report = tmp_path / "root", tmp_path / "strace.log", tmp_path / "dirty.json"
    root.mkdir()
    proc = subprocess.run(
        ["strace", "-f", "-y", "-qq", "-s", "64", "-e", f"trace={_synccheck.TRACED}", "-o",
         str(log), sys.executable, str(CHILD), workload, backend, str(root), str(report)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _synccheck.check(log.read_text(), str(root), json.loads(report.read_text()))
    expected = POINTS[workload] + (["fsck-repair"] if workload.startswith("rebuild")
                                   and backend.startswith("pmem") else [])
    assert result.points == expected
    return result


PLAIN = [("flush", "rocksdb"), ("flush", "lmdb"), ("flush", "pmem"), ("flush", "pmem-mmap"),
         ("flush", "dram"), ("bulk", "rocksdb"), ("checkpoint", "rocksdb"),
         ("checkpoint", "lmdb"), ("checkpoint", "pmem"), ("rebuild", "lmdb"),
         ("rebuild", "pmem"), ("rebuild-renames", "lmdb"), ("export", "lmdb"),
         ("access", "rocksdb")]
MORE = [(w, b) for w in ("bulk", "checkpoint", "rebuild", "rebuild-renames", "export")
        for b in ("rocksdb", "lmdb", "pmem", "pmem-mmap", "dram") if (w, b) not in PLAIN]
MORE.append(("demo", "dram"))


@pytest.mark.parametrize("workload,backend", PLAIN, ids=[f"{w}-{b}" for w, b in PLAIN])
def test_everything_acknowledged_is_durable(tmp_path, workload, backend):
    report = _trace(tmp_path, workload, backend)
    assert report.problems == []
    # the check saw the stored data synced, not just nothing at all
    data = {"rocksdb": ".log", "lmdb": "data.mdb", "pmem": ".pmem", "pmem-mmap": ".pmem",
            "dram": ".dram"}[backend]
    if workload in ("flush", "checkpoint"):
        assert any(p.endswith(data) for p in report.synced_files), report.synced_files


@pytest.mark.slow
@pytest.mark.parametrize("workload,backend", MORE, ids=[f"{w}-{b}" for w, b in MORE])
def test_everything_acknowledged_is_durable_in_every_workload(tmp_path, workload, backend):
    assert _trace(tmp_path, workload, backend).problems == []


def _libpmem_in_use() -> bool:
    return not _libpmem.force_mmap() and _libpmem.load() is not None


def _check_fails_without(tmp_path: Path, name: str) -> None:
    site = _syncsites.BY_NAME[name]
    assert site.point is not None
    if site.needs_libpmem and not _libpmem_in_use():
        pytest.skip("libpmem is hidden, missing or forced off")
    workload, backend, label = site.point
    report = _trace(tmp_path, workload, backend, DROP_SYNC=name)
    assert any(p.startswith(f"[{label}]") and site.expect in p for p in report.problems), \
        report.problems


FAILING = [s.name for s in _syncsites.SITES if s.point is not None]
REDUNDANT = [s.name for s in _syncsites.SITES if s.clean is not None]
QUICK = ["rocksdb.flush_wal", "pmem.state_persist", "rebuild.exchange_dir_sync",
         "checkpoint.restore_tree_sync", "written.journal_fsync", "lmdb.commit_sync"]


@pytest.mark.parametrize("name", QUICK)
def test_the_check_fails_without_a_sync_of_each_kind(tmp_path, name):
    # one site per rule of the check (1 to 6), in the default suite; all: the slow test
    _check_fails_without(tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAILING)
def test_the_check_fails_when_one_sync_is_removed(tmp_path, name):
    _check_fails_without(tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", REDUNDANT)
def test_the_check_stays_clean_without_a_redundant_sync(tmp_path, name):
    site = _syncsites.BY_NAME[name]
    assert site.clean is not None
    workload, backend = site.clean
    assert _trace(tmp_path, workload, backend, DROP_SYNC=name).problems == []


# --- the inventory ----------------------------------------------------------------------------

_SYNC_CALLS = {"fsync", "fdatasync", "fsync_dir", "fsync_tree", "flush_wal", "sync",
               "pmem_persist", "pmem_msync", "pmem_flush", "pmem_drain", "_persist_slots",
               "rec_sync_ranges"}
_MAPPING_CALLS = {"persist", "flush", "drain"}  # on a mapping (`self._map`, `self._mm`)


def _sync_calls(file: Path) -> list[tuple[str, int, str]]:
    """(enclosing function's qualname, line, line text) of every sync-like call in `file`."""
    lines = file.read_text().splitlines()
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = f"{scope}.{child.name}" if scope else child.name
            at = []
            if isinstance(child, ast.Call):
                f = child.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if called in _SYNC_CALLS or (
                        called in _MAPPING_CALLS and isinstance(f, ast.Attribute)
                        and isinstance(f.value, ast.Attribute)
                        and f.value.attr in ("_map", "_mm")):
                    at.append(child.lineno)
                at += [k.lineno for k in child.keywords if k.arg == "sync"]
            elif isinstance(child, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "sync" for t in child.targets):
                at.append(child.lineno)
            found.extend((scope, line, lines[line - 1].strip()) for line in at)
            visit(child, inner)

    visit(ast.parse("\n".join(lines)), "")
    return found


def _file_of(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).resolve().relative_to(REPO))


def test_every_sync_call_is_in_the_inventory():
    sites = {(_file_of(s.module), s.function, s.call.splitlines()[0]): s.name
             for s in _syncsites.SITES}
    missing, seen = [], set()
    for top in ("embstore", "backends", "tools"):
        for file in sorted((REPO / top).rglob("*.py")):
            rel = str(file.relative_to(REPO))
            for scope, line, text in _sync_calls(file):
                hits = [name for (f, fn, call), name in sites.items()
                        if rel == f and scope == fn and call in text]
                seen.update(hits)
                if not hits and not any(rel == f and t in text
                                        for f, t, _ in _syncsites.NOT_SITES):
                    missing.append(f"{rel}:{line} ({scope}): {text}")
    assert missing == [], "sync calls missing from tests/crash/_syncsites.py"
    assert seen == set(sites.values())  # and the scan finds every site it lists


@pytest.mark.parametrize("name", [s.name for s in _syncsites.SITES])
def test_each_site_is_one_call_of_its_function_and_in_this_docstring(name):
    site = _syncsites.BY_NAME[name]
    owner: object = importlib.import_module(site.module)
    for part in site.function.split("."):
        owner = getattr(owner, part)
    assert textwrap.dedent(inspect.getsource(owner)).count(site.call) == 1  # type: ignore[arg-type]
    assert name in (__doc__ or "")
    assert (site.point is None) != (site.why == ""), "a site has a failing test or a reason"


def test_a_store_opens_with_rocksdicts_settings_file_torn(tmp_path):
    # why the check exempts rocksdict-config.json, which rocksdict writes without a sync
    import numpy as np

    import embstore

    spec = embstore.TableSpec("t", dim=4)
    with embstore.open(tmp_path / "s", tables=[spec], tiers=[embstore.TierSpec("rocksdb")]) as s:
        s.update("t", np.array([1]), np.ones((1, 4), np.float32))
    config = next((tmp_path / "s").rglob("rocksdict-config.json"))
    for torn in ("", '{"raw_mo'):
        config.write_text(torn)
        with embstore.open(tmp_path / "s") as s:
            assert s.lookup("t", np.array([1])).tolist() == [[1, 1, 1, 1]]
