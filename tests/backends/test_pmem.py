"""What is specific to the pmem backend: libpmem vs the mmap fallback, growth, full disk, the
record format's integrity checks, the out-of-place update scheme, and flush cost.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embstore import _libpmem
from embstore.backend import BackendSpec
from embstore.backends import pmem
from embstore.backends.pmem import (
    DATA_OFFSET,
    HEADER_CRC_OFFSET,
    REC_CRC,
    REC_ID,
    REC_KIND,
    REC_PAYLOAD,
    REC_SEQ,
    STATE,
    STATE_OFFSETS,
    PmemBackend,
    record_size,
    seq_counters,
    seq_words,
)
from embstore.checksum import row_checksums
from embstore.errors import CapacityError, CorruptStoreError, StoreLockedError

pytestmark = pytest.mark.pmem

DIM = 8
REC = record_size(DIM * 4)


def _open(path: Path, *, dim: int = DIM, table: str = "t", read_only: bool = False,
          capacity_bytes: int | None = None) -> PmemBackend:
    return PmemBackend.open(BackendSpec(path=path, dim=dim, table=table, read_only=read_only,
                                        capacity_bytes=capacity_bytes))


def _rows(n: int, seed: int = 0, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def _ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.fixture(params=["libpmem", "mmap"])
def mapping(request, monkeypatch) -> str:
    """Run a test on the libpmem mapping and on the forced mmap + msync fallback."""
    if request.param == "mmap":
        monkeypatch.setenv(_libpmem.FORCE_MMAP_ENV, "1")
    else:
        monkeypatch.delenv(_libpmem.FORCE_MMAP_ENV, raising=False)
        if _libpmem.load() is None:
            pytest.skip("libpmem is not installed")
    return request.param


def _records(file: Path, rec: int = REC) -> np.ndarray:
    data = np.fromfile(file, dtype=np.uint8)
    n = (len(data) - DATA_OFFSET) // rec
    return data[DATA_OFFSET : DATA_OFFSET + n * rec].reshape(n, rec)


def _field(recs: np.ndarray, offset: int, dtype: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    return recs[:, offset : offset + size].copy().view(dtype).ravel()


def _slots_of(file: Path, row_id: int, rec: int = REC) -> np.ndarray:
    """Slots whose record claims `row_id` and is not free."""
    recs = _records(file, rec)
    return np.flatnonzero((_field(recs, REC_ID, "<i8") == row_id)
                          & (_field(recs, REC_SEQ, "<u8") != 0))


def _state(file: Path) -> tuple[int, int, int]:
    """(gen, watermark, reserve) of the current header state block."""
    head = file.read_bytes()[:DATA_OFFSET]
    blocks = [STATE.unpack_from(head, off)[:3] for off in STATE_OFFSETS]
    return max(blocks)


def _poke(file: Path, offset: int, data: bytes) -> None:
    fd = os.open(file, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _encode(row_id: int, counter: int, row: np.ndarray) -> bytearray:
    """A complete record per the documented layout."""
    rec = bytearray(REC)
    rec[REC_ID : REC_ID + 8] = np.int64(row_id).tobytes()
    rec[REC_KIND : REC_KIND + 4] = np.uint32(1).tobytes()
    rec[REC_SEQ : REC_SEQ + 8] = seq_words(np.array([counter], np.uint64)).tobytes()
    rec[REC_PAYLOAD : REC_PAYLOAD + row.nbytes] = row.tobytes()
    run = np.frombuffer(bytes(rec[REC_KIND : REC_PAYLOAD + row.nbytes]), np.uint8)[None, :]
    rec[REC_CRC : REC_CRC + 4] = row_checksums(_ids(row_id), run).tobytes()
    return rec


# --- which mapping ---------------------------------------------------------------------------

def _require_libpmem(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip unless libpmem loads here; its mapping is then used (no forced fallback)."""
    monkeypatch.delenv(_libpmem.FORCE_MMAP_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _libpmem.PmemFallbackWarning)
        if _libpmem.load() is None:
            pytest.skip("libpmem is not installed")

