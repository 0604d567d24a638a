"""fsck finds damage the store would otherwise only meet on a read, and nothing in a healthy
store; `--repair` writes a repaired copy, keeps the old store, and the next fsck is clean.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, fsck
from embstore.errors import CorruptStoreError
from embstore.tools.cli import main

PERSISTENT = ["rocksdb", "lmdb", "pmem"]


def _store(path, bottom, n=100, cache=10):
    tiers = [TierSpec("dram", capacity=cache), TierSpec(bottom)]
    tables = [TableSpec("t", dim=4, num_embeddings=1000), TableSpec("u", dim=2)]
    with embstore.open(path, tables=tables, tiers=tiers) as store:
        store.update("t", np.arange(n), np.full((n, 4), 1.25, np.float32))
        store.update("u", np.arange(n), np.ones((n, 2), np.float32))
    return path


def _live_value_offset(path, bottom, row_id=50, tier=None):
    """Offset in the table file of the stored bytes of `row_id`'s row in table t."""
    if bottom == "pmem":
        from embstore.backends.pmem import DATA_OFFSET, REC_ID, record_size
        file = path / "tier1-pmem" / "t.pmem"
        raw = file.read_bytes()
        rec = record_size(16)
        ids = np.frombuffer(raw, dtype="<i8", offset=DATA_OFFSET)  # every 8 bytes
        for slot in range((len(raw) - DATA_OFFSET) // rec):
            at = DATA_OFFSET + slot * rec
            if ids[(at - DATA_OFFSET + REC_ID) // 8] == row_id and raw[at + 16:at + 24] != bytes(8):
                return file, at + 24
        raise AssertionError("row not found")
    import lmdb
    file = path / (tier or "tier1-lmdb") / "data.mdb"
    env = lmdb.open(str(file.parent), readonly=True, lock=False, max_dbs=64)
    key = np.array([(1 << 63) | row_id], dtype=">u8").tobytes()
    with env.begin(db=env.open_db(b"t:t", create=False)) as txn:
        value = txn.get(key)
    env.close()
    raw = file.read_bytes()
    hits = [i for i in range(len(raw)) if raw.startswith(key + value, i)]
    # copy-on-write leaves old copies in free pages: flip each, keep the one a read sees
    for at in hits:
        flipped = bytearray(raw)
        flipped[at + 8 + 6] ^= 1
        file.write_bytes(bytes(flipped))
        try:
            env = lmdb.open(str(file.parent), readonly=True, lock=False, max_dbs=64)
            with env.begin(db=env.open_db(b"t:t", create=False)) as txn:
                seen = txn.get(key)
            env.close()
        finally:
            file.write_bytes(raw)
        if seen != value:
            return file, at + 8  # the value's first byte
    raise AssertionError("live copy not found")


def _flip(file, offset, mask=0x01):
    with open(file, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ mask]))


