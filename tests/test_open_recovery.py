"""Opening after damage or an interrupted creation: the crash-point setting, leftovers of a
creation cut short, and manifests that pass their checksum but describe no store.
"""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import _crash
from embstore import errors as E
from embstore.errors import CorruptStoreError, StoreNotFoundError
from embstore.manifest import write_manifest
from embstore.spec import TableSpec, TierSpec


@pytest.mark.parametrize("value", ["nope:1", "flush.before_sync:0", "flush.before_sync",
                                   "flush.before_sync:x"])
def test_a_bad_crash_point_setting_is_refused(monkeypatch, value):
    monkeypatch.setenv(_crash.ENV, value)
    with pytest.raises(ValueError, match="expected <point>:<n>"):
        _crash._target()


def test_a_crash_point_setting_names_a_point_and_a_hit(monkeypatch):
    monkeypatch.setenv(_crash.ENV, "checkpoint.page:3")
    assert _crash._target() == ("checkpoint.page", 3)
    monkeypatch.delenv(_crash.ENV)
    assert _crash._target() is None
    _crash.point("checkpoint.page")  # unset in this process: nothing happens


def test_the_leftovers_of_an_interrupted_creation_are_replaced(tmp_path):
    path = tmp_path / "s"
    for d in ("tier0-lmdb", "written", "cache"):
        (path / d).mkdir(parents=True)
    (path / "tier0-lmdb" / "data.mdb").write_bytes(b"half")
    (path / "MANIFEST.json.tmp").write_text("{")
    spec = embstore.TableSpec("t", dim=2)
    with embstore.open(path, tables=[spec], tiers=[embstore.TierSpec("lmdb")]) as store:
        store.update("t", [1], np.ones((1, 2), np.float32))
    with embstore.open(path) as store:
        assert store.lookup("t", [1]).tolist() == [[1.0, 1.0]]


def _files(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != "LOCK"}


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "flushed-then-killed"])
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
def test_a_store_in_use_whose_manifest_is_gone_is_damage_not_a_creation_cut_short(
        tmp_path, closed, bounded):
    # a creation cut short leaves no counters of a close and no written id: its leftovers
    # are replaced. A store with either lost its manifest: opening it with tables= once
    # deleted every row and made a new store in its place.
    path = tmp_path / "s"
    spec = TableSpec("t", dim=2, num_embeddings=100 if bounded else None)
    tiers = [TierSpec("dram", capacity=2), TierSpec("rocksdb")]
    store = embstore.open(path, tables=[spec], tiers=tiers)
    store.update("t", np.arange(10), np.ones((10, 2), np.float32))
    store.flush()
    if closed:
        store.close()
    (path / "MANIFEST.json").unlink()
    if not closed:  # as a killed process leaves it: no STATS.json, only the written record
        assert not (path / "STATS.json").exists()
    before = _files(path)
    for how in ({"tables": [spec], "tiers": tiers}, {}, {"read_only": True}):
        with pytest.raises(CorruptStoreError, match="in use .* no MANIFEST.json"):
            embstore.open(path, **how)
    assert _files(path) == before
    if not closed:
        store.close()


def test_a_directory_with_foreign_files_is_not_taken_over(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "notes.txt").write_text("mine")
    with pytest.raises(StoreNotFoundError, match="not an embstore store"):
        embstore.open(tmp_path / "s", tables=[embstore.TableSpec("t", dim=2)])
    assert (tmp_path / "s" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("body", [{"tiers": [{"backend": 5}], "tables": []},
                                  {"tiers": [{"backend": "lmdb"}], "tables": [{"dim": 2}]},
                                  {"tiers": [], "tables": [{"name": "t", "dim": "x"}]}])
def test_a_manifest_with_a_good_checksum_and_bad_fields_is_corrupt(tmp_path, body):
    path = tmp_path / "s"
    with embstore.open(path, tables=[embstore.TableSpec("t", dim=2)]):
        pass
    write_manifest(path, body)
    with pytest.raises(CorruptStoreError, match="does not describe a store"):
        embstore.open(path)


def test_a_damaged_manifest_is_reported_as_failing_its_checksum(tmp_path):
    path = tmp_path / "s"
    with embstore.open(path, tables=[embstore.TableSpec("t", dim=2)]):
        pass
    text = (path / "MANIFEST.json").read_text()
    (path / "MANIFEST.json").write_text(text.replace('"dim": 2', '"dim": 3'))
    with pytest.raises(CorruptStoreError, match="fails its checksum"):
        embstore.open(path)


@pytest.mark.parametrize("raw", [b'{"format": "embstore", "version": ' + b"9" * 5000 + b"}",
                                 b"[" * 100_000])
def test_a_manifest_json_cannot_hold_is_reported_as_damaged(tmp_path, raw):
    path = tmp_path / "s"
    with embstore.open(path, tables=[embstore.TableSpec("t", dim=2)]):
        pass
    (path / "MANIFEST.json").write_bytes(raw)  # a number json will not parse, nesting too deep
    with pytest.raises(CorruptStoreError, match="MANIFEST.json"):
        embstore.open(path)


@pytest.mark.parametrize("tiers", [None, [TierSpec("dram", capacity=8), TierSpec("rocksdb")]])
def test_a_create_whose_manifest_cannot_be_written_leaves_nothing_and_no_lock(
        tmp_path, monkeypatch, tiers):
    path = tmp_path / "s"

    def disk_full(*args, **kwargs):
        raise E.StorageIOError("writing the manifest: No space left on device")

    monkeypatch.setattr(embstore._open, "write_manifest", disk_full)
    with pytest.raises(E.StorageIOError, match="No space left"):
        embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers)
    assert not path.exists()
    monkeypatch.undo()
    with embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers) as store:
        store.update("t", np.arange(2), np.ones((2, 4), dtype=np.float32))
    with embstore.open(path) as store:
        assert store.lookup("t", np.arange(2)).sum() == 8