def test_libpmem_maps_the_file_when_the_library_is_present(tmp_path, monkeypatch):
    _require_libpmem(monkeypatch)
    with _open(tmp_path) as b:
        b.put(_ids(1, 2), _rows(2))
        b.flush()
        stats = b.statistics()
    assert stats["libpmem"] is True
    assert isinstance(stats["is_pmem"], bool)


def test_a_reader_on_a_read_only_file_system_maps_with_mmap(tmp_path, monkeypatch):
    # pmem_map_file opens the file for writing: on a read-only mount (a checkpoint on a
    # read-only snapshot) it fails with EROFS, which a reader took for a device error
    from embstore.errors import StorageIOError

    _require_libpmem(monkeypatch)
    with _open(tmp_path) as b:
        b.put(_ids(1, 2), _rows(2))

    def read_only_fs(self: object, lib: object, path: str) -> None:
        raise OSError(errno.EROFS, "pmem_map_file: open: Read-only file system", path)

    monkeypatch.setattr(_libpmem.PmemMapping, "__init__", read_only_fs)
    with _open(tmp_path, read_only=True) as reader:
        rows, found = reader.get(_ids(1, 2))
        assert found.all() and not reader.statistics()["libpmem"]
    np.testing.assert_array_equal(rows, _rows(2))
    with pytest.raises(StorageIOError, match="Read-only file system"):
        _open(tmp_path)


def test_a_table_in_a_folder_with_a_non_utf8_name_opens_on_both_mappings(tmp_path, mapping):
    # libpmem was given the name encoded as UTF-8, which a surrogate escape cannot be: a
    # CorruptStoreError "the files are damaged" for a new table
    folder = tmp_path / os.fsdecode(b"tier\xff")
    with _open(folder) as b:
        b.put(_ids(1, 2), _rows(2))
        assert b.statistics()["libpmem"] is (mapping == "libpmem")
    with _open(folder, read_only=True) as reader:
        rows, found = reader.get(_ids(1, 2))
    assert found.all()
    np.testing.assert_array_equal(rows, _rows(2))

_PMEM_CHILD = r"""
import sys
import numpy as np
from embstore.backend import BackendSpec
from embstore.backends.pmem import PmemBackend
b = PmemBackend.open(BackendSpec(path=sys.argv[1], dim=8, capacity_bytes=4096 + 64 * 56))
ids = np.arange(500, dtype=np.int64)
b.put(ids, np.ones((500, 8), np.float32))  # grows the file on the way
b.flush()
b.put(ids[:100].copy(), np.zeros((100, 8), np.float32))
b.delete(ids[400:].copy())
print(b.statistics()["is_pmem"])
b.close()
"""