# one workload per backend in the README's suite, two more in the slow job
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("bottom", ["dram", *PERSISTENT])
def test_a_healthy_store_after_a_random_workload_is_clean(tmp_path, bottom, seed):
    rng = np.random.default_rng(seed)
    middle = [TierSpec("pmem", capacity=int(rng.integers(5, 50)))] if seed == 1 else []
    tiers = [TierSpec("dram", capacity=int(rng.integers(1, 40))), *middle, TierSpec(bottom)]
    tables = [TableSpec("t", dim=4, num_embeddings=500),
              TableSpec("a", dim=3, optimizer=embstore.optim.Adam(lr=0.1))]
    for session in range(2):  # a reopen between sessions
        with embstore.open(tmp_path / "s", tables=tables, tiers=tiers) as store:
            for _ in range(int(rng.integers(5, 30))):
                table = str(rng.choice(["t", "a"]))
                dim = 4 if table == "t" else 3
                ids = rng.integers(0, 500, int(rng.integers(1, 60)))
                op = rng.integers(0, 4)
                if op == 0:
                    store.update(table, ids, rng.standard_normal((len(ids), dim))
                                 .astype(np.float32))
                elif op == 1:
                    store.delete(table, ids[: len(ids) // 2])
                elif op == 2:
                    store.lookup(table, ids)
                else:
                    store.apply_gradients(table, ids, rng.standard_normal((len(ids), dim))
                                          .astype(np.float32))
            if session == 1 and bottom != "dram":
                store.checkpoint(tmp_path / "ckpt", step=3)
            assert fsck.check(store) == []
    assert fsck.check(tmp_path / "s") == []
    assert main(["fsck", str(tmp_path / "s")]) == 0
    if bottom != "dram":
        assert fsck.check(tmp_path / "ckpt") == []


def test_fsck_of_an_open_store_reports_where_its_scan_stopped(tmp_path):
    # an open store is checked through its API: a damaged row stops the scan, named
    path = _store(tmp_path / "s", "lmdb", cache=1000)
    file, at = _live_value_offset(path, "lmdb")
    _flip(file, at + 6)
    with embstore.open(path, read_only=True) as store:
        (stopped,) = fsck.check(store)
    assert stopped.table == "t" and stopped.message.startswith("scan stopped after ")
    assert "checksum" in stopped.message


@pytest.mark.parametrize("bottom", ["lmdb", "pmem"])
def test_a_damaged_row_is_found_repaired_and_the_next_fsck_is_clean(tmp_path, bottom, capsys):
    path = _store(tmp_path / "s", bottom)
    file, at = _live_value_offset(path, bottom)
    _flip(file, at + 6)
    findings = fsck.check(path)
    assert findings and findings[0].table == "t" and "checksum" in findings[0].message
    assert findings[0].id == 50 and findings[0].file == str(file)
    assert main(["fsck", str(path)]) == 4
    assert "checksum" in capsys.readouterr().out
    assert main(["fsck", "--repair", "--json", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 1
    dropped = [f for f in report["findings"] if f.get("ids")]
    assert dropped and dropped[0]["ids"] == [50]
    assert main(["fsck", str(path)]) == 0
    with embstore.open(path, read_only=True) as store:
        assert store.num_rows("t") == 99 and store.num_rows("u") == 100
        assert (store.lookup("t", np.array([49, 51])) == 1.25).all()
        assert (store.lookup("t", np.array([50])) == 0).all()  # back to its initial value
    backups = [p for p in tmp_path.iterdir() if ".fsck-backup-" in p.name]
    assert len(backups) == 1 and (backups[0] / "MANIFEST.json").exists()


def test_repair_keeps_every_row_of_a_dram_table_beside_a_damaged_one(tmp_path):
    path = tmp_path / "s"
    tables = [TableSpec("t", dim=4, num_embeddings=1000),
              TableSpec("d", dim=2, tiers=(TierSpec("dram"),))]
    with embstore.open(path, tables=tables, tiers=[TierSpec("lmdb")]) as store:
        store.update("t", np.arange(100), np.full((100, 4), 1.25, np.float32))
        store.update("d", np.arange(10), np.full((10, 2), 3.0, np.float32))
    file, at = _live_value_offset(path, "lmdb", tier="tier0-lmdb")
    _flip(file, at + 6)
    assert fsck.exit_code(fsck.check(path, repair=True)) == 1
    with embstore.open(path, read_only=True) as store:
        assert store.num_rows("t") == 99 and store.num_rows("d") == 10
        assert (store.lookup("d", np.arange(10)) == 3.0).all()


def test_a_damaged_lmdb_key_is_found_and_named_with_the_id_it_belongs_to(tmp_path):
    path = _store(tmp_path / "s", "lmdb")
    file, at = _live_value_offset(path, "lmdb")
    _flip(file, at - 1, 0x40)  # the key's low byte: the row now sits under id 50 ^ 0x40
    findings = fsck.check(path)
    assert any(f.id == 50 ^ 0x40 and "row of id 50" in f.message for f in findings), findings
    assert fsck.exit_code(fsck.check(path, repair=True)) == 1
    assert fsck.check(path) == []
    with embstore.open(path, read_only=True) as store:  # put back under its own id
        assert store.num_rows("t") == 100 and (store.lookup("t", np.array([50])) == 1.25).all()


def _rocksdb_store_with_a_damaged_block(path, n=3000, damaged_id=1500):
    spec = TableSpec("t", dim=4, num_embeddings=10_000)
    with embstore.open(path, tables=[spec], tiers=[TierSpec("rocksdb")]) as store:
        store.update("t", np.arange(n), np.repeat(np.arange(n, dtype=np.float32)[:, None], 4, 1))
    sst = max((path / "tier0-rocksdb").glob("*.sst"), key=lambda p: p.stat().st_size)
    at = sst.read_bytes().find(np.full(4, damaged_id, np.float32).tobytes())
    assert at > 0
    _flip(sst, at + 2)  # a value of one data block in the middle of the table
    return spec


@pytest.mark.parametrize("record", [True, False], ids=["record", "no-record"])
def test_repair_of_a_damaged_rocksdb_block_lists_exactly_the_ids_it_lost(tmp_path, record):
    path, n = tmp_path / "s", 3000
    spec = _rocksdb_store_with_a_damaged_block(path, n)
    if not record:
        (path / "written" / "t.ids").unlink()
    findings = fsck.check(path, repair=True)
    assert fsck.exit_code(findings) == 1
    (dropped,) = [f for f in findings if f.message.startswith("dropped")]
    with embstore.open(path, read_only=True) as store:
        ids = np.arange(n)
        stored = np.concatenate([page[0] for page in store.items("t")])
        lost = np.setdiff1d(ids, stored)
        assert 0 < len(lost) < n / 10 and 1500 in lost  # one block's rows
        if record:
            assert dropped.ids == tuple(lost.tolist())
            assert dropped.message.startswith(f"dropped {len(lost)} row(s)")
        else:
            assert dropped.ids == () and "an unknown number more" in dropped.message
        # kept rows are intact; lost ones read as never written, as after any repair
        kept = ids[~np.isin(ids, lost)]
        np.testing.assert_array_equal(store.lookup("t", kept)[:, 0], kept.astype(np.float32))
        np.testing.assert_array_equal(store.lookup("t", lost),
                                      spec.init(lost, 4, np.dtype(np.float32)))
    assert fsck.check(path) == []


def test_a_damaged_rocksdb_block_is_found_and_repair_leaves_a_clean_store(tmp_path):
    path = _store(tmp_path / "s", "rocksdb")
    sst = sorted((path / "tier1-rocksdb").glob("*.sst"))
    raw = sst[0].read_bytes()
    at = raw.find(np.full(4, 1.25, np.float32).tobytes())
    assert at > 0
    _flip(sst[0], at + 2)
    findings = fsck.check(path)
    assert any("checksum" in f.message for f in findings)
    assert fsck.exit_code(fsck.check(path, repair=True)) == 1
    assert fsck.check(path) == []


def test_a_damaged_rocksdb_log_record_is_found(tmp_path):
    path = tmp_path / "s"
    # a writer that flushes and dies without closing: its rows are in the write-ahead log only
    code = (f"import numpy as np, os, embstore\n"
            f"s = embstore.open({str(path)!r}, tables=[embstore.TableSpec('t', dim=4)], "
            f"tiers=[embstore.TierSpec('rocksdb')])\n"
            f"s.update('t', np.arange(100), np.full((100, 4), 1.25, np.float32))\n"
            f"s.flush()\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert fsck.check(path) == []
    (log,) = [p for p in (path / "tier0-rocksdb").glob("*.log") if p.stat().st_size > 100]
    _flip(log, log.read_bytes().find(np.full(4, 1.25, np.float32).tobytes()) + 1)
    findings = fsck.check(path)
    assert any("log record" in f.message for f in findings), findings
    assert fsck.exit_code(findings) == 4


@pytest.mark.parametrize("bottom", ["pmem", "lmdb", "rocksdb-sst", "rocksdb-manifest"])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_a_file_cut_at_a_record_boundary_plus_minus_one_is_found(tmp_path, bottom, delta):
    path = _store(tmp_path / "s", bottom.split("-")[0], n=20)
    if bottom == "pmem":
        from embstore.backends.pmem import DATA_OFFSET, record_size
        file = path / "tier1-pmem" / "t.pmem"
        cut = DATA_OFFSET + 10 * record_size(16) + delta
    elif bottom == "rocksdb-sst":
        file = max((path / "tier1-rocksdb").glob("*.sst"), key=lambda p: p.stat().st_size)
        cut = file.stat().st_size // 2 + delta
    elif bottom == "rocksdb-manifest":
        from embstore._fsck_native import check_log
        file = next((path / "tier1-rocksdb").glob("MANIFEST-*"))
        assert check_log(file, allow_torn_tail=False) == []
        cut = _last_log_record(file) + delta  # drop the last version edit
    else:
        file = path / "tier1-lmdb" / "data.mdb"
        cut = file.stat().st_size - 4096 + delta
    os.truncate(file, cut)
    findings = fsck.check(path)
    if bottom == "rocksdb-manifest" and delta == 0 and not findings:
        # a MANIFEST cut at a record boundary is a valid, older MANIFEST: fine if every row
        # is still there (the edit dropped named no file)
        with embstore.open(path, read_only=True) as store:
            assert store.num_rows("t") == 20
            assert (store.lookup("t", np.arange(20)) == 1.25).all()
        return
    assert findings and not any(f.fatal for f in findings)
    assert fsck.exit_code(findings) == 4


def test_a_pmem_file_grown_past_the_slots_it_can_hold_is_found_without_reading_it(
        tmp_path, monkeypatch):
    from embstore import _fsck_pmem

    path = _store(tmp_path / "s", "pmem", n=20)
    os.truncate(path / "tier1-pmem" / "t.pmem", 1 << 40)  # sparse: the open refuses it
    read_at = _fsck_pmem.read_at

    def bounded(fd: int, offset: int, size: int) -> bytes:
        assert offset + size < 1 << 30, "fsck reads the terabyte of zeros"
        return read_at(fd, offset, size)

    monkeypatch.setattr(_fsck_pmem, "read_at", bounded)
    findings = fsck.check(path)
    assert any("more than the 2147483647 slots" in f.message for f in findings), findings
    assert fsck.exit_code(findings) == 4

def _last_log_record(file):
    """Offset of the last record of a RocksDB log file (records: crc, length u16, type)."""
    raw = file.read_bytes()
    pos, last = 0, 0
    while pos + 7 <= len(raw):
        length = int.from_bytes(raw[pos + 4:pos + 6], "little")
        if raw[pos + 6] == 0:
            break
        last, pos = pos, pos + 7 + length
    return last


def test_a_missing_store_cannot_be_checked(tmp_path, capsys):
    (finding,) = fsck.check(tmp_path / "none")
    assert finding.table is None and "cannot open" in finding.message and finding.fatal
    assert main(["fsck", str(tmp_path / "none")]) == 8


def test_beside_a_writer_fsck_checks_with_a_note_and_repair_is_refused(tmp_path, capsys):
    path = _store(tmp_path / "s", "lmdb")
    with embstore.open(path):
        assert main(["fsck", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"note: (store): process {os.getpid()} held the store open for writing" in out
        assert main(["fsck", "--repair", str(path)]) == 8
        assert "holds it for writing" in capsys.readouterr().out


@pytest.mark.parametrize(("stats", "why"), [(b"{not json", "is not JSON"),
                                             (b'{"format": "other"}', "is not an embstore")])
def test_an_unreadable_stats_file_is_a_note_and_no_repair(tmp_path, capsys, stats, why):
    # STATS.json is history (counters, the row counts of the last close), not data: its loss
    # is told, never counted as a problem, and a repair has nothing to do
    path = _store(tmp_path / "s", "rocksdb")
    (path / "STATS.json").write_bytes(stats)
    (note,) = fsck.check(path)
    assert note.note and note.table is None and why in note.message
    assert note.file == str(path / "STATS.json")
    assert main(["fsck", str(path)]) == 0
    assert f"STATS.json {why}" in capsys.readouterr().out
    assert main(["fsck", "--repair", str(path)]) == 0
    assert (path / "STATS.json").read_bytes() == stats  # nothing rewritten
    with embstore.open(path):
        pass
    assert fsck.check(path) == []  # the next close wrote it anew


def test_a_named_pipe_in_place_of_the_stats_file_is_a_note_not_a_hang(tmp_path):
    # the open of STATS.json blocked until a writer came to the pipe: every open, info and
    # fsck of the store hung for ever
    import threading

    path = _store(tmp_path / "s", "pmem", n=5)
    stats = path / "STATS.json"
    stats.unlink()
    os.mkfifo(stats)
    stop, let_go = threading.Event(), []

    def writer() -> None:  # lets a blocked reader go on, so the old code fails, not hangs
        while not stop.wait(5):
            try:
                os.close(os.open(stats, os.O_WRONLY | os.O_NONBLOCK))
                let_go.append(True)
            except OSError:  # ENXIO: nobody waits on it; ENOENT: replaced by a file
                pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        (note,) = fsck.check(path)
        assert note.note and "is not a regular file" in note.message
        with embstore.open(path) as store:
            assert (store.lookup("t", np.arange(5)) == 1.25).all()
    finally:
        stop.set()
        thread.join()
    assert not let_go
    assert fsck.check(path) == []  # the close wrote it anew

@pytest.mark.parametrize("how", ["outside", "missing", "symlink", "garbage", "version"])
def test_a_manifest_pointing_outside_at_a_missing_file_or_at_a_symlink_is_refused(tmp_path,
                                                                                 how):
    path = _store(tmp_path / "s", "pmem", n=5)
    manifest = path / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    if how == "outside":
        doc["tables"][0]["name"] = "../../etc/passwd"
        manifest.write_text(json.dumps(doc))
    elif how == "missing":
        (path / "tier1-pmem" / "t.pmem").unlink()
    elif how == "symlink":
        real = tmp_path / "elsewhere.pmem"
        os.replace(path / "tier1-pmem" / "t.pmem", real)
        os.symlink(real, path / "tier1-pmem" / "t.pmem")
    elif how == "garbage":
        manifest.write_bytes(b"\x00{not json")
    else:
        doc["version"] = 99
        manifest.write_text(json.dumps(doc))
    findings = fsck.check(path)
    assert findings and fsck.exit_code(findings) == 4
    if how == "symlink":
        assert "symbolic link" in findings[0].message
    # repair never follows such a manifest: the problems stay
    assert fsck.exit_code(fsck.check(path, repair=True)) == 4


def test_a_clean_cached_copy_that_disagrees_with_the_store_of_record_is_found(tmp_path):
    path = tmp_path / "s"
    tiers = [TierSpec("pmem", capacity=64), TierSpec("lmdb")]
    with embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers) as store:
        store.update("t", np.arange(20), np.full((20, 4), 1.25, np.float32))
        store.lookup("t", np.arange(20))
    assert fsck.check(path) == []
    # rewrite the cached copy of id 3 through the backend: valid checksums, other values
    from embstore.backend import BackendSpec
    from embstore.backends.pmem import PmemBackend
    with PmemBackend.open(BackendSpec(path=path / "cache" / "tier0-pmem", dim=4,
                                      table="t")) as cache:
        assert cache.contains(np.array([3]))[0]
        cache.put(np.array([3]), np.full((1, 4), 9.0, np.float32))
    findings = fsck.check(path)
    assert [f.id for f in findings] == [3] and "disagrees" in findings[0].message
    assert fsck.exit_code(fsck.check(path, repair=True)) == 1
    assert fsck.check(path) == []


def test_a_damaged_pmem_cache_is_found_and_repaired_as_the_open_reads_it(tmp_path, capsys):
    path = tmp_path / "s"
    tiers = [TierSpec("pmem", capacity=64), TierSpec("rocksdb")]
    with embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers) as store:
        store.update("t", np.arange(20), np.full((20, 4), 1.25, np.float32))
        store.lookup("t", np.arange(20))
    from embstore.backends.pmem import DATA_OFFSET, record_size
    file = path / "cache" / "tier0-pmem" / "t.pmem"
    _flip(file, DATA_OFFSET + 3 * record_size(16) + 24)  # a value byte of slot 3's record
    with pytest.raises(CorruptStoreError):
        embstore.open(path).close()
    assert main(["fsck", "--json", str(path)]) == 4
    report = json.loads(capsys.readouterr().out)
    cache = [f for f in report["findings"] if "pmem cache" in f["message"]]
    assert len(cache) == 1 and "closed cleanly" in cache[0]["message"]
    assert main(["fsck", "--repair", str(path)]) == 1
    capsys.readouterr()
    assert main(["fsck", str(path)]) == 0
    with embstore.open(path) as store:
        assert (store.lookup("t", np.arange(20)) == 1.25).all()


def test_repair_keeps_the_rows_before_a_damaged_rocksdb_log_record(tmp_path):
    path = tmp_path / "s"
    code = (f"import numpy as np, os, embstore\n"
            f"s = embstore.open({str(path)!r}, tables=[embstore.TableSpec('t', dim=4)], "
            f"tiers=[embstore.TierSpec('rocksdb')])\n"
            f"for i in range(4):\n"
            f"    s.update('t', np.arange(i * 25, i * 25 + 25), np.full((25, 4), 1.25 + i, "
            f"np.float32))\n"
            f"    s.flush()\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    (log,) = [p for p in (path / "tier0-rocksdb").glob("*.log") if p.stat().st_size > 100]
    _flip(log, log.read_bytes().find(np.full(4, 3.25, np.float32).tobytes()) + 1)
    assert fsck.exit_code(fsck.check(path, repair=True)) == 1
    assert fsck.check(path) == []
    with embstore.open(path, read_only=True) as store:
        assert store.num_rows("t") == 50  # the two batches before the damaged record
        assert (store.lookup("t", np.arange(25, 50)) == 2.25).all()


def test_repair_refuses_to_rewrite_a_table_it_could_not_read(tmp_path):
    path = _store(tmp_path / "s", "rocksdb", n=20)
    current = path / "tier1-rocksdb" / "CURRENT"
    current.write_text("MANIFEST-999999\n")
    findings = fsck.check(path, repair=True)
    assert fsck.exit_code(findings) == 4 and not any(f.repaired for f in findings)
    assert (path / "tier1-rocksdb" / "CURRENT").read_text() == "MANIFEST-999999\n"


@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb", "pmem"])
@pytest.mark.parametrize("field,value", [("dim", 5), ("num_embeddings", 10)])
def test_repair_refuses_to_drop_every_row_of_a_table(tmp_path, bottom, field, value):
    """A manifest that no longer describes a table fails every row: not a repair's to drop."""
    from embstore.manifest import read_manifest, write_manifest

    path = _store(tmp_path / "s", bottom, n=20)
    doc = read_manifest(path)
    doc.pop("checksum", None)
    doc["tables"][0][field] = value  # table "t" holds rows of dim 4 under ids 0..19
    write_manifest(path, doc)
    findings = fsck.check(path, repair=True)
    if field == "dim":
        assert any("every row of table(s) ['t']" in f.message for f in findings), findings
        assert not any(f.repaired for f in findings)
        assert fsck.exit_code(findings) == 4
    else:  # ids 0..9 pass: the repair goes ahead and drops 10..19, as it reports
        assert fsck.exit_code(findings) == 1, findings


def test_a_manifest_record_rocksdb_would_hang_on_is_found_and_not_repaired(tmp_path,
                                                                           monkeypatch):
    # were the scanner to hang, it would be stopped well before the suite's timeout
    monkeypatch.setattr(fsck, "CHILD_TIMEOUT_S", 60)
    path = _store(tmp_path / "s", "rocksdb", n=20)
    tier = path / "tier1-rocksdb"
    manifest = tier / (tier / "CURRENT").read_text().strip()
    with manifest.open("ab") as f:  # a complete header of a recycled log's record
        f.write(bytes([7, 7, 7, 7, 20, 0, 7]) + bytes(20))
    before = manifest.read_bytes()
    findings = fsck.check(path, repair=True)
    assert any("type 7" in f.message and "cannot open" in f.message for f in findings), findings
    assert fsck.exit_code(findings) == 4 and not any(f.repaired for f in findings)
    assert manifest.read_bytes() == before


def test_an_lmdb_map_size_below_one_is_refused_not_doubled_forever():
    from embstore._fileinfo import lmdb_map_size_ok

    assert not lmdb_map_size_ok(1 << 20, {"map_size_bytes": 0})
    assert not lmdb_map_size_ok(1 << 20, {"map_size_bytes": -4096})
    assert lmdb_map_size_ok(1 << 21, {"map_size_bytes": 1 << 20})


def test_a_missing_written_id_record_is_reported_and_a_repair_writes_one_keeping_a_backup(
        tmp_path):
    """Without the record lost rows cannot be told from new ones: fsck says so; a repair,
    asked for, writes a record of the rows there (as rebuild_written_records would).
    """
    import shutil

    path = _store(tmp_path / "s", "lmdb", n=20)
    shutil.rmtree(path / "written")
    findings = fsck.check(path)
    assert any("cannot be told from rows never written" in f.message for f in findings)
    assert fsck.exit_code(findings) == 4
    assert fsck.exit_code(fsck.check(path, repair=True)) == 1
    assert list(tmp_path.glob(".s.fsck-backup-*"))
    assert fsck.check(path) == []


@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb", "pmem"])
def test_repair_drops_every_row_a_medium_lost_and_lists_them(tmp_path, bottom):
    """Rows gone from the medium are no failed checks: a repair drops them, however many."""
    from embstore import registry
    from embstore.backend import BackendSpec

    path = _store(tmp_path / "s", bottom, n=20)
    where = path / f"tier1-{bottom}"
    with registry.load_backend(bottom).open(BackendSpec(path=where, dim=4, table="t")) as m:
        m.delete(np.arange(20))
    findings = fsck.check(path, repair=True)
    assert fsck.exit_code(findings) == 1, findings
    with embstore.open(path) as store:
        assert store.num_rows("t") == 0 and store.lost_rows("t").tolist() == []
        assert store.num_rows("u") == 20


@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb", "pmem"])
def test_a_store_of_record_admitting_always_keeps_its_record_through_a_copy(tmp_path, bottom):
    from embstore._rebuild import replace_store

    path = tmp_path / "s"
    tiers = [TierSpec("dram", capacity=4), TierSpec(bottom, admission="always")]
    with embstore.open(path, tables=[TableSpec("t", dim=2)], tiers=tiers) as store:
        store.update("t", np.arange(10), np.ones((10, 2), np.float32))
    replace_store(path)
    with embstore.open(path) as store:  # the record is there, and holds the rows
        assert store.num_rows("t") == 10 and store.lost_rows("t").tolist() == []


def test_a_path_that_does_not_exist_is_told_from_one_that_is_a_file(tmp_path):
    # both said "is not a directory", which sends the reader looking for a file
    (tmp_path / "file").write_text("x")
    [missing] = fsck.check(tmp_path / "nothing")
    [file] = fsck.check(tmp_path / "file")
    assert "does not exist" in missing.message and "is not a directory" in file.message


def test_the_lmdb_walk_finds_a_sound_file_clean_and_names_a_node_past_its_page(tmp_path):
    from embstore._fileinfo import lmdb_metas
    from embstore._lmdb_walk import walk

    path = tmp_path / "s"
    with embstore.open(path, tables=[TableSpec("t", dim=8)], tiers=[TierSpec("lmdb")]) as s:
        for k in range(3):  # freed pages on the free list too
            s.update("t", np.arange(2_000), np.full((2_000, 8), k, np.float32))
    data = next(path.rglob("data.mdb"))
    newest = max(lmdb_metas(data, data.stat().st_size), key=lambda m: m.txnid)
    assert walk(data, newest) == []
    sound = data.read_bytes()
    leaves = [p for p in range(2, newest.last_page + 1)
              if int.from_bytes(sound[p * 4096 + 10:p * 4096 + 12], "little") == 2]
    found = {}
    for leaf in leaves:  # some leaves are free pages, outside every tree: their damage is moot
        raw = bytearray(sound)
        raw[leaf * 4096 + 16:leaf * 4096 + 18] = b"\xff\xff"
        data.write_bytes(bytes(raw))
        found[leaf] = [p for _, p in walk(data, newest)]
    named = [leaf for leaf, problems in found.items()
             if any(f"page {leaf}: node 0 at offset 65535 lies outside" in p for p in problems)]
    assert len(named) >= 20, found  # 2,000 rows of 8 floats fill a few dozen leaves
    assert all(problems == [] for leaf, problems in found.items() if leaf not in named)


def _store_with_an_unreachable_state(path, bottom, bad_ids=(7,)):
    """A store whose rows `bad_ids` hold a negative row-wise Adagrad sum, as no step leaves.

    The rows are written under the optimizer (straight into the backend), with valid
    checksums: only a check of the state itself can tell.
    """
    spec = TableSpec("t", dim=4, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))
    tiers = [TierSpec(bottom)] if bottom == "dram" else [TierSpec("dram", capacity=4),
                                                        TierSpec(bottom)]
    store = embstore.open(path, tables=[spec], tiers=tiers)
    store.apply_gradients("t", np.arange(100), np.ones((100, 4), np.float32))
    store.flush()
    backend = store._table("t").chain.tiers[-1].backend
    rows = np.zeros((len(bad_ids), backend.spec.dim), np.float32)
    rows[:, :4], rows[:, 4] = 0.5, -5.0
    backend.put(np.array(bad_ids), rows)
    return store


def test_fsck_of_an_open_store_finds_a_state_no_step_reaches(tmp_path):
    with _store_with_an_unreachable_state(None, "dram") as store:
        (finding,) = fsck.check(store)
    assert finding.id == 7 and "never reaches" in finding.message, finding


@pytest.mark.parametrize("bottom", PERSISTENT)
def test_a_state_no_step_reaches_is_found_on_disk_and_repair_drops_its_row(tmp_path, bottom):
    path = tmp_path / "s"
    _store_with_an_unreachable_state(path, bottom).close()
    findings = fsck.check(path)
    assert [f.id for f in findings] == [7] and "never reaches" in findings[0].message, findings
    assert fsck.exit_code(findings) == 4
    assert main(["fsck", "--repair", str(path)]) == 1
    assert fsck.check(path) == []
    with embstore.open(path, read_only=True) as store:
        assert store.num_rows("t") == 99
        assert (store.lookup("t", np.array([7])) == 0).all()  # back to its initial value


@pytest.mark.parametrize("bottom", PERSISTENT)
def test_states_no_step_reaches_past_the_detailed_ones_are_summed_up(tmp_path, bottom):
    path = tmp_path / "s"
    _store_with_an_unreachable_state(path, bottom, bad_ids=tuple(range(50, 80))).close()
    findings = fsck.check(path)
    assert sorted(f.id for f in findings if f.id is not None) == list(range(50, 70))
    (summed,) = [f for f in findings if f.id is None]
    assert "10 more" in summed.message and "state" in summed.message, summed


_KILLED_REPAIR = """
import sys
from embstore import _rebuild
from embstore.tools.cli import main
if sys.argv[2] == "renames":  # a file system without renameat2(RENAME_EXCHANGE)
    _rebuild._exchange = lambda root, new: False
main(["fsck", "--repair", sys.argv[1]])
"""


@pytest.mark.parametrize("swap", ["exchange", "renames"])
@pytest.mark.parametrize("then", ["fsck", "compact", "open", "compact, its pid reused"])
def test_a_repair_killed_after_its_swap_keeps_its_backup_and_lists_what_it_dropped(
        tmp_path, swap, then, capsys):
    path = _store(tmp_path / "s", "pmem")
    file, at = _live_value_offset(path, "pmem")
    _flip(file, at + 6)
    damaged = file.read_bytes()
    env = {**os.environ, "EMBSTORE_CRASH_AT": "rebuild.after_swap:1"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_REPAIR, str(path), swap], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    if then == "compact, its pid reused":  # a live process now has the repair's pid
        marker = tmp_path / ".s.keep-old"
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "pid": os.getpid()}))
    if then.startswith("compact"):  # a rewrite first: it must not delete the only copy of 50
        assert main(["compact", "--quiet", str(path)]) == 0
        capsys.readouterr()
    if then == "open":
        embstore.open(path).close()
    # the killed repair never said what it dropped: every check says so until a repair has,
    # whether the backup still lies under a temporary name or was kept by what came first
    for _ in range(2):
        before = sorted(p.name for p in tmp_path.iterdir())
        assert main(["fsck", "--json", str(path)]) == 4  # a check alone changes nothing
        report = json.loads(capsys.readouterr().out)
        said = [f["message"] for f in report["findings"]
                if f["message"].startswith("a repair was killed")]
        assert len(said) == 1 and "fsck --repair" in said[0], said
        assert ("lies at" if then == "fsck" else "is kept at") in said[0]
        assert [f["ids"] for f in report["findings"] if f.get("ids")] == [[50]]
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert main(["fsck", "--json", "--repair", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [f["ids"] for f in report["findings"] if f.get("ids")] == [[50]]
    backups = [p for p in tmp_path.iterdir() if ".fsck-backup-" in p.name]
    assert len(backups) == 1
    assert any(str(backups[0]) in f["message"] for f in report["findings"])
    # the store as it was, damaged row 50 included
    assert (backups[0] / file.relative_to(path)).read_bytes() == damaged
    assert sorted(p.name for p in tmp_path.iterdir()
                  if ".rebuild-" in p.name or ".swap-old" in p.name or ".keep-old" in p.name
                  or ".killed-repairs" in p.name) == []
    assert main(["fsck", str(path)]) == 0


def test_a_store_rewritten_during_its_check_is_no_damage_but_a_check_to_run_again(tmp_path):
    path = _store(tmp_path / "s", "rocksdb")
    import shutil

    from embstore import _rebuild
    migrated = tmp_path / "m"
    shutil.copytree(path, migrated)
    assert main(["migrate", "--quiet", str(migrated), "--tiers", "dram:16,lmdb"]) == 0

    def swap(part):  # a migrate beside the check swaps its new directory in, as it does
        if part.startswith("tier"):
            assert _rebuild._exchange(path, migrated)

    findings = fsck.check(path, progress=swap)
    assert len(findings) == 1 and "rewritten" in findings[0].message, findings
    assert "run fsck again" in findings[0].message and fsck.exit_code(findings) == 8
    assert fsck.check(path) == []


def test_the_row_dump_of_a_killed_repair_is_removed_by_the_next_repair(tmp_path):
    path = _store(tmp_path / "s", "pmem")
    file, at = _live_value_offset(path, "pmem")
    _flip(file, at + 6)
    env = {**os.environ, "EMBSTORE_CRASH_AT": "rebuild.page:1"}
    proc = subprocess.run([sys.executable, "-m", "embstore.tools.cli", "fsck", "--repair",
                           str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [p for p in tmp_path.iterdir() if ".fsck-rows-" in p.name]
    live = tmp_path / f".s.fsck-rows-{os.getpid()}-abcdefgh"  # a repair still running
    live.mkdir()
    assert main(["fsck", "--repair", str(path)]) == 1
    assert [p for p in tmp_path.iterdir() if ".fsck-rows-" in p.name] == [live]


def test_a_huge_process_id_in_a_leftovers_name_is_no_live_process(tmp_path):
    # os.kill overflowed on it: a raw OverflowError out of every build beside such a name
    from embstore._private_dir import remove_dead_leftovers
    from embstore.layout import process_alive

    assert process_alive(os.getpid()) and not process_alive(0)
    assert not process_alive(10**20)
    odd = tmp_path / f".out.tmp-{10**20}-abcdefabcdef"
    odd.mkdir()
    assert remove_dead_leftovers(tmp_path / "out") == [odd] and not odd.exists()


def test_a_path_that_is_not_a_store_directory_is_named_for_what_it_is(tmp_path):
    from embstore.errors import StoreNotFoundError
    from embstore.layout import require_directory

    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    require_directory(tmp_path / "d", links=False)
    require_directory(tmp_path / "link", links=True)
    for name, links, said in [("link", False, "symbolic link (to "), ("nope", True, "not exist"),
                              ("broken", True, "broken symbolic link"), ("f", True, "a file")]:
        with pytest.raises(StoreNotFoundError, match=re.escape(said)):
            require_directory(tmp_path / name, links=links)


def _marker(root, **fields):
    from embstore._kept import keep_marker

    st = os.lstat(root)
    doc = {"ino": st.st_ino, "dev": st.st_dev, "keep": ".s.fsck-backup-1", "pid": 2**22 + 1,
           "dropped": [], **fields}
    keep_marker(root).write_text(json.dumps(doc))
    return keep_marker(root)


def test_a_keep_marker_is_left_or_dropped_as_what_it_names_allows(tmp_path, monkeypatch):
    from embstore import _kept

    root, old = tmp_path / "s", tmp_path / ".s.rebuild-1-1"
    root.mkdir()
    old.mkdir()
    marker = _marker(root, keep="a/b")  # not a name beside the store: not ours, left alone
    assert _kept.recover_kept(root) is None and marker.exists()
    _marker(root, pid=os.getpid())  # a live process's: its own to finish, unless locked
    assert _kept.recover_kept(root) is None and marker.exists()
    _marker(root)  # its swap never happened (the store is the marked directory): dropped
    assert _kept.recover_kept(root) is None and not marker.exists()
    assert _kept.recover_kept(root) is None  # no marker
    _marker(old)  # the marker of a store whose path is now empty: recover_swap's to mend
    assert _kept.recover_kept(old.parent / "gone") is None
    # the marked old store, already under its backup name: found there, nothing to move
    marker = _marker(old)
    marker.rename(_kept.keep_marker(root))
    kept = tmp_path / ".s.fsck-backup-1"
    old.rename(kept)
    doc = _kept.recover_kept(root, move=False)
    assert doc is not None and doc["at"] == doc["kept"] == str(kept)
    assert _kept.recover_kept(root)["kept"] == str(kept) and kept.is_dir()
    # another process keeps it between the look and the rename
    kept.rename(old)
    _marker(old).rename(_kept.keep_marker(root))

    def taken(src, dst):
        raise FileNotFoundError(src)

    monkeypatch.setattr(_kept.os, "replace", taken)
    assert _kept.recover_kept(root) is None and old.is_dir()


def test_a_killed_repairs_report_skips_dropped_entries_it_cannot_read(tmp_path):
    from embstore._kept import keep_marker

    root, old = tmp_path / "s", tmp_path / ".s.rebuild-1-1"
    root.mkdir()
    old.mkdir()
    dropped = [{"table": "t", "message": "row 5 damaged", "ids": [5]}, {"table": "t"},
               {"table": "t", "message": "m", "ids": ["x"]}]
    _marker(old, dropped=dropped).rename(keep_marker(root))
    found = fsck._kept_by_a_killed_repair(root, False)
    assert [f.ids for f in found] == [(), (5,)] and str(old) in found[0].message
    assert old.is_dir() and keep_marker(root).exists()  # a check moved nothing


def test_a_note_of_killed_repairs_is_reported_once_each_and_a_damaged_one_is_named(tmp_path,
                                                                                   capsys):
    from embstore import _kept

    path = _store(tmp_path / "s", "lmdb")
    kept = tmp_path / ".s.fsck-backup-1"
    kept.mkdir()
    doc = {"ino": 1, "dev": 2, "keep": kept.name, "pid": 3, "kept": str(kept),
           "dropped": [{"table": "t", "message": "row 7 damaged", "ids": [7]}]}
    _kept._add_killed_repair(path, doc)
    _kept._add_killed_repair(path, doc)  # a marker whose removal a power cut lost, kept again
    findings = fsck.check(path)
    assert [f.ids for f in findings if f.ids] == [(7,)]
    assert fsck.exit_code(findings) == 4
    _kept.killed_repairs_note(path).write_text("[{]")
    assert main(["fsck", str(path)]) == 8
    out = capsys.readouterr().out
    assert "killed-repairs cannot be read" in out and "move it aside" in out
    assert "Traceback" not in out
    _kept.killed_repairs_note(path).write_text('[{"kept": 5}]')
    assert main(["fsck", "--repair", str(path)]) == 8
    assert "not a list of killed repairs" in capsys.readouterr().out
    _kept.killed_repairs_note(path).unlink()
    assert main(["fsck", str(path)]) == 0


def test_a_damaged_note_of_killed_repairs_is_left_and_the_marker_keeps_saying_it(tmp_path):
    from embstore import _kept

    root, old, kept = tmp_path / "r", tmp_path / ".r.rebuild-1-1", tmp_path / ".r.fsck-backup-1"
    root.mkdir()
    old.mkdir()
    _marker(old, keep=kept.name).rename(_kept.keep_marker(root))
    _kept.killed_repairs_note(root).write_text("[{]")
    assert _kept.recover_kept(root)["kept"] == str(kept) and kept.is_dir()
    assert _kept.keep_marker(root).exists()  # the damaged note was not overwritten
    assert _kept.killed_repairs_note(root).read_text() == "[{]"
    _kept.killed_repairs_note(root).unlink()  # as the check's finding says to
    assert _kept.recover_kept(root)["kept"] == str(kept)
    assert not _kept.keep_marker(root).exists()
    assert [d["kept"] for d in _kept.killed_repairs(root)] == [str(kept)]


def test_the_old_store_a_swap_left_parked_is_named_as_such_and_the_new_one_still_checked(
        tmp_path, capsys):
    import shutil

    path = _store(tmp_path / "s", "pmem")
    parked = tmp_path / ".s.swap-old"
    shutil.copytree(path, parked)  # a swap by two renames killed after its second
    file, at = _live_value_offset(path, "pmem")
    _flip(file, at + 6)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["fsck", "--json", str(path)]) == 4
    messages = [f["message"] for f in json.loads(capsys.readouterr().out)["findings"]]
    assert any("right after its swap" in m and "removes it" in m for m in messages), messages
    assert not any("puts it back" in m for m in messages)
    assert len(messages) > 1  # the store at the path was checked too: its damaged row
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert main(["fsck", "--json", "--repair", str(path)]) == 1
    capsys.readouterr()
    assert not parked.exists()
    assert main(["fsck", str(path)]) == 0
