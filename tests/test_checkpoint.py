"""Checkpoints: full ones open as stores, chains of incrementals restore to the same tables,
copies are consistent while other threads read and write, and a crash mid-checkpoint leaves
the earlier ones intact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec
from embstore import errors as E

OPT = embstore.optim.RowWiseAdagrad(lr=0.1)
TIERS = [TierSpec("dram", capacity=20, eviction="lru"), TierSpec("lmdb")]


def _spec(name: str = "t") -> TableSpec:
    return TableSpec(name, dim=4, init=embstore.init.Uniform(seed=1), optimizer=OPT)


def _contents(store: embstore.EmbeddingStore) -> dict[str, dict[int, bytes]]:
    out: dict[str, dict[int, bytes]] = {}
    for name in store.tables:
        rows = {}
        for ids, weights, state in store.items(name):
            for i, w, s in zip(ids.tolist(), weights, state, strict=True):
                rows[i] = w.tobytes() + s.tobytes()
        out[name] = rows
    return out


def _train(store: embstore.EmbeddingStore, seed: int, n: int = 200) -> dict[str, set[int]]:
    """A few steps on every table; returns the ids each table's calls changed."""
    rng = np.random.default_rng(seed)
    touched = {}
    for name in store.tables:
        ids = rng.integers(0, 300, n)
        store.apply_gradients(name, ids, rng.standard_normal((n, 4)).astype(np.float32))
        dead = rng.integers(0, 300, 10)
        store.delete(name, dead)
        touched[name] = set(ids.tolist()) | set(dead.tolist())
    return touched


def _increment(path, name: str) -> tuple[set[int], set[int]]:
    """The ids an incremental checkpoint stores rows for, and its tombstones, of one table."""
    from embstore.checkpoint import _bottom_backend, _read_tombstones
    from embstore.layout import read_manifest

    doc = read_manifest(path)
    spec = next(TableSpec.from_json(t) for t in doc["tables"] if t["name"] == name)
    tiers = tuple(TierSpec.from_json(t) for t in doc["tiers"])
    with _bottom_backend(path, spec, tiers, read_only=True) as delta:
        stored = set(delta.ids().tolist())
    return stored, set(_read_tombstones(path / f"{name}.deleted").tolist())


def test_full_checkpoint_opens_as_a_store_with_weights_state_and_step(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec("a"), _spec("b")], tiers=TIERS) as store:
        _train(store, 0)
        expected = _contents(store)
        store.checkpoint(tmp_path / "ck", step=1234)
        _train(store, 1)  # later training does not leak into the checkpoint
    doc = json.loads((tmp_path / "ck" / "MANIFEST.json").read_text())
    assert doc["checkpoint"] == {"step": 1234, "kind": "full", "parent": None}
    with embstore.open(tmp_path / "ck", read_only=True) as ck:
        assert _contents(ck) == expected
        assert ck.table_spec("a") == _spec("a")


def test_a_chain_of_incrementals_restores_to_the_full_checkpoint(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec("a"), _spec("b")], tiers=TIERS) as store:
        _train(store, 0)
        store.checkpoint(tmp_path / "c0", step=0)
        changed = {}
        for k in range(1, 4):
            changed[k] = _train(store, k)
            store.checkpoint(tmp_path / f"c{k}", step=k, incremental=True)
        store.checkpoint(tmp_path / "full3", step=3)
        live = _contents(store)
    # the increments hold only what changed: a row or a tombstone per changed id, no other
    for k in (1, 2, 3):
        for name in ("a", "b"):
            stored, dead = _increment(tmp_path / f"c{k}", name)
            assert not stored & dead
            assert stored | dead == changed[k][name]
            assert len(stored) < 300
    with embstore.open(tmp_path / "full3", read_only=True) as full:
        assert _contents(full) == live
    sizes = [json.loads((tmp_path / f"c{k}" / "MANIFEST.json").read_text())["checkpoint"]
             for k in (1, 2, 3)]
    assert [s["kind"] for s in sizes] == ["incremental"] * 3
    embstore.restore(tmp_path / "c3", tmp_path / "restored")
    with embstore.open(tmp_path / "restored") as restored:
        assert _contents(restored) == live
    embstore.restore(tmp_path / "c1", tmp_path / "restored1")  # a middle link restores too
    with embstore.open(tmp_path / "restored1") as r1:
        assert _contents(r1) != live


