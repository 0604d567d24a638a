"""Power loss, simulated by reading the system calls: a flush syncs all it must.

Whatever a store wrote before flush() returned is synced by then (data, and new files'
directory entries), on every persistent backend. A SIGKILL keeps the page cache, so crash
tests cannot see a missing sync; these tests record the child's system calls with strace and
check them (tests/crash/_synccheck.py). Each one is also run with the syncs removed, to show
that the check fails then.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _synccheck  # noqa: E402  (beside this file; tests/ is not a package)

pytestmark = [pytest.mark.crash,
              pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")]

CHILD = r'''
import os, sys
import numpy as np
import embstore
path, bottom = sys.argv[1], sys.argv[2]
if os.environ.get("DROP_SYNCS"):  # what the store would be without its syncs
    os.fsync = os.fdatasync = lambda fd: None
    from embstore.backends import lmdb as lm, rocksdb as rd
    rd.RocksDBBackend._flush = lambda self: None
    lm.LMDBBackend._flush = lambda self: None
drop = os.environ.get("DROP_SYNC", "")  # one sync site removed (see SITES in the test)
if drop:
    import stat
    real_fsync = os.fsync
    from embstore.backends import lmdb as lm, pmem as pm, rocksdb as rd
    def fsync_unless(kind):
        def fsync(fd):
            if not kind(os.fstat(fd).st_mode):
                real_fsync(fd)
        return fsync
    if drop == "rocksdb.flush_wal":
        rd.RocksDBBackend._flush = lambda self: None
    elif drop == "lmdb.env_sync":
        lm.LMDBBackend._flush = lambda self: None
    elif drop == "pmem.record_sync":
        pm.PmemBackend._persist_slots = lambda self, slots, offset, length: None
    elif drop == "fsync_of_files":  # manifest, written-id record and journal, snapshots
        os.fsync = fsync_unless(stat.S_ISREG)
    elif drop == "fsync_of_directories":
        os.fsync = fsync_unless(stat.S_ISDIR)
spec = embstore.TableSpec("t", dim=8, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))
tiers = [embstore.TierSpec("dram", capacity=50), embstore.TierSpec(bottom)]
store = embstore.open(path, tables=[spec], tiers=tiers)
rng = np.random.default_rng(0)
for _ in range(5):
    ids = rng.integers(0, 500, 200)
    store.update("t", ids, rng.standard_normal((200, 8)).astype(np.float32))
    store.apply_gradients("t", ids, np.ones((200, 8), np.float32))
store.flush()
store.delete("t", rng.integers(0, 500, 20))  # the written-id record's delete journal
store.update("t", np.arange(500, 520), np.ones((20, 8), np.float32))  # new rows: record grows
os.write(2, b"EMBSTORE-MARK-A\n")
store.flush()
os.write(2, b"EMBSTORE-MARK-B\n")
os._exit(0)
'''

DATA_FILE = {"rocksdb": ".log", "lmdb": "data.mdb", "pmem": ".pmem"}


def _trace(tmp_path: Path, bottom: str, **env: str) -> _synccheck.Report:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    store, log = tmp_path / "store", tmp_path / "strace.log"
    subprocess.run(["strace", "-f", "-y", "-qq", "-s", "40", "-e",
                    f"trace={_synccheck.TRACED}", "-o", str(log), sys.executable, str(script),
                    str(store), bottom], env={**os.environ, **env}, check=True, timeout=120,
                   stderr=subprocess.DEVNULL)
    return _synccheck.check(log.read_text(), str(store))


@pytest.mark.parametrize("bottom,env", [("rocksdb", {}), ("lmdb", {}), ("pmem", {}),
                                        ("pmem", {"EMBSTORE_PMEM_FORCE_MMAP": "1"})],
                         ids=["rocksdb", "lmdb", "pmem", "pmem-mmap"])
def test_everything_written_before_flush_returns_is_synced(tmp_path, bottom, env):
    report = _trace(tmp_path, bottom, **env)
    assert report.marker_b_seen
    assert report.problems == []
    # the check saw the table's data file synced, not just nothing at all
    assert any(p.endswith(DATA_FILE[bottom]) for p in report.synced_files), report.synced_files


@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb", "pmem"])
def test_the_check_fails_when_the_syncs_are_removed(tmp_path, bottom):
    report = _trace(tmp_path, bottom, DROP_SYNCS="1")
    assert report.marker_b_seen
    # the table's own data, not only the manifest, is reported unsynced
    assert any("not synced" in p and DATA_FILE[bottom] in p for p in report.problems), \
        report.problems


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


# Each sync of the code, removed alone, and the file the check must then report. The sites:
# RocksDB's WAL sync on flush (RocksDBBackend._flush: flush_wal(sync=True)); LMDB's env sync
# (LMDBBackend._flush: env.sync(True)); the pmem backend's record sync (_persist_slots:
# sync_file_range + fdatasync; pmem_flush + pmem_drain on real pmem); every fsync of a regular
# file (manifest.write_atomic for the manifest and the written-id record, the record's delete
# journal, the DRAM snapshot); every fsync of a directory (manifest.fsync_dir after a rename
# or a new file, _open._make_dirs, the record's directory, LMDB's new data file).
SITES = [("rocksdb", "rocksdb.flush_wal", ".log"), ("lmdb", "lmdb.env_sync", "data.mdb"),
         ("pmem", "pmem.record_sync", ".pmem"),
         ("lmdb", "fsync_of_files", "written/t.ids"), ("lmdb", "fsync_of_files", "t.del"),
         ("lmdb", "fsync_of_directories", "directory was not synced")]


@pytest.mark.parametrize("bottom,site,reported", SITES,
                         ids=[f"{s}-{r.split('/')[-1].split()[0]}" for _, s, r in SITES])
def test_the_check_fails_when_one_sync_is_removed(tmp_path, bottom, site, reported):
    report = _trace(tmp_path, bottom, DROP_SYNC=site)
    assert report.marker_b_seen
    assert any(reported in p for p in report.problems), report.problems
