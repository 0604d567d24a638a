"""What only the lmdb backend does: options, map growth, file modes, scans, corruption, readers."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from embstore.backend import BackendSpec
from embstore.backends.lmdb import (
    CRC_OFFSET,
    CRC_SIZE,
    FILE_MODE,
    PAYLOAD_OFFSET,
    LMDBBackend,
)
from embstore.errors import (
    CapacityError,
    ConfigError,
    CorruptStoreError,
)

DIM = 8
ROW_BYTES = DIM * 4


def _open(path: Path, table: str = "t", **options) -> LMDBBackend:
    read_only = options.pop("read_only", False)
    dim = options.pop("dim", DIM)
    return LMDBBackend.open(BackendSpec(path=path, dim=dim, table=table, read_only=read_only),
                            **options)


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


# --- options, files -----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [{"map_size_bytes": 1000}, {"max_tables": 1},
                                 {"max_map_size_bytes": 1 << 16, "map_size_bytes": 1 << 20},
                                 {"max_readers": 0}, {"no_such_option": 1},
                                 # past what LMDB's C API takes: an OverflowError, or ENOMEM,
                                 # read as a damaged store
                                 {"max_tables": 2**31}, {"max_tables": 2**31 - 1},
                                 {"max_readers": 2**31},
                                 {"map_size_bytes": 2**64, "max_map_size_bytes": 2**64},
                                 {"max_map_size_bytes": 2**64},
                                 # bool("no") is True: no string is read as a flag
                                 {"sync_commits": "no"}, {"readahead": "no"},
                                 {"sync_commits": 2}, {"readahead": None}])
def test_invalid_options_raise_config_error(tmp_path, bad):
    with pytest.raises(ConfigError):
        _open(tmp_path / "tier", **bad)
    assert not (tmp_path / "tier").exists()


def test_a_map_size_above_the_default_maximum_names_both_options(tmp_path):
    with pytest.raises(ConfigError, match=r"map_size_bytes \(2199023255552\) is above "
                                          r"max_map_size_bytes \(1099511627776\)"):
        _open(tmp_path / "tier", map_size_bytes=2 << 40)


@pytest.mark.parametrize("option", ["sync_commits", "readahead"])
@pytest.mark.parametrize("value", [0, 1, np.bool_(True)])
def test_flags_given_as_0_or_1_still_open_as_bools(tmp_path, option, value):
    # any truthy value turned them on once: stores holding 0 or 1 must still open
    with _open(tmp_path / "tier", **{option: value}) as b:
        assert dict(b._settings)[option] is bool(value)


def test_files_are_created_with_mode_0600(tmp_path):
    with _open(tmp_path / "tier") as b:
        b.put(np.arange(3, dtype=np.int64), _rows(3))
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE(os.stat(tmp_path / "tier" / name).st_mode) == FILE_MODE == 0o600


def test_the_map_grows_past_its_initial_size(tmp_path):
    ids = np.arange(20_000, dtype=np.int64) * 31
    rows = _rows(20_000)
    with _open(tmp_path / "tier", map_size_bytes=1 << 16) as b:
        for start in range(0, 20_000, 5000):
            b.put(ids[start:start + 5000], rows[start:start + 5000])
        assert b.statistics()["map_size"] > 1 << 20  # 20,000 rows of 44 bytes do not fit 64 KiB
        assert len(b) == 20_000
    with _open(tmp_path / "tier", map_size_bytes=1 << 16) as b:
        got, found = b.get(ids)
        assert found.all()
        np.testing.assert_array_equal(got, rows)


def test_a_write_past_the_maximum_map_size_raises_and_writes_nothing(tmp_path):
    with _open(tmp_path / "tier", map_size_bytes=1 << 16, max_map_size_bytes=1 << 17) as b:
        b.put(np.arange(10, dtype=np.int64), _rows(10))
        with pytest.raises(CapacityError, match="max_map_size_bytes"):
            b.put(np.arange(10, 20_010, dtype=np.int64), _rows(20_000))
        assert len(b) == 10
        got, found = b.get(np.arange(10, dtype=np.int64))
        assert found.all()
        np.testing.assert_array_equal(got, _rows(10))


def test_a_map_larger_than_the_machine_can_give_is_a_capacity_error(tmp_path):
    # 2**63 bytes fit LMDB's size_t, but no process's address space: ENOMEM, not damage
    with pytest.raises(CapacityError, match="map_size_bytes"):
        _open(tmp_path / "tier", map_size_bytes=1 << 63, max_map_size_bytes=1 << 63)


def test_tables_of_one_directory_must_share_options(tmp_path):
    with _open(tmp_path / "tier", table="a"), pytest.raises(ConfigError, match="options"):
        _open(tmp_path / "tier", table="b", sync_commits=False)


def test_sync_commits_off_still_persists_on_flush(tmp_path):
    ids = np.arange(100, dtype=np.int64)
    with _open(tmp_path / "tier", sync_commits=False) as b:
        b.put(ids, _rows(100))
        b.flush()
    with _open(tmp_path / "tier") as b:
        np.testing.assert_array_equal(b.get(ids)[0], _rows(100))


# --- shared environment -------------------------------------------------------------------

def test_stale_reader_slots_are_cleared_on_open(tmp_path):
    path = tmp_path / "tier"
    _open(path).close()
    script = textwrap.dedent("""
        import sys, lmdb
        env = lmdb.open(sys.argv[1], max_dbs=64)
        txn = env.begin() if sys.argv[2] == "reader" else None
        print("ready", flush=True)
        sys.stdin.read()
    """)
    # The holder keeps the environment open, so the reader table survives the reader's death.
    holder, reader = (subprocess.Popen([sys.executable, "-c", script, str(path), role],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for role in ("holder", "reader"))
    try:
        for child in (holder, reader):
            assert child.stdout.readline().strip() == "ready"
        reader.send_signal(signal.SIGKILL)
        reader.wait(timeout=30)
        with _open(path) as b:
            assert b.statistics()["stale_readers_cleared"] == 1
    finally:
        holder.communicate("", timeout=30)
        reader.stdout.close()
        reader.stdin.close()


# --- scans --------------------------------------------------------------------------------

def test_a_scan_sees_writes_between_its_batches(tmp_path):
    with _open(tmp_path / "tier") as b:
        b.put(np.arange(10, dtype=np.int64), _rows(10))
        scan = b.items(batch_rows=4)
        first_ids, _ = next(scan)
        b.put(np.array([100], dtype=np.int64), _rows(1))  # no transaction is held open
        rest = np.concatenate([i for i, _ in scan])
        assert first_ids.tolist() == [0, 1, 2, 3]
        assert rest.tolist() == [4, 5, 6, 7, 8, 9, 100]


# --- corruption ---------------------------------------------------------------------------

def _value_offsets(data_file: Path, row: np.ndarray) -> list[int]:
    """File offsets of every copy of the value holding `row`.

    A page split leaves stale copies of moved rows in the free space of live pages, and freed
    pages keep old rows; only one copy is live, and the tests damage them all alike.
    """
    data = data_file.read_bytes()
    target = row.tobytes()
    found = []
    pos = data.find(target)
    while pos >= 0:
        found.append(pos - PAYLOAD_OFFSET)
        pos = data.find(target, pos + 1)
    assert found, "row not found in the data file"
    return found


def _flip(path: Path, offsets: list[int], bit: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        for offset in offsets:
            byte = os.pread(fd, 1, offset)[0]
            os.pwrite(fd, bytes([byte ^ (1 << bit)]), offset)
    finally:
        os.close(fd)


def test_every_single_bit_flip_in_a_value_is_detected(tmp_path):
    path = tmp_path / "tier"
    ids = np.arange(500, dtype=np.int64) * 1_000_003
    rows = _rows(500, seed=3)
    rng = np.random.default_rng(0)
    with _open(path) as b:
        b.put(ids, rows)
        b.flush()
        data_file = path / "data.mdb"
        flips: list[tuple[int, list[int], int]] = []
        # Every bit of one value (checksum and payload), then random bits of other values.
        value_bytes = PAYLOAD_OFFSET + ROW_BYTES
        starts = _value_offsets(data_file, rows[123])
        flips += [(123, [s + i for s in starts], bit)
                  for i in range(value_bytes) for bit in range(8)]
        for r in rng.choice(500, size=40, replace=False):
            starts = _value_offsets(data_file, rows[r])
            flips += [(r, [s + int(i) for s in starts], int(rng.integers(8)))
                      for i in rng.integers(value_bytes, size=8)]
        starts = _value_offsets(data_file, rows[7])
        flips += [(7, [s + CRC_OFFSET + i for s in starts], 0) for i in range(CRC_SIZE)]
        wrong = detected = 0
        for r, offsets, bit in flips:
            # The map is shared with the file: the flip is what the next read sees.
            _flip(data_file, offsets, bit)
            try:
                got, found = b.get(ids[[r, (r + 1) % 500]])
            except CorruptStoreError as exc:
                detected += 1
                assert f"id {ids[r]}" in str(exc) and "data.mdb" in str(exc)
            else:
                wrong += int(not (found.all() and np.array_equal(got[0], rows[r])))
            finally:
                _flip(data_file, offsets, bit)
        assert wrong == 0
        assert detected == len(flips) == value_bytes * 8 + 40 * 8 + CRC_SIZE
        # Restored: every row reads back again, and a flip also stops a scan.
        np.testing.assert_array_equal(b.get(ids)[0], rows)
        offsets = [s + PAYLOAD_OFFSET + 3 for s in _value_offsets(data_file, rows[250])]
        _flip(data_file, offsets, 5)
        with pytest.raises(CorruptStoreError, match=f"id {ids[250]}"):
            list(b.items(batch_rows=64))
        _flip(data_file, offsets, 5)


# --- a damaged page size in the current meta page -------------------------------------------

_OPEN_DAMAGED = """
import sys
import embstore
from embstore.errors import CorruptStoreError
try:
    embstore.open(sys.argv[1]).lookup("t", [0, 1])