def test_incremental_checkpoint_rows_are_only_the_changed_ones(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        store.update("t", np.arange(1000), np.ones((1000, 4), np.float32))
        store.checkpoint(tmp_path / "c0")
        store.update("t", [5, 6], np.zeros((2, 4), np.float32))
        store.delete("t", [7])
        store.checkpoint(tmp_path / "c1", incremental=True)
    from embstore.checkpoint import _read_tombstones

    assert _read_tombstones(tmp_path / "c1" / "t.deleted").tolist() == [7]
    with pytest.raises(E.ConfigError, match="incremental checkpoint"):
        embstore.open(tmp_path / "c1")


def test_checkpoint_errors_change_nothing(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        with pytest.raises(E.ConfigError, match="full checkpoint first"):
            store.checkpoint(tmp_path / "c", incremental=True)
        assert not (tmp_path / "c").exists()
        store.checkpoint(tmp_path / "c")
        with pytest.raises(E.StoreExistsError):
            store.checkpoint(tmp_path / "c")
    with pytest.raises(E.StoreExistsError):
        embstore.restore(tmp_path / "c", tmp_path / "s")


def test_damaged_or_orphaned_increments_fail_restore(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        store.checkpoint(tmp_path / "c0")
        store.delete("t", [1])
        store.update("t", [2], np.ones((1, 4), np.float32))
        store.checkpoint(tmp_path / "c1", incremental=True)
    tomb = tmp_path / "c1" / "t.deleted"
    good = tomb.read_bytes()
    tomb.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(E.CorruptStoreError, match="tombstone"):
        embstore.restore(tmp_path / "c1", tmp_path / "r")
    tomb.write_bytes(good)
    os.rename(tmp_path / "c0", tmp_path / "moved")
    with pytest.raises(E.CorruptStoreError, match="parent"):
        embstore.restore(tmp_path / "c1", tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_lookups_and_writes_go_on_during_a_checkpoint_which_stays_consistent(tmp_path):
    import embstore.checkpoint as ck_mod

    n = 5 * ck_mod.BATCH_ROWS // 4  # two batches
    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        store.update("t", np.arange(n), np.ones((n, 4), np.float32))
        before = _contents(store)
        late = np.array([n - 1, n + 5])  # one row not yet copied, one new id
        done = []

        def other_thread() -> None:
            store.lookup("t", np.arange(100))
            store.update("t", late, np.full((2, 4), 7, np.float32))
            done.append(True)

        def progress(table: str, copied: int, total: int) -> None:
            if copied < total:  # between the two batches
                worker = threading.Thread(target=other_thread)
                worker.start()
                worker.join(timeout=30)
                assert done, "another thread could not use the store during the checkpoint"

        store.checkpoint(tmp_path / "ck", progress=progress)
        assert done
        np.testing.assert_array_equal(store.lookup("t", late), np.full((2, 4), 7, np.float32))
    with embstore.open(tmp_path / "ck", read_only=True) as ck:
        assert _contents(ck) == before  # the checkpoint is the table as the call began


CHILD = """
import sys, time, numpy as np, embstore
store = embstore.open(sys.argv[1])
def progress(table, copied, total):
    print("copying", flush=True)
    time.sleep(60)
store.checkpoint(sys.argv[2], progress=progress)
"""


@pytest.mark.crash
def test_a_checkpoint_killed_midway_leaves_the_previous_one_intact(tmp_path):
    import embstore.checkpoint as ck_mod

    n = 2 * ck_mod.BATCH_ROWS
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=[TierSpec("rocksdb")]) as store:
        store.update("t", np.arange(n), np.ones((n, 4), np.float32))
        store.checkpoint(tmp_path / "c0")
        store.update("t", np.arange(10), np.zeros((10, 4), np.float32))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "s"),
                             str(tmp_path / "c1")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "copying"
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.stdout.close()
    assert not (tmp_path / "c1").exists()
    with embstore.open(tmp_path / "c0", read_only=True) as c0:
        np.testing.assert_array_equal(c0.lookup("t", np.arange(10)), np.ones((10, 4), np.float32))
        assert c0.num_rows("t") == n
    with embstore.open(tmp_path / "s") as store:  # the store itself reopens after the kill
        np.testing.assert_array_equal(store.lookup("t", [0]), np.zeros((1, 4), np.float32))
        store.checkpoint(tmp_path / "c1")  # and a new checkpoint under the same name works


def test_bad_destinations_and_steps_are_refused_and_leave_nothing(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        before = sorted(p.name for p in tmp_path.iterdir())
        for step in (-1, True, 1.5, "3", np.timedelta64(5)):
            with pytest.raises(E.ConfigError, match="step"):
                store.checkpoint(tmp_path / "c", step=step)
        for dest in (None, 5, ""):
            with pytest.raises(E.ConfigError, match="path"):
                store.checkpoint(dest)
        with pytest.raises(E.ConfigError, match="progress"):
            store.checkpoint(tmp_path / "c", progress=5)
        with pytest.raises(E.ConfigError, match="inside the store"):
            store.checkpoint(tmp_path / "s" / "ck")
        with pytest.raises(E.StorageIOError, match="is not a directory"):
            store.checkpoint(tmp_path / "file" / "a" / "ck")
        with pytest.raises(E.ConfigError, match="NUL byte"):
            store.checkpoint(f"{tmp_path}/c\0k")
        with pytest.raises(E.StorageIOError, match="too long"):
            store.checkpoint(tmp_path / ("x" * 300))
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
            "LOCK", "MANIFEST.json", "tier0-dram", "written"]
        store.checkpoint(tmp_path / "c", step=np.int64(3))
    with pytest.raises(E.ConfigError, match="inside the store or checkpoint"):
        embstore.restore(tmp_path / "c", tmp_path / "c" / "r")
    with pytest.raises(E.StorageIOError, match="is not a directory"):
        embstore.restore(tmp_path / "c", tmp_path / "file" / "r")
    with pytest.raises(E.ConfigError, match="path"):
        embstore.restore(None, tmp_path / "r")
    with pytest.raises(E.ConfigError, match="NUL byte"):
        embstore.restore(tmp_path / "c", f"{tmp_path}/r\0")
    for src, dest in ((tmp_path / "c", tmp_path / ("y" * 300)),
                      (tmp_path / ("z" * 300), tmp_path / "r")):
        with pytest.raises(E.StorageIOError, match="too long"):
            embstore.restore(src, dest)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "MANIFEST.json", "tier0-dram", "written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "file", "s"]


def test_missing_or_truncated_tombstones_are_corrupt_not_raw_errors(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        store.checkpoint(tmp_path / "c0")
        store.delete("t", [1, 2])
        store.checkpoint(tmp_path / "c1", incremental=True)
    tomb = tmp_path / "c1" / "t.deleted"
    good = tomb.read_bytes()
    tomb.write_bytes(good[:-3])
    with pytest.raises(E.CorruptStoreError, match="truncated"):
        embstore.restore(tmp_path / "c1", tmp_path / "r")
    tomb.unlink()
    with pytest.raises(E.CorruptStoreError, match="missing"):
        embstore.restore(tmp_path / "c1", tmp_path / "r")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("put", ["link", "pipe"])
@pytest.mark.parametrize("file", ["tier0-pmem/t.pmem", "written/t.ids"])
def test_a_link_or_pipe_in_place_of_a_base_file_is_damage_named_in_the_checkpoint(
        tmp_path, put, file):
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=[TierSpec("pmem")]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        store.checkpoint(tmp_path / "c0")
    target = tmp_path / "c0" / file
    target.unlink()
    if put == "link":
        target.symlink_to(tmp_path / "nowhere")
    else:
        os.mkfifo(target)  # followed, a copy would block on it
    with pytest.raises(E.CorruptStoreError, match=f"cannot copy {target}"):
        embstore.restore(tmp_path / "c0", tmp_path / "r")
    assert not (tmp_path / "r").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0", "s"]

def test_restore_refuses_lost_rows_swapped_files_and_parents_put_in_place(tmp_path):
    import shutil

    tiers = [TierSpec("dram", capacity=8, eviction="lru"), TierSpec("pmem")]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", np.arange(50), np.ones((50, 4), np.float32))
        store.checkpoint(tmp_path / "c0")
        for k in (1, 2, 3):
            store.update("t", [k], np.full((1, 4), k, np.float32))
            store.delete("t", [10 + k])
            store.checkpoint(tmp_path / f"c{k}", incremental=True)
        store.checkpoint(tmp_path / "later")
    with embstore.open(tmp_path / "other", tables=[_spec()]) as other:
        other.checkpoint(tmp_path / "foreign")

    def refused(match: str) -> None:
        with pytest.raises(E.CorruptStoreError, match=match):
            embstore.restore(tmp_path / "c3", tmp_path / "r")
        assert not (tmp_path / "r").exists()

    # the base's rows gone: they were restored as never written
    rows = tmp_path / "c0" / "tier1-pmem" / "t.pmem"
    rows.rename(tmp_path / "aside")
    refused("does not hold what the checkpoint stored")
    (tmp_path / "aside").rename(rows)
    # an increment's tombstones swapped with another's
    a, b = tmp_path / "c1" / "t.deleted", tmp_path / "c2" / "t.deleted"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    refused("does not hold what the checkpoint stored")
    a.write_bytes(da)
    # an increment's rows swapped with another's
    ra, rb = tmp_path / "c2" / "tier1-pmem" / "t.pmem", tmp_path / "c3" / "tier1-pmem" / "t.pmem"
    xa, xb = ra.read_bytes(), rb.read_bytes()
    ra.write_bytes(xb)
    refused("does not hold what the checkpoint stored")
    ra.write_bytes(xa)
    # another checkpoint in a parent's place: a sibling, a later full one, another store's
    for name, stand_in in (("c2", "c1"), ("c0", "later"), ("c0", "foreign")):
        (tmp_path / name).rename(tmp_path / "aside")
        shutil.copytree(tmp_path / stand_in, tmp_path / name)
        refused("is not the checkpoint it was taken after")
        shutil.rmtree(tmp_path / name)
        (tmp_path / "aside").rename(tmp_path / name)
    embstore.restore(tmp_path / "c3", tmp_path / "r")
    with embstore.open(tmp_path / "r", read_only=True) as r, \
            embstore.open(tmp_path / "later", read_only=True) as later:
        assert _contents(r) == _contents(later)


def test_a_read_only_handle_checkpoints_a_store_that_holds_still(tmp_path):
    import embstore.checkpoint as ck_mod

    path = tmp_path / "s"
    with embstore.open(path, tables=[_spec()], tiers=[TierSpec("pmem")]) as store:
        store.update("t", np.arange(300), np.ones((300, 4), np.float32))
    blocked = []

    def progress(table: str, copied: int, total: int) -> None:
        if not blocked:  # a writer that opens mid-copy would tear the copy
            try:
                with embstore.open(path) as writer:
                    writer.update("t", np.arange(300), np.zeros((300, 4), np.float32))
                    writer.delete("t", np.arange(0, 300, 2))
                blocked.append(False)
            except E.StoreLockedError:
                blocked.append(True)

    with embstore.open(path, read_only=True) as reader:
        before = _contents(reader)
        old = ck_mod.BATCH_ROWS
        ck_mod.BATCH_ROWS = 64
        try:
            reader.checkpoint(tmp_path / "ck", progress=progress)
        finally:
            ck_mod.BATCH_ROWS = old
    assert blocked == [True]
    with embstore.open(tmp_path / "ck", read_only=True) as ck:
        assert _contents(ck) == before
    with embstore.open(path) as writer:  # the lock went with the checkpoint
        writer.update("t", [0], np.zeros((1, 4), np.float32))
        with embstore.open(path, read_only=True) as reader, \
                pytest.raises(E.StoreLockedError):
            reader.checkpoint(tmp_path / "ck2")
    assert not (tmp_path / "ck2").exists()


def test_a_read_only_checkpoint_that_fails_to_begin_lets_writers_in_again(tmp_path,
                                                                         monkeypatch):
    path = tmp_path / "s"
    with embstore.open(path, tables=[_spec()], tiers=[TierSpec("pmem")]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
    with embstore.open(path, read_only=True) as reader:
        def failing_flush() -> None:
            raise E.StorageIOError(5, "the medium failed")

        monkeypatch.setattr(reader, "flush", failing_flush)
        with pytest.raises(E.StorageIOError, match="the medium failed"):
            reader.checkpoint(tmp_path / "ck")
        with embstore.open(path) as writer:  # the reader's lock went with the failure
            writer.update("t", [0], np.zeros((1, 4), np.float32))
    assert not (tmp_path / "ck").exists()


# the last tier's eviction is feature expiry: rows leave the table without a delete call
EXPIRING = {
    "lru-bottom": [TierSpec("dram", capacity=8, eviction="lru"),
                   TierSpec("rocksdb", capacity=40, eviction="lru")],
    "bounded-middle-lfu-bottom": [TierSpec("dram", capacity=8, eviction="lru"),
                                  TierSpec("pmem", capacity=20, eviction="clock"),
                                  TierSpec("rocksdb", capacity=50, eviction="lfu")],
    "ttl-bottom": [TierSpec("dram", capacity=6, eviction="s3fifo"),
                   TierSpec("lmdb", eviction="ttl", eviction_options={"ttl": 6})],
}


def _table_of(store: embstore.EmbeddingStore, ids: np.ndarray) -> tuple[bytes, bytes, int]:
    """Weights and optimizer state of `ids` as lookups read them, and the stored row count."""
    return (store.lookup("t", ids).tobytes(), store.lookup_state("t", ids).tobytes(),
            store.num_rows("t"))


@pytest.mark.parametrize("layout", sorted(EXPIRING))
def test_incrementals_of_a_table_with_feature_expiry_restore_bit_for_bit(tmp_path, layout):
    spec = TableSpec("t", dim=4, init=embstore.init.Uniform(seed=3),
                     optimizer=embstore.optim.Adam(lr=0.01))
    rng = np.random.default_rng(0)
    probe = np.arange(150)
    with embstore.open(tmp_path / "s", tables=[spec], tiers=EXPIRING[layout]) as store:
        store.apply_gradients("t", np.arange(30), rng.standard_normal((30, 4)).astype(np.float32))
        store.checkpoint(tmp_path / "c0", step=0)
        for k in range(1, 4):  # rows move between tiers, are deleted, and expire
            ids = rng.integers(0, 100, 40)
            store.apply_gradients("t", ids, rng.standard_normal((40, 4)).astype(np.float32))
            store.lookup("t", rng.integers(0, 120, 30))
            store.delete("t", rng.integers(0, 100, 5))
            store.checkpoint(tmp_path / f"c{k}", step=k, incremental=True)
        expired = sum(t.evictions for t in store.tier_statistics("t")[-1:])
        live = _table_of(store, probe)
        stored = _contents(store)
    assert expired > 0  # the scenario expires rows
    embstore.restore(tmp_path / "c3", tmp_path / "r")
    with embstore.open(tmp_path / "r") as restored:
        assert _contents(restored) == stored
        assert _table_of(restored, probe) == live


def test_rows_expiring_while_a_checkpoint_copies_stay_in_it(tmp_path, monkeypatch):
    import embstore.checkpoint as ck_mod

    monkeypatch.setattr(ck_mod, "BATCH_ROWS", 4)  # several pages: writes go on between them
    tiers = [TierSpec("rocksdb", capacity=16, eviction="fifo")]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", np.arange(16), np.arange(64, dtype=np.float32).reshape(16, 4))
        before = _contents(store)
        pushed = []

        def progress(table: str, copied: int, total: int) -> None:
            if not pushed:  # after the first page: new rows expire every older one
                store.update("t", np.arange(100, 116), np.ones((16, 4), np.float32))
                pushed.append(True)

        store.checkpoint(tmp_path / "ck", progress=progress)
        assert set(_contents(store)["t"]) == set(range(100, 116))
    with embstore.open(tmp_path / "ck", read_only=True) as ck:
        assert _contents(ck) == before  # the checkpoint is the table as the call began


class _Interrupted(BaseException):
    """Stands for Ctrl-C arriving inside a checkpoint."""


@pytest.mark.parametrize("where", ["checkpoint.begin", "checkpoint.page", "end"])
def test_an_interrupted_checkpoint_leaves_every_change_to_the_next_incremental(
        tmp_path, monkeypatch, where):
    # cut short right after it began, while it copies, or while it ends: the next incremental
    # checkpoint must still hold every change since the last checkpoint that was recorded
    from embstore import _crash

    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=TIERS) as store:
        _train(store, 0)
        store.checkpoint(tmp_path / "c0")
        _train(store, 1)
        if where == "end":
            release, hits = store._release_reading_lock, []

            def interrupt() -> None:
                release()
                if not hits:
                    hits.append(1)
                    raise _Interrupted

            monkeypatch.setattr(store, "_release_reading_lock", interrupt)
        else:
            def interrupt_at(name: str) -> None:
                if name == where:
                    raise _Interrupted

            monkeypatch.setattr(_crash, "point", interrupt_at)
        with pytest.raises(_Interrupted):
            store.checkpoint(tmp_path / "c1", incremental=True)
        monkeypatch.undo()
        _train(store, 2)
        store.checkpoint(tmp_path / "c2", incremental=True)
        live = _contents(store)
    embstore.restore(tmp_path / "c2", tmp_path / "restored")
    with embstore.open(tmp_path / "restored") as restored:
        assert _contents(restored) == live


@pytest.mark.parametrize("operation", ["checkpoint", "restore", "export"])
def test_two_threads_writing_one_destination_publish_exactly_one(tmp_path, monkeypatch,
                                                                 operation):
    # both builds complete before either is renamed into place: each has its own private
    # directory (they used to share one per process and delete each other's), and the
    # second rename is refused
    from embstore import _export, checkpoint

    stores = []
    for k in range(2):
        with embstore.open(tmp_path / f"s{k}", tables=[_spec()], tiers=[TierSpec("rocksdb")]
                           ) as store:
            store.update("t", np.arange(50), np.full((50, 4), float(k + 1), np.float32))
            store.checkpoint(tmp_path / f"c{k}")
        stores.append(tmp_path / f"s{k}")
    both_built = threading.Barrier(2, timeout=30)
    module = _export if operation == "export" else checkpoint
    publish = module.publish

    def publish_together(tmp, dest, what):
        both_built.wait()
        publish(tmp, dest, what)

    monkeypatch.setattr(module, "publish", publish_together)
    dest = tmp_path / "dest"
    outcomes: dict[int, object] = {}

    def run(k):
        try:
            if operation == "checkpoint":
                with embstore.open(stores[k]) as store:
                    store.checkpoint(dest)
            elif operation == "restore":
                embstore.restore(tmp_path / f"c{k}", dest)
            else:
                _export.export_store(stores[k], dest)
            outcomes[k] = "published"
        except E.StoreExistsError as exc:
            outcomes[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.undo()
    winners = [k for k, got in outcomes.items() if got == "published"]
    assert len(winners) == 1 and len(outcomes) == 2, outcomes
    assert "made by another writer" in str(outcomes[1 - winners[0]])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".dest")) == []
    if operation == "export":
        _export.import_store(dest, tmp_path / "imported")
        dest = tmp_path / "imported"
    with embstore.open(dest) as store:
        assert (store.lookup("t", np.arange(50)) == winners[0] + 1).all()


_OTHER_WRITER = """
import sys, numpy as np, embstore
with embstore.open(sys.argv[1]) as store:
    store.update("t", np.arange(5), np.full((5, 4), 7.0, np.float32))
    store.delete("t", [50])
"""


@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb", "pmem"])
def test_a_read_only_handle_checkpoints_what_writers_since_its_open_left(tmp_path, bottom):
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=[TierSpec(bottom)]) as store:
        store.update("t", np.arange(100), np.ones((100, 4), np.float32))
    with embstore.open(tmp_path / "s", read_only=True) as reader:
        reader.checkpoint(tmp_path / "c0")
        subprocess.run([sys.executable, "-c", _OTHER_WRITER, str(tmp_path / "s")], check=True)
        with pytest.raises(E.ConfigError, match="read-only handle"):
            reader.checkpoint(tmp_path / "c1", incremental=True)
        assert not (tmp_path / "c1").exists()
        reader.checkpoint(tmp_path / "full")
    with embstore.open(tmp_path / "s", read_only=True) as now, \
            embstore.open(tmp_path / "full", read_only=True) as full:
        assert _contents(full) == _contents(now)
        assert 50 not in _contents(full)["t"] and len(_contents(full)["t"]) == 99


def _chain_of_three(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec("a"), _spec("b")],
                       tiers=[TierSpec("rocksdb")]) as store:
        for k in range(3):
            _train(store, seed=k)
            store.checkpoint(tmp_path / f"c{k}", step=k, incremental=k > 0)


