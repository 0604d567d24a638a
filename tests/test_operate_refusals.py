"""What the operating commands refuse: a rewrite that would delete what is not the store's,
files reached through a link, paths the libraries cannot open, and store files of the wrong kind.

Each refusal is one line with exit status 2 (no traceback, no raw library text) and leaves
the store as it was.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec
from embstore import errors as E
from embstore.manifest import read_manifest, write_manifest
from embstore.tools.cli import main


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "s"
    tiers = [TierSpec("dram", capacity=8), TierSpec("rocksdb")]
    with embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers) as s:
        s.update("t", np.arange(40), np.ones((40, 4), np.float32))
    return path


def _listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _refused(argv, capsys, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "internal error" not in err, err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("command", [["compact"], ["migrate", "--tiers", "lmdb"]])
def test_a_rewrite_refuses_a_store_directory_holding_files_it_did_not_make(store, capsys,
                                                                          command):
    (store / "notes.txt").write_text("mine")
    (store / "backup").mkdir()
    before = _listing(store)
    _refused([command[0], str(store), *command[1:]], capsys, "backup, notes.txt", "move them")
    assert _listing(store) == before
    (store / "notes.txt").unlink()
    (store / "backup").rmdir()
    assert main([command[0], str(store), *command[1:]]) == 0


def test_an_export_into_a_store_directory_is_refused(store, capsys):
    _refused(["export", str(store), str(store / "backup")], capsys, "inside the store")
    assert not (store / "backup").exists()


@pytest.mark.parametrize("command", [["compact"], ["migrate", "--tiers", "lmdb"], ["export"]])
def test_a_rewrite_or_export_never_reads_through_a_linked_tier_directory(store, tmp_path,
                                                                        capsys, command):
    os.rename(store / "tier1-rocksdb", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", store / "tier1-rocksdb")
    argv = [command[0], str(store), *command[1:]]
    if command == ["export"]:
        argv.append(str(tmp_path / "x"))
    _refused(argv, capsys, "symbolic link")
    assert (store / "tier1-rocksdb").is_symlink()
    assert not (tmp_path / "x").exists()


def test_a_path_that_is_not_utf8_is_refused_by_name_before_anything_is_written(store, tmp_path,
                                                                             capsys):
    odd = tmp_path / os.fsdecode(b"s\xff\xfe")
    shutil.copytree(store, odd)
    before = _listing(tmp_path)
    for argv in (["compact", str(odd)], ["migrate", str(odd), "--tiers", "lmdb"]):
        _refused(argv, capsys, "not a valid UTF-8 path")
    with pytest.raises(E.ConfigError, match="UTF-8"):
        embstore.open(odd)
    assert _listing(tmp_path) == before
    with embstore.open(odd, read_only=True) as reader:  # a reader links to UTF-8 names
        np.testing.assert_array_equal(reader.lookup("t", [3]), np.ones((1, 4), np.float32))


@pytest.mark.parametrize(("field", "value"), [
    ("checkpoint", "x"), ("checkpoint", {"kind": "partial", "step": 1}),
    ("restored_from", "x"), ("restored_from", {"step": "5"}), ("gradient_steps", "x"),
    ("gradient_steps", {"t": 1.5}), ("checkpoint_seal", [1]),
])
def test_a_manifest_with_a_field_of_the_wrong_kind_is_corrupt_whatever_reads_it(
        store, capsys, field, value):
    doc = read_manifest(store)
    doc[field] = value
    write_manifest(store, doc)  # its checksum recomputed: only the field is wrong
    with pytest.raises(E.CorruptStoreError, match=field):
        embstore.open(store)
    for argv in (["info", str(store)], ["compact", str(store)],
                 ["export", str(store), str(store.parent / "x")]):
        _refused(argv, capsys, field)


@pytest.mark.parametrize(("field", "value"), [
    ("extras", {"restored_from": "x"}), ("extras", {"checkpoint": 5}), ("step", -5),
    ("step", 10**30),
])
def test_an_export_header_smuggling_a_bad_manifest_field_is_refused(store, tmp_path, capsys,
                                                                   field, value):
    assert main(["export", str(store), str(tmp_path / "x")]) == 0
    header_file = tmp_path / "x" / "header.json"
    header = json.loads(header_file.read_text())
    header[field] = value
    header_file.write_text(json.dumps(header))
    _refused(["import", str(tmp_path / "x"), str(tmp_path / "s2")], capsys, field)
    assert not (tmp_path / "s2").exists()


@pytest.mark.parametrize(("field", "value"), [
    ("closed_at", "yesterday"), ("last_flush", float("nan")), ("last_flush", -1e300),
    ("last_checkpoint", "x"), ("tables", []), ("tables", {"t": "x"}),
    ("tables", {"t": {"rows": -3}}), ("fingerprints", "x"),
])
def test_stats_of_the_wrong_kind_are_set_aside_with_a_note_not_a_crash(store, capsys, field,
                                                                       value):
    stats_file = store / "STATS.json"
    doc = json.loads(stats_file.read_text())
    doc[field] = value
    stats_file.write_text(json.dumps(doc))
    assert main(["info", "--json", str(store)]) == 0
    assert json.loads(capsys.readouterr().out)["tables"]["t"]["rows"] == 40
    assert main(["fsck", str(store)]) == 0
    assert "STATS.json" in capsys.readouterr().out
    assert main(["compact", str(store)]) == 0


def test_a_lock_that_is_a_directory_is_named_not_reported_as_errno(store, tmp_path, capsys):
    (store / "LOCK").unlink()
    (store / "LOCK").mkdir()
    for argv in (["compact", str(store)], ["export", str(store), str(tmp_path / "x")]):
        _refused(argv, capsys, "LOCK is not a plain file")


def test_written_records_replaced_by_a_file_are_named_not_reported_as_errno(store, capsys):
    shutil.rmtree(store / "written")
    (store / "written").write_bytes(b"x")
    for argv in (["info", str(store)], ["compact", str(store)]):
        _refused(argv, capsys, "written is not a directory")
    with pytest.raises(E.CorruptStoreError, match="written is not a directory"):
        embstore.open(store)


def test_info_names_a_cache_tier_by_its_backend_even_where_it_leaves_it_shut(tmp_path,
                                                                             capsys):
    tiers = [TierSpec("dram", capacity=4), TierSpec("lmdb", capacity=100),
             TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=4)], tiers=tiers) as s:
        s.update("t", np.arange(40), np.ones((40, 4), np.float32))
    assert main(["info", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "tier 1 lmdb (100 rows" in out and "not opened" in out
    assert main(["info", "--json", str(tmp_path / "s")]) == 0
    tiers_json = json.loads(capsys.readouterr().out)["tables"]["t"]["tiers"]
    assert [t["backend"] for t in tiers_json] == ["dram", "lmdb", "rocksdb"]
    assert [t["stand_in"] for t in tiers_json] == [False, True, False]
    # the cache's counters of earlier sessions are found under its own backend
    assert tiers_json[1]["cumulative"]["writebacks"] > 0



@pytest.mark.parametrize(("options", "words"), [
    ({"zz": 1}, "unknown rocksdb backend option"), ({"block_cache_bytes": -1}, "block_cache_bytes"),
    ({"sync_writes": "no"}, "sync_writes"), ({"cold_read_threads": 0}, "cold_read_threads"),
    ({"block_cache_bytes": 10**30}, "block_cache_bytes must be an int from"),
    ({"compression": ["none"]}, "compression must be one of"),
])
def test_a_bad_backend_option_in_the_manifest_is_named_by_fsck_and_the_rewrites(
        store, capsys, options, words):
    doc = read_manifest(store)
    doc["tiers"][1]["options"] = options
    write_manifest(store, doc)
    findings = embstore.fsck.check(store)
    assert len(findings) == 1 and words in findings[0].message, findings
    _refused(["compact", str(store)], capsys, words)


@pytest.mark.parametrize(("options", "words"), [
    ({"max_tables": 2**31}, "max_tables must be an int from 2 to"),
    ({"max_readers": 2**31}, "max_readers must be an int from 1 to"),
    ({"sync_commits": "no"}, "sync_commits must be True or False"),
    ({"readahead": "no"}, "readahead must be True or False"),
])
def test_a_bad_lmdb_option_in_the_manifest_is_named_by_fsck_and_open(tmp_path, options, words):
    path = tmp_path / "s"
    tiers = [TierSpec("dram", capacity=8), TierSpec("lmdb")]
    with embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers) as s:
        s.update("t", np.arange(40), np.ones((40, 4), np.float32))
    doc = read_manifest(path)
    doc["tiers"][1]["options"] = options
    write_manifest(path, doc)
    findings = embstore.fsck.check(path)
    assert len(findings) == 1 and words in findings[0].message, findings
    with pytest.raises(E.ConfigError, match=words):
        embstore.open(path)


def test_a_store_made_with_lmdb_flags_as_0_or_1_still_opens_and_rewrites(tmp_path, capsys):
    # bool() of any value turned them on once: stores holding 0 or 1 must still open
    for value in (0, 1):
        path = tmp_path / f"s{value}"
        tiers = [TierSpec("lmdb", options={"sync_commits": value, "readahead": value})]
        with embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers) as s:
            s.update("t", np.arange(4), np.ones((4, 4), np.float32))
        assert main(["compact", str(path)]) == 0
        with embstore.open(path, read_only=True) as reader:
            np.testing.assert_array_equal(reader.lookup("t", [3]), np.ones((1, 4), np.float32))


def test_fsck_names_the_rocksdb_manifest_that_is_missing(store):
    rocks = store / "tier1-rocksdb"
    name = (rocks / "CURRENT").read_text().strip()
    (rocks / name).unlink()
    findings = embstore.fsck.check(store)
    assert any(f"CURRENT names {name}, which is missing" in f.message for f in findings), findings


def test_a_store_made_with_sync_writes_as_0_or_1_still_opens_and_rewrites(tmp_path, capsys):
    # any truthy value turned it on once: such stores must still open, read and compact
    for value in (0, 1):
        path = tmp_path / f"s{value}"
        tiers = [TierSpec("rocksdb", options={"sync_writes": value})]
        with embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers) as s:
            s.update("t", np.arange(4), np.ones((4, 4), np.float32))
        assert main(["compact", str(path)]) == 0
        with embstore.open(path, read_only=True) as reader:
            np.testing.assert_array_equal(reader.lookup("t", [3]), np.ones((1, 4), np.float32))
    with pytest.raises(E.ConfigError, match="sync_writes"):
        embstore.open(tmp_path / "s2", tables=[TableSpec("t", dim=4)],
                      tiers=[TierSpec("rocksdb", options={"sync_writes": 2})])


def test_a_plugin_backend_tier_directory_is_the_store_s_own(store, capsys):
    # a tier directory is tier<level>-<backend>; a plugin's name may hold '-' or '.'
    (store / "tier3-my-kv.v2").mkdir()
    assert main(["compact", str(store)]) == 0


def test_another_tool_s_manifest_above_a_destination_is_no_store(store, tmp_path, capsys):
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "MANIFEST.json").write_text('{"name": "dataset"}')
    assert main(["export", str(store), str(tmp_path / "dataset" / "x")]) == 0


def test_fsck_reports_a_lock_that_is_a_directory_with_or_without_repair(store):
    (store / "LOCK").unlink()
    (store / "LOCK").mkdir()
    for repair in (False, True):
        findings = embstore.fsck.check(store, repair=repair)
        assert len(findings) == 1 and findings[0].fatal, findings
        assert "LOCK is not a plain file" in findings[0].message


def test_a_checkpoint_step_past_int64_is_refused_when_taken(store, tmp_path):
    with embstore.open(store) as s, pytest.raises(E.ConfigError, match="2\\*\\*63"):
        s.checkpoint(tmp_path / "c", step=2**64)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("step", [1500.0, -1])
def test_a_checkpoint_of_an_earlier_version_with_any_numeric_step_still_opens(store, tmp_path,
                                                                             step):
    with embstore.open(store) as s:
        s.checkpoint(tmp_path / "c", step=3)
    doc = read_manifest(tmp_path / "c")
    doc["checkpoint"]["step"] = step  # earlier versions took any step
    write_manifest(tmp_path / "c", doc)
    with embstore.open(tmp_path / "c", read_only=True) as reader:
        assert reader.num_rows("t") == 40


@pytest.mark.parametrize("command", [["compact"], ["migrate", "--tiers", "rocksdb"],
                                     ["export"]])
def test_a_rewrite_or_export_of_a_damaged_lmdb_tree_is_refused_not_killed_by_sigbus(
        tmp_path, command):
    # LMDB trusts its page numbers and node offsets: read through its map, a damaged tree
    # killed these commands with SIGBUS (exit 135), leaving a half-made copy beside the
    # store. Run in a child, so that a crash fails this test instead of ending pytest.
    import subprocess
    import sys

    path = tmp_path / "s"
    with embstore.open(path, tables=[TableSpec("t", dim=8)], tiers=[TierSpec("lmdb")]) as s:
        s.update("t", np.arange(2_000), np.ones((2_000, 8), np.float32))
    data = next(path.rglob("data.mdb"))
    raw = bytearray(data.read_bytes())

    def leaf_nodes(page):  # nodes on a leaf page, 0 on any other
        if int.from_bytes(raw[page * 4096 + 10:page * 4096 + 12], "little") != 2:
            return 0
        return (int.from_bytes(raw[page * 4096 + 12:page * 4096 + 14], "little") - 16) // 2

    # a full leaf page near the end: node offsets of 65,535 there point past the file's end
    page = max((p for p in range(2, len(raw) // 4096) if p * 4096 + 0xFFFF >= len(raw)),
               key=leaf_nodes)
    assert leaf_nodes(page) > 8
    at = page * 4096 + 16 + 2 * (leaf_nodes(page) // 2)
    raw[at:at + 8] = b"\xff" * 8
    data.write_bytes(bytes(raw))
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    argv = [command[0], str(path), *command[1:]]
    if command == ["export"]:
        argv.append(str(tmp_path / "out"))
    done = subprocess.run([sys.executable, "-m", "embstore.tools.cli", *argv],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, (done.returncode, done.stderr[-500:])
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "is damaged" in done.stderr and "embstore fsck" in done.stderr, done.stderr
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no half-made copy


def test_the_lmdb_walk_starts_from_the_meta_page_lmdb_uses_even_with_a_harmless_fault(
        tmp_path):
    # a pad byte set in the newest meta page does not stop LMDB from using it; the walk
    # skipped it for the older meta page, found that older tree sound, and LMDB then read
    # the damaged newer one: SIGBUS again
    import subprocess
    import sys

    from embstore._fileinfo import lmdb_metas

    path = tmp_path / "s"
    with embstore.open(path, tables=[TableSpec("t", dim=8)], tiers=[TierSpec("lmdb")]) as s:
        for k in range(3):  # several transactions: the two meta pages hold different trees
            s.update("t", np.arange(2_000), np.full((2_000, 8), k, np.float32))
    data = next(path.rglob("data.mdb"))
    raw = bytearray(data.read_bytes())
    newest = max(lmdb_metas(data, len(raw)), key=lambda m: m.txnid)
    raw[newest.page * 4096 + 8] = 1  # the page header's pad: LMDB never reads it
    data.write_bytes(bytes(raw))
    before = data.read_bytes()
    done = subprocess.run([sys.executable, "-m", "embstore.tools.cli", "compact", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, (done.returncode, done.stderr[-500:])
    assert "is damaged" in done.stderr and f"meta page {newest.page}" in done.stderr
    assert data.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
