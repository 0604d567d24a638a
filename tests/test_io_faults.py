"""I/O errors at every position: flush, write-back and checkpoint meet a failing medium.

For each operation, each error (EIO, ENOSPC) and each kind (once; from then on), the N-th call
into the store of record fails, for N = 1, 2, ... until one run meets no fault (the SQLite
fault-simulation loop). Each run must succeed or raise a documented embstore error; a failed
sync must bar every later flush of the handle (SyncFailedError); closing and reopening must
give a store with a clean fsck that holds every row flushed before the fault, and the
operation's rows where it succeeded. Compaction (`embstore compact`, which rewrites the store
beside itself and swaps it in) meets the failing medium in the copy it writes: it must fail
with an embstore error and leave the old store as it was, or succeed.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import _rebuild, fsck
from embstore.errors import (
    CapacityError,
    CorruptStoreError,
    EmbstoreError,
    StorageIOError,
    SyncFailedError,
)
from embstore.testing import FaultyBackend, inject

DIM = 4
ERRORS = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC}


def _rows(ids: np.ndarray, tag: float) -> np.ndarray:
    return (ids[:, None] * 0.5 + tag + np.arange(DIM)).astype(np.float32)


def _open(path: Path, backend: str) -> embstore.EmbeddingStore:
    return embstore.open(path, tables=[embstore.TableSpec("t", dim=DIM)],
                         tiers=[embstore.TierSpec("dram", capacity=20, eviction="lru"),
                                embstore.TierSpec(backend)])


BEFORE, DURING = np.arange(0, 60), np.arange(40, 120)


def _operation(store: embstore.EmbeddingStore, op: str, path: Path) -> None:
    if op == "writeback":  # 80 rows through a 20-row cache: 60 write-backs
        for lo in range(0, len(DURING), 10):
            ids = DURING[lo:lo + 10]
            store.update("t", ids, _rows(ids, 1.0))
    elif op == "flush":
        store.update("t", DURING, _rows(DURING, 1.0))
        store.flush()
    else:
        store.update("t", DURING, _rows(DURING, 1.0))
        store.checkpoint(path.parent / "ckpt", step=1)


def _one_run(tmp: Path, backend: str, op: str, nth: int, code: int, persistent: bool) -> int:
    """One trial; returns the faults that fired."""
    path = tmp / "s"
    with _open(path, backend) as store:
        store.update("t", BEFORE, _rows(BEFORE, 0.0))
        store.flush()
    store = _open(path, backend)
    faulty = inject(store, "t", method="any", nth=nth, persistent=persistent,
                    error=OSError(code, os.strerror(code)))
    ok = True
    try:
        _operation(store, op, path)
        store.flush()
    except EmbstoreError as exc:
        ok = False
        assert isinstance(exc, (StorageIOError, SyncFailedError)), repr(exc)
        if faulty.wrapped_flush_failed:
            # fsyncgate: once a sync failed, no flush of this handle may succeed
            faulty.disarm()
            with pytest.raises(SyncFailedError):
                store.flush()
    faulty.disarm()
    try:
        store.close()
    except EmbstoreError:
        assert not ok or faulty.faults
    assert fsck.check(path) == []
    with embstore.open(path) as store:
        got = store.lookup("t", BEFORE)
        if ok:
            assert np.array_equal(store.lookup("t", DURING), _rows(DURING, 1.0))
        keep = BEFORE[~np.isin(BEFORE, DURING)]
        assert np.array_equal(got[: len(keep)], _rows(keep, 0.0))  # flushed before: intact
        changed = got[len(keep):]
        assert all(np.array_equal(r, _rows(np.array([i]), 0.0)[0])
                   or np.array_equal(r, _rows(np.array([i]), 1.0)[0])
                   for i, r in zip(BEFORE[len(keep):], changed, strict=True))
    if ok and op == "checkpoint":
        assert fsck.check(path.parent / "ckpt") == []
    return faulty.faults


def _loop(tmp_path: Path, backend: str, op: str, code: int, persistent: bool,
          limit: int) -> int:
    return _every_position(
        tmp_path, lambda trial, nth: _one_run(trial, backend, op, nth, code, persistent), limit)


def _every_position(tmp_path: Path, trial_run, limit: int) -> int:
    """`trial_run(dir, nth)` for nth = 1, 2, ... until no fault fires; returns that nth."""
    nth = 0
    while True:
        nth += 1
        trial = tmp_path / f"n{nth}"
        fired = trial_run(trial, nth)
        shutil.rmtree(trial)
        if not fired:
            return nth
        assert nth < limit, f"the fault still fires at call {nth}"


def _error_cases(quick: set[str], *first: str) -> list:
    """Parameters (*first, code, persistent) for each pairing of error and persistence, those
    not named in `quick` ("EIO-once", ...) left to the slow job.
    """
    return [pytest.param(*first, code, persistent, id="-".join((*first, name, when)),
                         marks=[] if f"{name}-{when}" in quick else [pytest.mark.slow])
            for name, code in ERRORS.items()
            for persistent, when in ((False, "once"), (True, "persistent"))]


# the README's suite fails each operation one way (both errors, both persistences among
# them); the slow job every way
@pytest.mark.parametrize(("op", "code", "persistent"), [
    *_error_cases({"EIO-once"}, "flush"), *_error_cases({"ENOSPC-persistent"}, "writeback"),
    *_error_cases({"ENOSPC-once"}, "checkpoint")])
def test_a_failure_at_every_io_position_is_reported_and_loses_nothing(tmp_path, op, code,
                                                                      persistent):
    positions = _loop(tmp_path, "rocksdb", op, code, persistent, limit=200)
    print(f"io faults rocksdb {op} {errno.errorcode[code]} persistent={persistent}: "
          f"{positions} positions")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lmdb", "pmem"])
@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize("code", list(ERRORS.values()), ids=list(ERRORS))
@pytest.mark.parametrize("op", ["flush", "writeback", "checkpoint"])
def test_a_failure_at_every_io_position_on_other_backends(tmp_path, backend, op, code,
                                                          persistent):
    _loop(tmp_path, backend, op, code, persistent, limit=200)


def test_after_a_failed_sync_the_handle_refuses_to_flush_until_reopened(tmp_path):
    store = _open(tmp_path / "s", "lmdb")
    store.update("t", BEFORE, _rows(BEFORE, 0.0))
    faulty = inject(store, "t", method="flush", nth=1)
    with pytest.raises(StorageIOError) as info:
        store.flush()
    assert info.value.errno == errno.EIO
    store.update("t", DURING, _rows(DURING, 1.0))
    for _ in range(2):  # the medium works again, the handle still refuses
        with pytest.raises(SyncFailedError, match="close the store and reopen it"):
            store.flush()
    assert faulty.calls == 1
    with pytest.raises(SyncFailedError):  # close cannot vouch for those writes either
        store.close()
    assert store.closed
    with embstore.open(tmp_path / "s") as store:
        store.update("t", DURING, _rows(DURING, 1.0))
        store.flush()  # a new handle flushes again
    assert fsck.check(tmp_path / "s") == []


FILL = r'''
import sys, numpy as np, embstore
from embstore.errors import EmbstoreError
store = embstore.open(sys.argv[1], tables=[embstore.TableSpec("t", dim=256)],
                      tiers=[embstore.TierSpec(sys.argv[2])])
try:
    for i in range(100000):
        ids = np.arange(i * 256, (i + 1) * 256)
        store.update("t", ids, np.ones((256, 256), np.float32))
        store.flush()
except EmbstoreError as exc:
    print("ERROR", type(exc).__name__, exc)
    sys.exit(3)
print("never full")
'''


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=30)
    except OSError as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if proc.returncode:
        pytest.skip(f"cannot mount an 8 MiB tmpfs here (needs root): {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


@pytest.mark.parametrize("backend", ["rocksdb", "lmdb", "pmem", "dram"])
def test_a_really_full_file_system_gives_a_clear_error_and_no_sigbus(small_fs, backend):
    proc = subprocess.run([sys.executable, "-c", FILL, str(small_fs / "s"), backend],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "ERROR" in proc.stdout and ("space" in proc.stdout or "full" in proc.stdout), \
        proc.stdout


@pytest.mark.parametrize("backend", ["rocksdb", "lmdb", "pmem"])
def test_a_checkpoint_or_restore_into_a_full_file_system_fails_and_frees_its_space(
        small_fs, tmp_path, backend):
    # a checkpoint that fails for space leaves nothing, not even the space its files took
    # (a database kept open holds its removed files); a restore says the disk is full
    tables = [embstore.TableSpec("t", dim=256, optimizer=embstore.optim.Adam(lr=0.1))]
    ids = np.arange(4000)  # 12 MiB of rows and state: more than the 8 MiB file system
    with embstore.open(tmp_path / "s", tables=tables,
                       tiers=[embstore.TierSpec(backend)]) as store:
        store.update("t", ids, np.ones((len(ids), 256), np.float32))
        with pytest.raises((StorageIOError, CapacityError)) as failed:  # not "damaged"
            store.checkpoint(small_fs / "ckpt")
        assert "disk space" in str(failed.value), failed.value
        assert list(small_fs.iterdir()) == []
        fs = os.statvfs(small_fs)
        assert fs.f_bfree == fs.f_blocks
        store.checkpoint(tmp_path / "ckpt")
    with pytest.raises(StorageIOError, match="No space left") as info:
        embstore.restore(tmp_path / "ckpt", small_fs / "r")
    assert info.value.errno == errno.ENOSPC
    assert list(small_fs.iterdir()) == []

def _compact_run(tmp: Path, backend: str, nth: int, code: int, persistent: bool,
                 monkeypatch: pytest.MonkeyPatch) -> int:
    """One compaction whose new copy fails at its `nth` I/O; returns the faults that fired."""
    path = tmp / "s"
    with _open(path, backend) as store:
        store.update("t", BEFORE, _rows(BEFORE, 0.0))
        store.delete("t", BEFORE[::2])
    kept = BEFORE[1::2]
    wrappers: list[FaultyBackend] = []
    real_open = _rebuild.open_bottom

    def open_bottom(root, spec, tiers, *, read_only, **kwargs):
        medium = real_open(root, spec, tiers, read_only=read_only, **kwargs)
        if read_only:  # the old store, read: only the copy's medium fails
            return medium
        wrappers.append(FaultyBackend(medium, method="any", nth=nth, persistent=persistent,
                                      error=OSError(code, os.strerror(code))))
        return wrappers[-1]

    monkeypatch.setattr(_rebuild, "open_bottom", open_bottom)
    try:
        _rebuild.replace_store(path)
    except EmbstoreError as exc:
        assert isinstance(exc, StorageIOError), repr(exc)
        assert any(w.faults for w in wrappers)
    monkeypatch.setattr(_rebuild, "open_bottom", real_open)
    assert fsck.check(path) == []
    with embstore.open(path) as store:  # the old store or the compacted one: the same rows
        assert np.array_equal(store.lookup("t", kept), _rows(kept, 0.0))
        assert sorted(i for ids, _, _ in store.items("t") for i in ids.tolist()) == kept.tolist()
    assert not list(tmp.glob(".s.rebuild-*"))  # a failed copy is removed
    return sum(w.faults for w in wrappers)


@pytest.mark.parametrize(("code", "persistent"), _error_cases({"EIO-once", "ENOSPC-persistent"}))
@pytest.mark.parametrize("backend", ["rocksdb", pytest.param("lmdb", marks=pytest.mark.slow),
                                     pytest.param("pmem", marks=pytest.mark.slow)])
def test_a_failure_at_every_io_position_of_a_compaction_leaves_the_old_store(
        tmp_path, monkeypatch, backend, code, persistent):
    positions = _every_position(tmp_path, lambda trial, nth: _compact_run(
        trial, backend, nth, code, persistent, monkeypatch), limit=100)
    assert positions > 2  # the copy's puts, flush and close were each made to fail
    print(f"io faults {backend} compaction {errno.errorcode[code]} persistent={persistent}: "
          f"{positions} positions")


def test_a_library_error_naming_a_failing_medium_or_met_on_a_full_disk_is_no_damage(
        tmp_path, monkeypatch):
    from embstore import backend

    for text, code in [("mdb_txn_commit: Input/output error", errno.EIO),
                       ("IO error: No space left on device: While appending", errno.ENOSPC)]:
        err = backend.foreign_error(Exception(text), "writing", tmp_path)
        assert isinstance(err, StorageIOError) and err.errno == code, err
        assert "disk space" in str(err)
    corrupt = Exception("Corruption: block checksum mismatch")
    assert isinstance(backend.foreign_error(corrupt, "reading", tmp_path), CorruptStoreError)
    assert isinstance(backend.foreign_error(corrupt, "reading", None), CorruptStoreError)
    full = os.statvfs(tmp_path)
    monkeypatch.setattr(backend.os, "statvfs", lambda path: type(full)(
        (full.f_bsize, full.f_frsize, full.f_blocks, 0, 0, *full[5:])))
    # RocksDB names only its own state after a write failed for space
    err = backend.foreign_error(Exception("IO error: Writer has previous error."), "closing",
                                tmp_path / "gone" / "tier0-rocksdb")
    assert isinstance(err, StorageIOError) and err.errno == errno.ENOSPC
    assert "free disk space" in str(err)