@pytest.mark.parametrize("link,edit,match", [
    ("c1", lambda d: d["checkpoint"].pop("parent"), "names no parent"),
    ("c1", lambda d: d["checkpoint"].update(parent=5), "names no parent"),
    ("c1", lambda d: d["checkpoint"].update(parent=None), "names no parent"),
    ("c0", lambda d: d["checkpoint"].update(kind="incremental"), "names no parent"),
    ("c0", lambda d: d["checkpoint"].update(kind=None), "kind"),
    ("c0", lambda d: d.update(tiers=[]), "names no tiers"),
    ("c1", lambda d: d.update(tables=[]), "not those its seal lists"),
    ("c1", lambda d: d.update(tables=d["tables"][:1]), "not those its seal lists"),
    ("c1", lambda d: d["checkpoint"].update(parent="c0\0"), "names no parent"),
    ("c0", lambda d: d["tables"].append(3), "list of tables is damaged"),
    ("c1", lambda d: d["checkpoint_seal"]["tables"].update(a=5), "not those its seal lists"),
    ("c0", lambda d: d["checkpoint_seal"]["tables"].update(b=[1]), "not those its seal lists"),
], ids=["no-parent", "parent-int", "parent-null", "full-as-incremental", "no-kind",
        "no-tiers", "no-tables", "a-table-dropped", "parent-with-nul",
        "a-table-not-an-object", "a-seal-entry-not-an-object", "a-base-seal-entry-a-list"])