except CorruptStoreError as exc:
    print("CorruptStoreError:", exc)
"""


@pytest.mark.parametrize("psize", [8192, 65536, 12288, 0])
def test_a_damaged_page_size_in_the_current_meta_page_is_an_error_not_a_sigbus(tmp_path, psize):
    import embstore

    path = tmp_path / "s"
    spec = embstore.TableSpec("t", dim=DIM)
    with embstore.open(path, tables=[spec], tiers=[embstore.TierSpec("lmdb")]) as store:
        store.update("t", np.arange(200), _rows(200))
        data = next(path.rglob("data.mdb"))
        # LMDB alternates its two meta pages: write until the second one (at 4096) is current,
        # the one LMDB finds at the first one's page size
        for k in range(4):
            head = data.read_bytes()[:8192]
            if int.from_bytes(head[4096 + 144:4096 + 152], "little") > \
                    int.from_bytes(head[144:152], "little"):
                break
            store.update("t", np.arange(3), _rows(3, seed=k))
            store.flush()
    raw = bytearray(data.read_bytes())
    assert int.from_bytes(raw[4096 + 144:4096 + 152], "little") > \
        int.from_bytes(raw[144:152], "little"), "the second meta page never became current"
    assert int.from_bytes(raw[4096 + 40:4096 + 44], "little") == 4096
    raw[4096 + 40:4096 + 44] = psize.to_bytes(4, "little")
    data.write_bytes(bytes(raw))
    # in a child: where the check misses, LMDB reads past the file's end and SIGBUS ends it
    proc = subprocess.run([sys.executable, "-c", _OPEN_DAMAGED, str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "CorruptStoreError:" in proc.stdout and "page" in proc.stdout, proc.stdout


def test_an_emptied_data_file_is_reported_as_damage_to_a_reader(tmp_path):
    with _open(tmp_path) as b:
        b.put(np.arange(5), _rows(5))
    (tmp_path / "data.mdb").write_bytes(b"")
    with pytest.raises(CorruptStoreError, match="is empty"):  # LMDB's own: EBADF, raw
        LMDBBackend.open(BackendSpec(path=tmp_path, dim=DIM, table="t", read_only=True))
