"""The edges of the format, recovery and fsck modules: every refusal says what is wrong.

Each test damages or misuses one thing (an argument of `open`, a manifest entry, a written-id
record, the fsck reader child) and checks the documented error or finding, and that nothing
else changed.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, _crash, _written, fsck, manifest
from embstore.errors import (
    ConfigError,
    CorruptStoreError,
    EmbstoreError,
    ReadOnlyError,
    StoreLockedError,
    StoreNotFoundError,
)
from embstore.manifest import read_manifest, write_manifest

TIERS = [TierSpec("dram", capacity=8), TierSpec("rocksdb")]


def _store(path: Path, *, bounded: bool = True, n: int = 20) -> Path:
    spec = TableSpec("t", dim=2, num_embeddings=100 if bounded else None)
    with embstore.open(path, tables=[spec], tiers=TIERS) as store:
        store.update("t", np.arange(n), np.full((n, 2), 0.5, np.float32))
    return path


def _edit_manifest(path: Path, edit) -> None:
    doc = read_manifest(path)
    doc.pop("checksum", None)
    edit(doc)
    write_manifest(path, doc)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != "LOCK"}


# --- open: bad arguments change nothing -------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    ({"tables": ["t"]}, ConfigError, "list of embstore.TableSpec"),
    ({"tables": [TableSpec("t", dim=2), TableSpec("t", dim=3)]}, ConfigError, "unique"),
    ({"tables": [TableSpec("t", dim=2)], "tiers": []}, ConfigError, "non-empty"),
    ({"tables": [TableSpec("t", dim=2)], "tiers": ["dram"]}, ConfigError, "non-empty"),
])
def test_open_refuses_bad_arguments_before_touching_the_directory(tmp_path, kwargs, error, words):
    target = tmp_path / "new"
    with pytest.raises(error, match=words):
        embstore.open(target, **kwargs)
    assert not target.exists()


def test_an_in_memory_store_needs_tables_and_cannot_be_read_only():
    with pytest.raises(ConfigError, match="cannot be read-only"):
        embstore.open(None, tables=[TableSpec("t", dim=2)], read_only=True)
    with pytest.raises(ConfigError, match="needs tables"):
        embstore.open(None)


def test_open_refuses_a_file_and_a_directory_of_other_files(tmp_path):
    file = tmp_path / "plain"
    file.write_bytes(b"not a store")
    with pytest.raises(StoreNotFoundError, match="is a file"):
        embstore.open(file, tables=[TableSpec("t", dim=2)])
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(StoreNotFoundError, match="not an embstore store"):
        embstore.open(other, tables=[TableSpec("t", dim=2)])
    assert sorted(os.listdir(other)) == ["notes.txt"]


def test_a_read_only_open_cannot_add_tables(tmp_path):
    path = _store(tmp_path / "s")
    before = _snapshot(path)
    with pytest.raises(ReadOnlyError, match="cannot add tables"):
        embstore.open(path, tables=[TableSpec("new", dim=2)], read_only=True)
    assert _snapshot(path) == before
    with embstore.open(path) as store:
        assert store.tables == ["t"]


def test_a_failed_create_in_an_existing_empty_directory_leaves_it_empty(tmp_path, monkeypatch):
    target = tmp_path / "empty"
    target.mkdir()

    def fail(*args, **kwargs):
        raise CorruptStoreError("the medium refused")

    monkeypatch.setattr(embstore._open, "EmbeddingStore", fail)
    with pytest.raises(CorruptStoreError, match="refused"):
        embstore.open(target, tables=[TableSpec("t", dim=2)], tiers=TIERS)
    assert target.is_dir() and os.listdir(target) in ([], ["LOCK"])


# --- manifest: checked, bounded, never followed through a link --------------------------------

def test_fsck_refuses_a_manifest_that_is_a_symbolic_link(tmp_path):
    path = _store(tmp_path / "s")
    real = tmp_path / "elsewhere.json"
    os.replace(path / "MANIFEST.json", real)
    os.symlink(real, path / "MANIFEST.json")
    findings = fsck.check(path)
    assert any("symbolic link" in f.message for f in findings)
    assert fsck.exit_code(findings) == 4
    with pytest.raises(CorruptStoreError, match="symbolic link"):
        embstore.open(path)


def test_fsck_refuses_an_implausibly_large_manifest(tmp_path):
    path = _store(tmp_path / "s")
    with open(path / "MANIFEST.json", "ab") as f:
        f.write(b" " * (fsck._MANIFEST_MAX + 1))
    findings = fsck.check(path)
    assert [f.message for f in findings] == ["the manifest is implausibly large"]
    assert findings[0].found == f"{(path / 'MANIFEST.json').stat().st_size} bytes"


@pytest.mark.parametrize("edit, words", [
    (lambda doc: doc["tables"][0].pop("dim"), "does not describe a store"),
    (lambda doc: doc.__setitem__("tiers", []), "does not describe a store"),
    (lambda doc: doc.__setitem__("tables", []), "does not have"),  # rows left unlisted
    (lambda doc: doc.__setitem__("written_records", "t"), "written_records"),
    (lambda doc: doc["tiers"][1].__setitem__("options", [1]), "options"),
    (lambda doc: doc["tables"].append(dict(doc["tables"][0])), "given twice"),
    (lambda doc: doc["tiers"][0].__setitem__("eviction", "nope"), "unknown policy 'nope'"),
    (lambda doc: doc["tiers"].__setitem__(1, {**doc["tiers"][1], "backend": "tape"}), "tape"),
    (lambda doc: doc.__setitem__("tiers", "dram"), "'tiers'"),
])
def test_fsck_reports_a_manifest_entry_that_is_invalid(tmp_path, edit, words):
    path = _store(tmp_path / "s")
    _edit_manifest(path, edit)
    findings = fsck.check(path)
    assert findings and any(words in f.message for f in findings), findings
    assert fsck.exit_code(findings) in (4, 8)
    with pytest.raises(EmbstoreError):
        embstore.open(path)


def test_fsck_reports_a_tier_directory_that_is_missing_a_link_or_outside(tmp_path):
    path = _store(tmp_path / "s")
    tier = path / "tier1-rocksdb"
    moved = tmp_path / "moved"
    os.replace(tier, moved)
    assert any("is missing" in f.message for f in fsck.check(path))
    os.symlink(moved, tier)
    assert any("symbolic link" in f.message for f in fsck.check(path))
    with pytest.raises(CorruptStoreError, match="symbolic link"):
        embstore.open(path)


def test_a_manifest_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    path = _store(tmp_path / "s")
    os.unlink(path / "MANIFEST.json")
    os.mkfifo(path / "MANIFEST.json")
    with pytest.raises(CorruptStoreError, match="special file|not a regular file"):
        embstore.open(path)


def test_a_manifest_of_another_format_version_names_the_version(tmp_path):
    path = _store(tmp_path / "s")
    doc = read_manifest(path)  # checked, its checksum field taken out
    doc["version"] = 99
    doc["checksum"] = manifest.json_checksum(doc)
    (path / "MANIFEST.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError, match="format version 99"):
        embstore.open(path)
    assert any("format version 99" in f.message for f in fsck.check(path))


def test_a_manifest_without_the_format_field_is_not_a_store(tmp_path):
    path = _store(tmp_path / "s")
    (path / "MANIFEST.json").write_text(json.dumps({"tables": []}))
    with pytest.raises(CorruptStoreError, match="format field"):
        embstore.open(path)


# --- written-id records: every damage named ---------------------------------------------------

def _record(path: Path) -> Path:
    return path / "written" / "t.ids"


def _rewrite_record(file: Path, *, magic=None, kind=None, n=None, body=None) -> None:
    raw = file.read_bytes()
    m, k, _, count = _written.HEADER.unpack_from(raw)
    new_body = raw[_written.HEADER.size:] if body is None else body
    tail = struct.pack("<Q", count if n is None else n) + new_body
    head = struct.pack("<8sII", m if magic is None else magic, k if kind is None else kind,
                       zlib.crc32(tail))
    file.write_bytes(head + tail)


@pytest.mark.parametrize("bounded, damage, words", [
    (True, {"magic": b"NOTMINE!"}, "wrong magic"),
    (True, {"kind": _written.IDS}, "kind 1, expected 0"),
    (True, {"n": 7}, "bitmap of 7 bits"),
    (False, {"kind": _written.BITMAP}, "kind 0, expected 1"),
    (False, {"n": 3}, "3 ids in"),
    (False, {"body": np.array([5, 10**12], "<i8").tobytes(), "n": 2}, None),
])
def test_a_damaged_written_record_is_named_on_open(tmp_path, bounded, damage, words):
    path = _store(tmp_path / "s", bounded=bounded)
    _rewrite_record(_record(path), **damage)
    if words is None:  # a well-formed record of ids the medium lacks: those rows are lost
        with embstore.open(path) as store, pytest.raises(CorruptStoreError, match="t"):
            store.lookup("t", np.array([10**12]))
        return
    with pytest.raises(CorruptStoreError, match=words):
        embstore.open(path)
    findings = fsck.check(path)
    assert any("written-id record" in f.message or words in f.message for f in findings)


@pytest.mark.parametrize("bounded", [True, False])
def test_a_written_record_grown_past_its_header_is_refused_before_it_is_read(tmp_path,
                                                                           bounded):
    # a record blown up to 20 GiB was read whole (and copied twice) before its checksum
    # failed: the process was killed for its memory. A sparse 64 GiB file here costs nothing
    # unless it is read.
    path = _store(tmp_path / "s", bounded=bounded)
    size = _record(path).stat().st_size
    os.truncate(_record(path), 64 << 30)
    body = (64 << 30) - _written.BODY_OFFSET
    with pytest.raises(CorruptStoreError, match=f"(bits|ids) in {body} bytes"):
        embstore.open(path)
    assert any(f"in {body} bytes" in f.message for f in fsck.check(path))
    assert size < 1 << 20


def test_a_bitmap_record_with_ids_outside_the_table_is_refused(tmp_path):
    path = _store(tmp_path / "s")
    with pytest.raises(CorruptStoreError, match="outside"):
        _written.write_record(_record(path), 10, np.array([3, 50]))
    with pytest.raises(CorruptStoreError, match="outside"):
        _written.write_record(_record(path), 10, np.array([-1]))


def test_a_torn_delete_journal_entry_is_ignored_and_earlier_ones_kept(tmp_path):
    path = _store(tmp_path / "s", bounded=False)
    with embstore.open(path) as store:
        store.flush()
        journal = _record(path).with_suffix(".del")
        # a crash between the journal append and the medium's delete: the row is still there,
        # and the journal's complete entry is honoured, its torn successor ignored
        body = np.array([3], "<i8").tobytes()
        good = struct.pack("<II", 1, zlib.crc32(body)) + body
        torn = struct.pack("<II", 2, 0) + body
    journal.write_bytes(good + torn)
    with embstore.open(path) as store:
        rows = store.lookup("t", np.array([3, 4]))
    assert rows[1].tolist() == [0.5, 0.5]
    assert rows[0].tolist() in ([0.5, 0.5], [0.0, 0.0])


# --- the fsck reader child: a crash or hang there is a finding, not a dead fsck ---------------

@pytest.fixture
def fake_reader(tmp_path, monkeypatch):
    """Make fsck's native reader child a script of the test's choosing."""
    def use(body: str, timeout_s: float = 30.0) -> None:
        script = tmp_path / "reader.py"
        script.write_text(f"import os, signal, sys, time\n{body}\n")
        shim = tmp_path / "python-shim"
        shim.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setattr(fsck.sys, "executable", str(shim))
        monkeypatch.setattr(fsck, "CHILD_TIMEOUT_S", timeout_s)
    return use


@pytest.mark.parametrize("body, words", [
    ("os.kill(os.getpid(), signal.SIGSEGV)", "killed by signal 11"),
    ("sys.stderr.write('reader: bad block'); sys.exit(3)", "failed (reader: bad block)"),
    ("print('{not json')", "failed"),
    ("time.sleep(30)", "hung for"),
])
def test_a_reader_child_that_dies_hangs_or_babbles_is_a_finding(tmp_path, fake_reader, body,
                                                                words):
    path = _store(tmp_path / "s")
    fake_reader(body, timeout_s=2.0)
    findings = fsck.check(path)
    assert any(words in f.message and "damaged" in f.message for f in findings), findings
    assert fsck.exit_code(findings) == 4


def test_fsck_never_repairs_a_tier_it_could_not_read(tmp_path, fake_reader):
    path = _store(tmp_path / "s")
    before = _snapshot(path)
    fake_reader("os.kill(os.getpid(), signal.SIGKILL)")
    findings = fsck.check(path, repair=True)
    assert any("not repaired" in f.message for f in findings), findings
    assert _snapshot(path) == before


# --- an open store: checked row by row through its API ----------------------------------------

def test_fsck_of_an_open_store_finds_rows_the_backend_should_never_hold():
    spec = TableSpec("t", dim=2, num_embeddings=10)
    with embstore.open(None, tables=[spec]) as store:
        store.update("t", np.arange(4), np.ones((4, 2), np.float32))
        assert fsck.check(store) == []
        backend = store._table("t").chain.tiers[0].backend
        full = np.zeros((2, backend.spec.dim), np.float32)
        full[1, 0] = np.nan
        backend.put(np.array([42, 2]), full)
        messages = [f.message for f in fsck.check(store)]
    assert any("outside [0, 10)" in m for m in messages), messages
    assert any("NaN or infinity" in m for m in messages), messages


# --- crash points: counted per point, only the one asked for ----------------------------------

def test_a_crash_point_counts_hits_of_its_own_name_only(monkeypatch):
    monkeypatch.setattr(_crash, "_TARGET", ("flush.before_sync", 3))
    monkeypatch.setattr(_crash, "_hits", 0)
    _crash.point("flush.after_sync")
    _crash.point("flush.before_sync")
    _crash.point("flush.before_sync")
    assert _crash._hits == 2  # the third hit would SIGKILL (tests/crash/test_crash_points.py)


@pytest.mark.parametrize("value", ["nowhere:1", "flush.before_sync:0", "flush.before_sync:x"])
def test_a_malformed_crash_point_setting_is_refused(monkeypatch, value):
    monkeypatch.setenv(_crash.ENV, value)
    with pytest.raises(ValueError, match="expected <point>:<n>"):
        _crash._target()


# --- the lock: a second writer is told who holds the store --------------------------------------

def test_a_second_writer_in_this_process_is_told_so(tmp_path):
    path = _store(tmp_path / "s")
    with embstore.open(path), pytest.raises(StoreLockedError, match="this process"):
        embstore.open(path)


def test_a_second_writer_is_told_the_pid_of_the_process_holding_the_store(tmp_path):
    path = _store(tmp_path / "s")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, embstore; s = embstore.open(sys.argv[1]); "
         "print('open', flush=True); sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreLockedError, match=f"process {holder.pid} holds it") as info:
            embstore.open(path)
        assert info.value.holder_pid == holder.pid
    finally:
        holder.communicate("", timeout=60)


def test_a_lock_whose_recorded_writer_is_dead_names_no_pid(tmp_path):
    path = _store(tmp_path / "s")
    fd = os.open(path / "LOCK", os.O_RDWR)
    try:
        os.pwrite(fd, b"999999999", 0)  # no such process
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(StoreLockedError, match="still starting") as info:
            embstore.open(path)
        assert info.value.holder_pid is None
    finally:
        os.close(fd)
    with embstore.open(path) as store:  # released: the store opens, and is whole
        assert store.lookup("t", np.arange(3)).tolist() == [[0.5, 0.5]] * 3


def test_many_files_written_atomically_at_once_are_whole_and_private(tmp_path):
    items = [(tmp_path / f"f{i}", bytes([i]) * (100 + i)) for i in range(20)]  # the threaded path
    manifest.write_atomic_many(items)
    for file, data in items:
        assert file.read_bytes() == data
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("edit", [
    lambda doc: doc["tables"][0].__setitem__("dtype", "zz"),
    lambda doc: doc["tables"].__setitem__(0, None),
    lambda doc: doc["tables"][0]["optimizer"]["config"].__setitem__("lr", "x"),
    lambda doc: doc.__setitem__("tiers", []),
    lambda doc: doc.__setitem__("tables", []),
    lambda doc: doc.__setitem__("tiers", doc["tiers"][::-1]),  # a store of record not there
], ids=["dtype", "null table", "lr string", "no tiers", "no tables", "tiers swapped"])
def test_copies_refuse_a_manifest_that_does_not_describe_the_store(tmp_path, edit):
    """compact, migrate and export refuse by name what fsck reports, and change nothing."""
    from embstore._export import export_store
    from embstore._rebuild import replace_store

    path = _store(tmp_path / "s")
    _edit_manifest(path, edit)
    before = sorted((p, p.stat().st_size) for p in path.rglob("*") if p.is_file())
    assert fsck.check(path)
    for copy in (lambda: replace_store(path), lambda: export_store(path, tmp_path / "ex"),
                 lambda: replace_store(path, default_tiers=[TierSpec("dram")])):
        with pytest.raises(CorruptStoreError):
            copy()
    assert sorted((p, p.stat().st_size) for p in path.rglob("*") if p.is_file()) == before


def test_fsck_reports_written_records_removed_with_their_directory(tmp_path):
    path = _store(tmp_path / "s")
    shutil.rmtree(path / "written")
    findings = fsck.check(path)
    assert any("written-id record is missing" in f.message for f in findings), findings
    assert fsck.exit_code(findings) == 4


_OPEN_AND_FSCK = """
import sys, embstore
from embstore import fsck
from embstore.errors import CorruptStoreError
try:
    embstore.open(sys.argv[1], read_only=sys.argv[2] == "ro").close()
except CorruptStoreError as exc:
    print("refused:", exc)
print("fsck:", fsck.exit_code(fsck.check(sys.argv[1])))
"""


@pytest.mark.parametrize("read_only", ["ro", "rw"])
@pytest.mark.parametrize(("backend", "name"), [("lmdb", "data.mdb"), ("rocksdb", "CURRENT")])
def test_a_named_pipe_in_a_databases_directory_is_refused_not_waited_on(tmp_path, backend,
                                                                         name, read_only):
    # LMDB and RocksDB open their files themselves: the open blocked until a writer came
    path = tmp_path / "s"
    with embstore.open(path, tables=[embstore.TableSpec("t", dim=4)],
                       tiers=[embstore.TierSpec(backend)]) as store:
        store.update("t", np.arange(3), np.ones((3, 4), np.float32))
    file = path / f"tier0-{backend}" / name
    file.unlink()
    os.mkfifo(file)
    proc = subprocess.run([sys.executable, "-c", _OPEN_AND_FSCK, str(path), read_only],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"refused: {file} is a named pipe" in proc.stdout, proc.stdout
    assert "fsck: 4" in proc.stdout