def test_a_chain_whose_manifest_fields_do_not_hold_together_is_refused(tmp_path, link, edit,
                                                                      match):
    # manifests edited with their checksum made again: what a careless tool would write.
    # Each used to raise a raw KeyError, TypeError, AttributeError, IndexError or ValueError,
    # or, with an increment's tables dropped, restore without its rows
    from embstore.manifest import read_manifest, write_manifest

    _chain_of_three(tmp_path)
    doc = read_manifest(tmp_path / link)
    edit(doc)
    write_manifest(tmp_path / link, doc)
    with pytest.raises(E.CorruptStoreError, match=match):
        embstore.restore(tmp_path / "c2", tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_an_incremental_checkpoint_restores_through_a_link_to_it(tmp_path):
    # its parent was looked for beside the link: "its parent checkpoint ... is missing"
    (tmp_path / "ckpts").mkdir()
    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        store.checkpoint(tmp_path / "ckpts" / "c0")
        store.update("t", [1], np.zeros((1, 4), np.float32))
        store.checkpoint(tmp_path / "ckpts" / "c1", incremental=True)
        expected = _contents(store)
    (tmp_path / "latest").symlink_to(tmp_path / "ckpts" / "c1")
    (tmp_path / "latest-relative").symlink_to("ckpts/c1")
    for link in ("latest", "latest-relative"):
        embstore.restore(tmp_path / link, tmp_path / f"r-{link}")
        with embstore.open(tmp_path / f"r-{link}", read_only=True) as restored:
            assert _contents(restored) == expected


def test_a_parent_checkpoint_replaced_by_a_link_loop_is_damage_not_a_runtime_error(tmp_path):
    # Path.resolve raised RuntimeError("Symlink loop") out of restore and checkpoint
    import shutil

    def loop(name: str) -> None:
        shutil.rmtree(tmp_path / name)
        (tmp_path / name).symlink_to(name)

    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        store.checkpoint(tmp_path / "c0")
        store.update("t", [1], np.zeros((1, 4), np.float32))
        store.checkpoint(tmp_path / "c1", incremental=True)
        loop("c0")
        with pytest.raises(E.CorruptStoreError, match="its parent checkpoint .* is missing"):
            embstore.restore(tmp_path / "c1", tmp_path / "r")
        loop("c1")  # the parent of the next incremental checkpoint
        with pytest.raises(E.EmbstoreError):
            store.checkpoint(tmp_path / "c2", incremental=True)
    assert not (tmp_path / "r").exists() and not (tmp_path / "c2").exists()

def test_an_incremental_checkpoint_after_a_chdir_follows_its_real_parent(tmp_path,
                                                                        monkeypatch):
    # the handle kept its last checkpoint's path as given: after a chdir, a relative path
    # named another folder, and another store's checkpoint there became the parent
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    with embstore.open(tmp_path / "b" / "s", tables=[_spec()]) as other:
        other.update("t", np.arange(10), np.full((10, 4), 9, np.float32))
        other.checkpoint("k0")
    with embstore.open(tmp_path / "a" / "s", tables=[_spec()]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        monkeypatch.chdir(tmp_path / "a")
        store.checkpoint("k0")
        store.update("t", [1], np.zeros((1, 4), np.float32))
        monkeypatch.chdir(tmp_path / "b")
        store.checkpoint(tmp_path / "a" / "k1", incremental=True)
        expected = _contents(store)
    embstore.restore(tmp_path / "a" / "k1", tmp_path / "r")
    with embstore.open(tmp_path / "r", read_only=True) as restored:
        assert _contents(restored) == expected

def test_an_incremental_checkpoint_whose_parent_was_replaced_is_refused(tmp_path):
    # it took whatever stood at its parent's path as its parent: another store's checkpoint
    # put there, and restore gave that store's rows
    import shutil

    with embstore.open(tmp_path / "a", tables=[_spec()]) as store, \
            embstore.open(tmp_path / "b", tables=[_spec()]) as other:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        store.checkpoint(tmp_path / "c1")
        other.update("t", np.arange(10), np.full((10, 4), 9, np.float32))
        shutil.rmtree(tmp_path / "c1")
        other.checkpoint(tmp_path / "c1")
        store.update("t", [1], np.zeros((1, 4), np.float32))
        with pytest.raises(E.ConfigError, match="was replaced by another"):
            store.checkpoint(tmp_path / "c2", incremental=True)
        assert not (tmp_path / "c2").exists()
        store.checkpoint(tmp_path / "c3")  # a full one starts a new chain
        store.update("t", [2], np.zeros((1, 4), np.float32))
        store.checkpoint(tmp_path / "c4", incremental=True)
        expected = _contents(store)
    embstore.restore(tmp_path / "c4", tmp_path / "r")
    with embstore.open(tmp_path / "r", read_only=True) as restored:
        assert _contents(restored) == expected

def test_an_incremental_checkpoint_whose_parent_was_removed_says_so(tmp_path):
    import shutil

    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=[TierSpec("rocksdb")]) as store:
        _train(store, seed=0)
        store.checkpoint(tmp_path / "c0")
        shutil.rmtree(tmp_path / "c0")
        _train(store, seed=1)
        with pytest.raises(E.ConfigError, match="would follow is gone"):
            store.checkpoint(tmp_path / "c1", incremental=True)
        assert not (tmp_path / "c1").exists()
        store.checkpoint(tmp_path / "c2")  # a full one still goes
        expected = _contents(store)
    with embstore.open(tmp_path / "c2", read_only=True) as c2:
        assert _contents(c2) == expected


def test_a_base_checkpoint_changed_by_a_writable_open_says_so_when_restored(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=[TierSpec("lmdb")]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        store.checkpoint(tmp_path / "c0")
        store.update("t", np.arange(5), np.full((5, 4), 2, np.float32))
        store.checkpoint(tmp_path / "c1", incremental=True)
    with embstore.open(tmp_path / "c0") as base:  # writable: its rows change
        base.update("t", np.arange(3), np.zeros((3, 4), np.float32))
    with pytest.raises(E.CorruptStoreError, match="opened for writing and changed"):
        embstore.restore(tmp_path / "c1", tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_store_restored_from_a_write_protected_checkpoint_has_the_stores_own_modes(tmp_path):
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=[TierSpec("lmdb")]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
        store.checkpoint(tmp_path / "c0")
    for dirpath, _, files in os.walk(tmp_path / "c0"):
        for name in files:  # kept safe from writes, as operators keep checkpoints
            os.chmod(os.path.join(dirpath, name), 0o400)
    embstore.restore(tmp_path / "c0", tmp_path / "r")
    modes = {os.stat(os.path.join(d, n)).st_mode & 0o777
             for d, _, files in os.walk(tmp_path / "r") for n in files}
    assert modes == {0o600}
    with embstore.open(tmp_path / "r") as restored:
        assert (restored.lookup("t", np.arange(10)) == 1).all()