def test_persistent_memory_path_flushes_cache_lines_and_keeps_the_format(tmp_path,
                                                                         monkeypatch):
    """No DAX file system here: PMEM_IS_PMEM_FORCE makes libpmem treat the file as pmem, which
    runs the pmem_flush/pmem_drain path (read when libpmem loads: a child process).
    """
    _require_libpmem(monkeypatch)
    done = subprocess.run([sys.executable, "-c", _PMEM_CHILD, str(tmp_path)],
                          env={**os.environ, "PMEM_IS_PMEM_FORCE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
    with _open(tmp_path, table="default") as b:
        got, found = b.get(np.arange(500, dtype=np.int64))
        assert b.statistics()["is_pmem"] is False
    assert found.tolist() == [True] * 400 + [False] * 100
    assert not got[:100].any() and (got[100:400] == 1).all()


def test_force_mmap_env_selects_the_msync_fallback_and_the_same_format(tmp_path, monkeypatch):
    monkeypatch.setenv(_libpmem.FORCE_MMAP_ENV, "1")
    with _open(tmp_path) as b:
        assert b.statistics()["libpmem"] is False
        assert b.statistics()["is_pmem"] is False
        b.put(_ids(1, 2, 3), _rows(3))
    monkeypatch.delenv(_libpmem.FORCE_MMAP_ENV)
    with _open(tmp_path) as b:  # the other mapping reads the same file
        got, found = b.get(_ids(1, 2, 3))
    assert found.all()
    np.testing.assert_array_equal(got, _rows(3))


def test_missing_libpmem_warns_once_and_falls_back_to_mmap(tmp_path, monkeypatch):
    monkeypatch.delenv(_libpmem.FORCE_MMAP_ENV, raising=False)
    monkeypatch.setattr(_libpmem, "LIBRARY_NAME", "libpmem-not-installed.so.404")
    monkeypatch.setattr(_libpmem, "_lib", None)
    monkeypatch.setattr(_libpmem, "_warned", False)
    with pytest.warns(_libpmem.PmemFallbackWarning, match="libpmem cannot be loaded"):
        first = _open(tmp_path, table="a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        second = _open(tmp_path, table="b")
    try:
        assert first.statistics()["libpmem"] is False
        first.put(_ids(7), _rows(1))
        first.flush()
    finally:
        first.close()
        second.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _open(tmp_path, table="a") as again:
            np.testing.assert_array_equal(again.get(_ids(7))[0], _rows(1))


# --- growth and full disk --------------------------------------------------------------------

def test_file_grows_across_remaps_and_keeps_every_row(tmp_path, mapping):
    file = tmp_path / "t.pmem"
    capacities = []
    with _open(tmp_path, capacity_bytes=DATA_OFFSET + 64 * REC) as b:
        assert b.statistics()["capacity_rows"] == 64
        for k in range(12):
            b.put(np.arange(k * 100, k * 100 + 100, dtype=np.int64), _rows(100, seed=k))
            b.put(np.arange(0, 50, dtype=np.int64), _rows(50, seed=100 + k))  # updates too
            capacities.append(b.statistics()["capacity_rows"])
            assert file.stat().st_size == DATA_OFFSET + capacities[-1] * REC
        got, found = b.get(np.arange(1200, dtype=np.int64))
        assert found.all()
    assert len(set(capacities)) >= 3  # it remapped more than once
    assert capacities == sorted(capacities)
    expected = np.concatenate([_rows(100, seed=k) for k in range(12)])
    expected[:50] = _rows(50, seed=111)
    np.testing.assert_array_equal(got, expected)
    with _open(tmp_path) as b:
        got, found = b.get(np.arange(1200, dtype=np.int64))
        assert found.all()
        np.testing.assert_array_equal(got, expected)


def test_failed_preallocation_is_a_capacity_error_that_changes_nothing(tmp_path, mapping,
                                                                      monkeypatch):
    file = tmp_path / "t.pmem"
    b = _open(tmp_path, capacity_bytes=DATA_OFFSET + 64 * REC)
    try:
        b.put(np.arange(50, dtype=np.int64), _rows(50))
        b.flush()
        size = file.stat().st_size

        def disk_full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", disk_full)
        with pytest.raises(CapacityError) as info:
            b.put(np.arange(100, 200, dtype=np.int64), _rows(100, seed=1))
        assert info.value.hint
        assert "t.pmem" in str(info.value)
        assert len(b) == 50
        assert file.stat().st_size == size
        assert not b.contains(np.arange(100, 200, dtype=np.int64)).any()
        np.testing.assert_array_equal(b.get(np.arange(50, dtype=np.int64))[0], _rows(50))
        b.put(np.arange(200, 210, dtype=np.int64), _rows(10, seed=2))  # still fits
        monkeypatch.undo()
        b.put(np.arange(100, 200, dtype=np.int64), _rows(100, seed=1))
        assert len(b) == 160
    finally:
        b.close()


@contextlib.contextmanager
def _tiny_tmpfs(where: Path, size: str):
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(where)], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_full_file_system_is_a_capacity_error_not_a_crash(tmp_path, mapping):
    dim = 64
    rec = record_size(dim * 4)
    with _tiny_tmpfs(tmp_path / "small", "1M") as small:
        b = _open(small, dim=dim, capacity_bytes=DATA_OFFSET + 64 * rec)
        stored = 0
        try:
            with pytest.raises(CapacityError) as info:
                for k in range(100):  # 1 MiB holds ~3700 records: the disk fills first
                    b.put(np.arange(stored, stored + 256, dtype=np.int64),
                          _rows(256, seed=k, dim=dim))
                    stored += 256
            assert info.value.hint
            assert 256 <= stored < 4000
            b.flush()
            got, found = b.get(np.arange(stored, dtype=np.int64))
            assert found.all()
            np.testing.assert_array_equal(got[:256], _rows(256, seed=0, dim=dim))
        finally:
            b.close()
        with _open(small, dim=dim) as b:
            assert len(b) == stored
        with pytest.raises(CapacityError):  # a new table that does not fit: no file left
            _open(small, dim=dim, table="big", capacity_bytes=4 << 20)
        assert sorted(p.name for p in small.iterdir()) == ["t.pmem"]


@pytest.mark.parametrize("capacity_bytes", [DATA_OFFSET + (2**31) * REC, 2**80])
def test_a_capacity_past_the_slots_a_file_holds_is_a_capacity_error(tmp_path, mapping,
                                                                    capacity_bytes):
    # refused before the file is preallocated: 2**31 records are 100 GiB here
    with pytest.raises(CapacityError, match="at most 2147483647 rows"):
        _open(tmp_path, capacity_bytes=capacity_bytes)
    assert list(tmp_path.iterdir()) == []


def test_a_file_grown_past_the_slots_it_can_hold_is_refused_before_a_scan(tmp_path, mapping):
    with _open(tmp_path) as b:
        b.put(_ids(1, 2), _rows(2))
    os.truncate(tmp_path / "t.pmem", 1 << 40)  # sparse: a scan would read 1 TiB of zeros
    with pytest.raises(CorruptStoreError, match="more than the 2147483647 slots"):
        _open(tmp_path)


# --- integrity ---------------------------------------------------------------------------------

def test_every_byte_of_a_stored_record_is_checked_on_open(tmp_path, mapping):
    file = tmp_path / "t.pmem"
    with _open(tmp_path) as b:
        b.put(_ids(1, 2, 3), _rows(3))
    (slot,) = _slots_of(file, 2)
    start = DATA_OFFSET + int(slot) * REC
    original = file.read_bytes()[start : start + REC]
    for k in range(REC_PAYLOAD + DIM * 4):
        _poke(file, start + k, bytes([original[k] ^ 0xFF]))
        with pytest.raises(CorruptStoreError) as info:
            _open(tmp_path).close()
        assert str(file) in str(info.value) and f"slot {slot}" in str(info.value)
        _poke(file, start + k, original[k : k + 1])
    with _open(tmp_path) as b:  # undamaged again, and the failed opens released their lock
        np.testing.assert_array_equal(b.get(_ids(1, 2, 3))[0], _rows(3))


@pytest.mark.parametrize("region", ["id", "payload"])
def test_every_byte_of_a_row_is_checked_on_read(tmp_path, mapping, region):
    file = tmp_path / "t.pmem"
    with _open(tmp_path) as b:
        b.put(_ids(1, 2, 3), _rows(3))
        b.flush()
        (slot,) = _slots_of(file, 2)
        start = DATA_OFFSET + int(slot) * REC
        lo, hi = (REC_ID, REC_ID + 8) if region == "id" else (REC_PAYLOAD, REC_PAYLOAD + DIM * 4)
        original = file.read_bytes()[start : start + REC]
        for k in range(lo, hi):
            for flip in (0x01, 0xFF):
                _poke(file, start + k, bytes([original[k] ^ flip]))  # the mapping sees it
                with pytest.raises(CorruptStoreError) as info:
                    b.get(_ids(1, 2, 3))
                message = str(info.value)
                assert "table 't'" in message and "id 2" in message and str(file) in message
                _poke(file, start + k, original[k : k + 1])
        got, found = b.get(_ids(3, 2, 1))
        assert found.all()
        np.testing.assert_array_equal(got, _rows(3)[::-1])


def test_open_scans_the_file_in_chunks_with_the_same_result(tmp_path, mapping, monkeypatch):
    monkeypatch.setattr(pmem, "SCAN_SLOTS", 50)
    file = tmp_path / "t.pmem"
    ids = np.arange(300, dtype=np.int64) * 7
    with _open(tmp_path) as b:
        b.put(ids, _rows(300))
        b.flush()
        b.put(ids[::3].copy(), _rows(100, seed=1))  # second versions, some in later chunks
        b.delete(ids[1::3].copy())
    expected = _rows(300)
    expected[::3] = _rows(100, seed=1)
    with _open(tmp_path) as b:
        got, found = b.get(ids)
        assert len(b) == 200
    assert found.tolist() == [k % 3 != 1 for k in range(300)]
    np.testing.assert_array_equal(got[found], expected[found])
    (slot,) = _slots_of(file, int(ids[-1]))
    assert slot > 100
    _poke(file, DATA_OFFSET + int(slot) * REC + REC_PAYLOAD, b"\x00\x00\x00\x00")
    with pytest.raises(CorruptStoreError, match=f"slot {slot} "):
        _open(tmp_path)


def test_damaged_header_is_reported(tmp_path, mapping):
    file = tmp_path / "t.pmem"
    with _open(tmp_path) as b:
        b.put(_ids(1), _rows(1))
    _poke(file, HEADER_CRC_OFFSET - 10, b"\x55")
    with pytest.raises(CorruptStoreError, match="header checksum"):
        _open(tmp_path)


# --- out-of-place updates and crashes ------------------------------------------------------------

def test_overwrite_leaves_the_flushed_record_untouched_until_the_next_flush(tmp_path, mapping):
    file = tmp_path / "t.pmem"
    with _open(tmp_path) as b:
        b.put(_ids(5), _rows(1, seed=1))
        b.flush()
        (old,) = _slots_of(file, 5)
        before = _records(file)[old].copy()
        b.put(_ids(5), _rows(1, seed=2))
        slots = _slots_of(file, 5)
        assert len(slots) == 2  # the new version went to another slot
        np.testing.assert_array_equal(_records(file)[old], before)
        # no flush promised the new version: a rewrite before the next flush reuses its slot
        b.put(_ids(5), _rows(1, seed=3))
        np.testing.assert_array_equal(_slots_of(file, 5), slots)
        np.testing.assert_array_equal(_records(file)[old], before)
        np.testing.assert_array_equal(b.get(_ids(5))[0], _rows(1, seed=3))
        b.flush()
        (new,) = _slots_of(file, 5)  # the old version is retired only now
        assert new != old
        b.delete(_ids(5))
        assert len(_slots_of(file, 5)) == 1  # a delete also waits for the flush
        b.flush()
        assert len(_slots_of(file, 5)) == 0
    with _open(tmp_path) as b:
        assert not b.contains(_ids(5)).any()


@pytest.mark.parametrize("cut", ["before_seq", "mid_payload", "after_seq"])
def test_interrupted_write_leaves_the_old_value(tmp_path, mapping, cut):
    """A write killed mid-record is ignored on open; a completed one wins by its seq."""
    file = tmp_path / "t.pmem"
    v1, v2 = _rows(1, seed=1), _rows(1, seed=2)
    with _open(tmp_path) as b:
        b.put(_ids(9, 10), np.concatenate([v1, _rows(1, seed=3)]))
    _, watermark, reserve = _state(file)
    assert watermark < reserve
    recs = _records(file)
    free = int(np.flatnonzero(_field(recs, REC_SEQ, "<u8") == 0)[0])
    record = _encode(9, watermark + 1, v2[0])
    if cut == "before_seq":  # killed before the seq word was stored: still a free slot
        record[REC_SEQ : REC_SEQ + 8] = bytes(8)
    elif cut == "mid_payload":  # seq stored, payload half written
        half = REC_PAYLOAD + DIM * 2
        record[half:] = bytes(REC - half)
    _poke(file, DATA_OFFSET + free * REC, bytes(record))
    with _open(tmp_path) as b:
        got, found = b.get(_ids(9, 10))
        stats = b.statistics()
    assert found.all() and len(_slots_of(file, 9)) == 1
    np.testing.assert_array_equal(got[0], (v2 if cut == "after_seq" else v1)[0])
    np.testing.assert_array_equal(got[1], _rows(1, seed=3)[0])
    assert stats["torn_records_ignored"] == (cut == "mid_payload")
    assert stats["stale_records_retired"] == (cut == "after_seq")
    with _open(tmp_path) as b:  # the cut-short record was retired: nothing left to ignore
        assert b.statistics()["torn_records_ignored"] == 0


def test_seq_words_detect_any_single_byte_change():
    words = seq_words(np.array([1, 255, 256, 2**40 + 7, 2**56 - 1], dtype=np.uint64))
    counters, intact = seq_counters(words)
    assert intact.all() and counters.tolist() == [1, 255, 256, 2**40 + 7, 2**56 - 1]
    raw = words.view(np.uint8).reshape(-1, 8)
    for k in range(8):
        for flip in (0x01, 0x80, 0xFF):
            damaged = raw.copy()
            damaged[:, k] ^= flip
            assert not seq_counters(damaged.view("<u8").ravel())[1].any()


def test_rows_from_get_are_copies_that_outlive_the_mapping(tmp_path, mapping):
    with _open(tmp_path) as b:
        b.put(_ids(1, 2), _rows(2))
        got, _ = b.get(_ids(1, 2))
        assert got.flags.owndata and got.flags.writeable
    # unmapped now: a view into the mapping would fault or be stale here
    np.testing.assert_array_equal(got, _rows(2))
    got[:] = 0.0


def test_a_second_writer_of_the_same_table_is_refused_and_readers_join_it(tmp_path, mapping):
    with _open(tmp_path) as b:
        b.put(_ids(1), _rows(1))
        with pytest.raises(StoreLockedError):
            _open(tmp_path)
        b.flush()
        with _open(tmp_path, read_only=True) as r:
            assert len(r) == 1
    with _open(tmp_path, read_only=True) as r1, _open(tmp_path, read_only=True) as r2:
        assert len(r1) == len(r2) == 1


def test_a_reader_beside_a_writer_rewriting_rows_never_returns_a_torn_row(tmp_path, mapping):
    ids = np.arange(64, dtype=np.int64)
    stop = threading.Event()
    with _open(tmp_path) as w:
        w.put(ids, np.zeros((64, DIM), np.float32))
        w.flush()

        def write() -> None:  # rows rewritten in place (unflushed) and, now and then, moved
            v = 0
            while not stop.is_set():
                v += 1
                w.put(ids, np.full((64, DIM), v, np.float32))
                if v % 50 == 0:
                    w.flush()

        with _open(tmp_path, read_only=True) as r:
            thread = threading.Thread(target=write)
            thread.start()
            try:
                reads, deadline = 0, time.monotonic() + 0.5
                while time.monotonic() < deadline:
                    got, found = r.get(ids)
                    assert found.all()
                    assert (got == got[:, :1]).all(), "a row mixes two writes"
                    reads += 1
            finally:
                stop.set()
                thread.join()
    assert reads > 10


def test_a_reader_beside_the_writer_follows_retired_and_reused_slots(tmp_path, mapping):
    ids = np.arange(100, dtype=np.int64)
    with _open(tmp_path) as w:
        w.put(ids, _rows(100, seed=1))
        w.flush()
        with _open(tmp_path, read_only=True) as r:
            np.testing.assert_array_equal(r.get(ids)[0], _rows(100, seed=1))
            for seed in (2, 3):  # 2: the reader's slots retired; 3: retired ones reused
                w.put(ids, _rows(100, seed=seed))
                w.flush()
                got, found = r.get(ids)
                assert found.all()
                np.testing.assert_array_equal(got, _rows(100, seed=seed))
            w.delete(ids[:10])
            w.put(np.arange(1000, 5000, dtype=np.int64), _rows(4000, seed=4))  # the file grows
            w.flush()
            r.refresh()
            assert len(r) == 4090 and not r.contains(ids[:10]).any()
            np.testing.assert_array_equal(r.get(np.arange(1000, 5000))[0], _rows(4000, seed=4))


# --- flush cost --------------------------------------------------------------------------------

def _write_bytes() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_flush_of_scattered_dirty_rows_writes_under_8_KiB_per_row(tmp_path, mapping):
    n, dim, dirty = 50_000, 64, 1000
    rng = np.random.default_rng(0)
    with _open(tmp_path, dim=dim) as b:
        for start in range(0, n, 10_000):
            b.put(np.arange(start, start + 10_000, dtype=np.int64),
                  _rows(10_000, seed=start, dim=dim))
        b.flush()
        per_row = []
        for round_ in range(3):  # later rounds reuse the slots earlier ones freed
            ids = np.sort(rng.choice(n, dirty, replace=False)).astype(np.int64)
            rows = _rows(dirty, seed=round_, dim=dim)
            before = _write_bytes()
            b.put(ids, rows)
            b.flush()
            per_row.append((_write_bytes() - before) / dirty)
        if b.statistics()["is_pmem"]:
            pytest.skip("persistent memory: flushes are cache-line writes, not page I/O")
    assert max(per_row) < 8192, per_row


def test_module_layout_constants_match_the_documented_table():
    from embstore.backends import _pmem_format

    doc = _pmem_format.__doc__ or ""
    for text in ("0       8     magic", "60      4     CRC-32C of bytes 0..60",
                 "12      4     kind", "16      8     seq word", "24      r     payload"):
        assert text in doc
    assert (REC_ID, REC_CRC, REC_KIND, REC_SEQ, REC_PAYLOAD) == (0, 8, 12, 16, 24)
    assert record_size(32) == 56 and record_size(36) == 64


# --- SIGKILL at any point ----------------------------------------------------------------------

_CHILD = r"""
import sys
import numpy as np
from embstore.backend import BackendSpec
from embstore.backends.pmem import PmemBackend
sys.path.insert(0, sys.argv[2])
from test_pmem import _crash_ops, _crash_row
b = PmemBackend.open(BackendSpec(path=sys.argv[1], dim=16, table="t",
                                 capacity_bytes=4096 + 64 * 88))  # it grows while it runs
for step, (kind, ids, version) in enumerate(_crash_ops()):
    if kind == "put":
        b.put(ids, np.stack([_crash_row(i, version) for i in ids.tolist()]))
    else:
        b.delete(ids)
    b.flush()
    print(step, flush=True)
"""


def _crash_row(row_id: int, version: int) -> np.ndarray:
    return (row_id * 1000 + version + np.arange(16) / 32).astype(np.float32)


def _crash_ops(steps: int = 100_000):
    rng = np.random.default_rng(42)
    for step in range(steps):
        ids = np.unique(rng.integers(0, 3000, 400)).astype(np.int64)
        yield ("delete" if step % 5 == 4 else "put"), ids, step + 1


@pytest.mark.crash
def test_sigkill_never_loses_a_flushed_row_nor_tears_one(tmp_path, mapping):
    rng = np.random.default_rng(7)
    for trial in range(3):
        path = tmp_path / f"trial{trial}"
        # unbuffered: what readline reads, communicate() (which reads the descriptor) must
        # not have had read ahead of it
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path),
                                  str(Path(__file__).parent)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        acked = []
        while len(acked) < 4:  # started, whatever the machine's load: then kill at random
            line = child.stdout.readline()
            if not line:
                break
            acked.append(int(line))
        time.sleep(rng.uniform(0, 0.8))
        child.send_signal(signal.SIGKILL)
        out, err = child.communicate(timeout=60)
        acked += [int(line) for line in out.split()]
        assert child.returncode == -signal.SIGKILL, err.decode(errors="replace")
        last = acked[-1] if acked else -1
        # every id's value as of the last acknowledged flush; the step after it was running
        # (or done but not yet reported) when the kill came, and may have left its values
        flushed: dict[int, int | None] = {}
        later: dict[int, set[int | None]] = {}
        for step, (kind, ids, version) in enumerate(_crash_ops(last + 2)):
            for i in ids.tolist():
                value = version if kind == "put" else None
                if step <= last:
                    flushed[i] = value
                else:
                    later.setdefault(i, set()).add(value)
        assert last >= 3, "the child was killed before it got going"
        with _open(path, dim=16) as b:
            every = np.arange(3000, dtype=np.int64)
            got, found = b.get(every)
        for i in range(3000):
            allowed = {flushed.get(i)} | later.get(i, set())
            if not found[i]:
                assert None in allowed, f"id {i} lost (trial {trial}, last flush {last})"
                continue
            version = int(round(float(got[i, 0]) - i * 1000))
            assert version in allowed, f"id {i}: version {version} not in {allowed}"
            np.testing.assert_array_equal(got[i], _crash_row(i, version))  # never torn


@pytest.mark.parametrize("read_only", [False, True])
def test_a_directory_in_place_of_the_table_file_is_named_as_such(tmp_path, read_only):
    # it was a StorageIOError "No such device; check the device (dmesg)" (mmap's ENODEV on
    # a directory opened read-only, EISDIR opened for writing)
    (tmp_path / "t.pmem").mkdir()
    with pytest.raises(CorruptStoreError, match="t.pmem is not a regular file"):
        _open(tmp_path, read_only=read_only)


@contextlib.contextmanager
def _unblocked_after(fifo: Path, seconds: float) -> Iterator[list[bool]]:
    """Yield a list that gets True each time an open of `fifo` for reading had to be let go.

    Every `seconds`, the pipe is opened for writing, which lets a blocked reader go on.
    """
    let_go: list[bool] = []
    stop = threading.Event()

    def writer() -> None:
        while not stop.wait(seconds):
            with contextlib.suppress(OSError):  # ENXIO: nobody waits on it, as it should be
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                let_go.append(True)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield let_go
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("read_only", [False, True])
def test_a_named_pipe_in_place_of_the_table_file_is_refused_not_waited_on(tmp_path,
                                                                         read_only):
    # the open blocked until a writer came to the pipe: `open` and fsck hung for ever
    import embstore
    from embstore import fsck

    tiers = [embstore.TierSpec("pmem")]
    with embstore.open(tmp_path / "s", tables=[embstore.TableSpec("t", dim=DIM)],
                       tiers=tiers) as store:
        store.update("t", np.arange(3), np.ones((3, DIM), np.float32))
    file = tmp_path / "s" / "tier0-pmem" / "t.pmem"
    file.unlink()
    os.mkfifo(file)
    with _unblocked_after(file, 5) as let_go:
        with pytest.raises(CorruptStoreError, match="t.pmem is not a regular file"):
            _open(file.parent, read_only=read_only)
        assert fsck.exit_code(fsck.check(tmp_path / "s")) == 4
    assert not let_go
