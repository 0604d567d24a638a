"""A row the medium lost is never served as a new one: the written-id record (embstore._written).

The byte-flip test damages one random byte of a flushed store's files and reads every id back:
each lookup must give the row last flushed, raise an embstore error, or (ids never written)
the initial value. The default run flips 12 bytes per backend and kind of table; the slow one
300. Each byte of the store's files is as likely to be hit as another.
"""

from __future__ import annotations

import random
import shutil
import struct
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import _written, fsck, registry
from embstore.backend import BackendSpec
from embstore.errors import BackendUnavailableError, CorruptStoreError, EmbstoreError
from embstore.layout import bottom_dir, written_file

ROWS, DIM, NEVER = 3000, 16, 500


def _persistent() -> list[str]:
    names = []
    for name in registry.backend_names():
        try:
            if registry.load_backend(name).supports_persistence:
                names.append(name)
        except BackendUnavailableError:
            continue
    return names


PERSISTENT = _persistent()


def _spec(bounded: bool) -> embstore.TableSpec:
    return embstore.TableSpec("t", dim=DIM, num_embeddings=ROWS + NEVER if bounded else None,
                              init=embstore.init.Uniform(-1, 1, seed=3))


def _make(path: Path, backend: str, bounded: bool) -> np.ndarray:
    rows = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    tiers = [embstore.TierSpec("dram", capacity=500), embstore.TierSpec(backend)]
    with embstore.open(path, tables=[_spec(bounded)], tiers=tiers) as store:
        store.update("t", np.arange(ROWS), rows)
    return rows


def _drop_from_medium(path: Path, backend: str, ids: np.ndarray) -> Path:
    """Delete `ids` straight from the store of record, behind the store's back; its path."""
    with embstore.open(path, read_only=True) as store:
        spec, tiers = store.table_spec("t"), [embstore.TierSpec(t["backend"])
                                              for t in store.describe()["tiers"]]
    where = bottom_dir(path, spec, tiers)
    medium = registry.load_backend(backend).open(
        BackendSpec(path=where, dim=spec.row_width, dtype=spec.dtype, table="t"))
    with medium:
        medium.delete(ids)
    return where


def _make_damaged(path: Path, backend: str, bounded: bool, how: str) -> None:
    """A store whose medium lost ids 7 and 1234 (`how` "rows") or its whole file ("file")."""
    _make(path, backend, bounded)
    where = _drop_from_medium(path, backend, np.array([7, 1234]))
    if how == "file":  # the table's whole file or directory is gone
        shutil.rmtree(where)
        where.mkdir()


@pytest.mark.parametrize("bounded", [True, False], ids=["bitmap", "idlist"])
@pytest.mark.parametrize("backend", PERSISTENT)
def test_a_row_lost_by_the_medium_raises_naming_table_id_and_file(tmp_path, backend, bounded):
    _make(tmp_path / "s", backend, bounded)
    where = _drop_from_medium(tmp_path / "s", backend, np.array([1234]))
    with embstore.open(tmp_path / "s") as store:
        with pytest.raises(CorruptStoreError, match=r"table 't': id 1234 was written but its "
                           r"row is gone from .*" + str(where)):
            store.lookup("t", np.array([5, 1234, ROWS + 1]))
        with pytest.raises(CorruptStoreError):
            store.apply_gradients("t", np.array([1234]), np.ones((1, DIM), np.float32))
        store.lookup("t", np.array([5, ROWS + 1]))  # the rest reads as before
        assert store.lost_rows("t").tolist() == [1234]
        # fsck of the open store, through its API, finds the loss too
        (lost,) = fsck.check(store)
        assert lost.table == "t" and "1 written row(s) lost" in lost.message
        assert "id 1234" in lost.message
    findings = fsck.check(tmp_path / "s")
    assert any("1234" in f.message for f in findings), findings


@pytest.mark.parametrize("backend", [b for b in PERSISTENT if b in ("lmdb", "rocksdb")])
def test_a_read_only_open_of_a_removed_database_says_it_may_be_lost(tmp_path, backend):
    # not "open it for writing to create it": that makes an empty one, whose rows read lost
    _make(tmp_path / "s", backend, True)
    where = _drop_from_medium(tmp_path / "s", backend, np.array([1]))
    for entry in where.iterdir():
        if entry.name in ("data.mdb", "CURRENT"):
            entry.unlink()
    with pytest.raises(embstore.errors.StoreNotFoundError,
                       match="removed or lost .*embstore fsck"):
        embstore.open(tmp_path / "s", read_only=True)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("LOG", "lock.mdb") and not p.name.startswith("LOG.")}


@pytest.mark.parametrize("how", ["rows", "file"])
@pytest.mark.parametrize("backend", PERSISTENT)
def test_compact_migrate_and_export_refuse_a_store_whose_medium_lost_rows(tmp_path, backend,
                                                                          how):
    """A copy of the store must not turn rows the medium lost into rows never written."""
    from embstore._export import export_store
    from embstore._rebuild import replace_store

    _make_damaged(tmp_path / "s", backend, True, how)
    before = _tree(tmp_path / "s")
    for copy in (lambda: replace_store(tmp_path / "s"),  # compact
                 lambda: replace_store(tmp_path / "s", default_tiers=[  # migrate
                     embstore.TierSpec("dram", capacity=200), embstore.TierSpec(backend)]),
                 lambda: export_store(tmp_path / "s", tmp_path / "ex")):
        # a missing file may be refused on opening the medium, before the record is read
        with pytest.raises(CorruptStoreError if how == "rows" else EmbstoreError,
                           match="table .t.: .* gone from its store" if how == "rows" else None):
            copy()
        assert _tree(tmp_path / "s") == before
        assert not (tmp_path / "ex").exists() or not any((tmp_path / "ex").iterdir())
    assert fsck.check(tmp_path / "s")  # fsck says what is wrong
    if how == "rows":  # fsck --repair still drops what is lost (and says so), keeping a backup
        fsck.check(tmp_path / "s", repair=True)
        with embstore.open(tmp_path / "s") as store:
            assert store.num_rows("t") == ROWS - 2
            assert store.lost_rows("t").tolist() == []


@pytest.mark.parametrize("bounded", [True, False], ids=["bitmap", "idlist"])
@pytest.mark.parametrize("backend", PERSISTENT)
def test_a_row_the_medium_holds_unrecorded_does_not_hide_a_lost_one_from_a_copy(
        tmp_path, backend, bounded):
    """A copy compares the scan with the record id by id: one extra row cannot cancel one lost.

    The extra row is what a writer killed between its rows and its record leaves: on the
    medium, never acknowledged, so not in the record.
    """
    from embstore._export import export_store
    from embstore._rebuild import replace_store

    _make(tmp_path / "s", backend, bounded)
    where = _drop_from_medium(tmp_path / "s", backend, np.array([7]))
    spec = _spec(bounded)
    medium = registry.load_backend(backend).open(
        BackendSpec(path=where, dim=spec.row_width, dtype=spec.dtype, table="t"))
    with medium:
        medium.put(np.array([ROWS + 10]), np.ones((1, spec.row_width), np.float32))
    before = _tree(tmp_path / "s")
    for copy in (lambda: replace_store(tmp_path / "s"),
                 lambda: export_store(tmp_path / "s", tmp_path / "ex")):
        with pytest.raises(CorruptStoreError, match="1 row.* gone from its store.* e.g. id 7"):
            copy()
        assert _tree(tmp_path / "s") == before


@pytest.mark.parametrize("bounded", [True, False], ids=["bitmap", "idlist"])
@pytest.mark.parametrize("tiers", [[("dram", None)], [("dram", 100), ("rocksdb", None)]],
                         ids=["in-place", "gathered"])
def test_rows_first_written_by_an_optimizer_step_are_recorded_and_their_loss_is_caught(
        tmp_path, tiers, bounded):
    # a step skips recording the rows it found in a tier (they were recorded when first
    # written); the new ones in the same batch must still be recorded
    spec = embstore.TableSpec("t", dim=DIM, optimizer=embstore.optim.SGD(0.1),
                              num_embeddings=2000 if bounded else None)
    chain = [embstore.TierSpec(name, capacity=cap) for name, cap in tiers]
    old, new = np.arange(0, 50), np.arange(1000, 1040)
    with embstore.open(tmp_path / "s", tables=[spec], tiers=chain) as store:
        store.update("t", old, np.ones((len(old), DIM), np.float32))
        store.apply_gradients("t", old, np.ones((len(old), DIM), np.float32))  # all held
        both = np.concatenate([old[:10], new])
        store.apply_gradients("t", both, np.ones((len(both), DIM), np.float32))
        assert store._tables["t"].written is not None
        assert store._tables["t"].written.holds(np.concatenate([old, new])).all()
    backend = chain[-1].backend
    _drop_from_medium(tmp_path / "s", backend, np.array([1005, 7]))
    with embstore.open(tmp_path / "s") as store:
        assert sorted(store.lost_rows("t").tolist()) == [7, 1005]
        with pytest.raises(CorruptStoreError, match="id 1005"):
            store.lookup("t", np.array([1005]))


class _Interrupted(BaseException):
    """Stands for Ctrl-C or a failure the store does not expect, raised inside a write."""


@pytest.mark.parametrize("at", ["tiers", "record"])
@pytest.mark.parametrize("write", ["update", "apply_gradients", "bulk_load"])
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
def test_a_write_that_fails_leaves_no_id_in_the_record_and_no_row_reported_lost(
        tmp_path, monkeypatch, write, bounded, at):
    # the record learns a write's ids before the tiers get the rows: a write that fails in
    # between (in the tiers, or as the record has just learned them) must take them back,
    # or the next flush saves them and every read after it reports rows lost that were
    # never written
    spec = embstore.TableSpec("t", dim=DIM, optimizer=embstore.optim.SGD(0.1),
                              num_embeddings=2000 if bounded else None,
                              init=embstore.init.Uniform(-1, 1, seed=3))
    tiers = [embstore.TierSpec("dram", capacity=100), embstore.TierSpec("rocksdb")]
    old, new = np.arange(0, 50), np.arange(1000, 1040)
    both = np.concatenate([old[:10], new])
    ones = np.ones((len(both), DIM), np.float32)
    init = spec.init(new, DIM, np.dtype(np.float32))
    with embstore.open(tmp_path / "s", tables=[spec], tiers=tiers) as store:
        store.update("t", old, np.ones((len(old), DIM), np.float32))
        store.flush()
        chain = type(store._tables["t"].chain)

        def fail(*args, **kwargs):
            raise _Interrupted

        if at == "tiers":
            monkeypatch.setattr(chain, "bulk_load" if write == "bulk_load" else "put", fail)
        else:
            add = _written.WrittenIds.add

            def add_then_fail(*args, **kwargs):
                add(*args, **kwargs)
                raise _Interrupted

            monkeypatch.setattr(_written.WrittenIds, "add", add_then_fail)
        with pytest.raises(_Interrupted):
            if write == "update":
                store.update("t", both, ones)
            elif write == "apply_gradients":
                store.apply_gradients("t", both, ones)
            else:
                store.bulk_load("t", both, ones)
        monkeypatch.undo()
        record = store._tables["t"].written
        assert record is not None and not record.holds(new).any()
        assert record.holds(old).all()
        assert np.array_equal(store.lookup("t", new), init)
        store.flush()
    with embstore.open(tmp_path / "s") as store:
        assert np.array_equal(store.lookup("t", new), init)
        assert len(store.lost_rows("t")) == 0
        store.apply_gradients("t", new, np.ones((len(new), DIM), np.float32))
        assert store._tables["t"].written.holds(new).all()  # a write that succeeds: recorded
    assert fsck.check(tmp_path / "s") == []


@pytest.mark.parametrize("backend", PERSISTENT)
def test_never_written_and_deleted_ids_read_their_initial_value(tmp_path, backend):
    rows = _make(tmp_path / "s", backend, bounded=False)
    init = _spec(False).init
    with embstore.open(tmp_path / "s") as store:
        store.delete("t", np.arange(0, 100))
        store.update("t", np.array([50]), rows[:1])  # deleted, then written again
        store.flush()
    with embstore.open(tmp_path / "s") as store:
        got = store.lookup("t", np.arange(0, 100))
        fresh = np.arange(ROWS, ROWS + 10)
        assert np.array_equal(store.lookup("t", fresh), init(fresh, DIM, np.dtype(np.float32)))
        assert np.array_equal(got[50], rows[0])
        keep = np.arange(100) != 50
        assert np.array_equal(got[keep], init(np.arange(100)[keep], DIM, np.dtype(np.float32)))
        assert len(store.lost_rows("t")) == 0
    assert fsck.check(tmp_path / "s") == []


def test_the_record_costs_one_bit_per_id_of_a_bounded_table_and_8_bytes_per_row_else(tmp_path):
    _make(tmp_path / "b", "rocksdb", bounded=True)
    _make(tmp_path / "u", "rocksdb", bounded=False)
    bounded = written_file(tmp_path / "b", "t").stat().st_size
    unbounded = written_file(tmp_path / "u", "t").stat().st_size
    assert bounded == _written.BODY_OFFSET + (ROWS + NEVER + 7) // 8
    assert unbounded == _written.BODY_OFFSET + 8 * ROWS


def test_a_bounded_tables_record_takes_one_bit_per_id_in_memory_too(tmp_path):
    # 2**28 ids: a 32 MiB bitmap, where a byte per id took 256 MiB (and as much again to
    # pack it at each flush: 609 MiB at the peak); a few copies of the bitmap at a time now
    spec = embstore.TableSpec("t", dim=2, num_embeddings=2**28)
    tracemalloc.start()
    try:
        with embstore.open(tmp_path / "s", tables=[spec], tiers=[embstore.TierSpec("lmdb")]) \
                as store:
            ids = np.array([0, 5, 2**20 + 3, 2**28 - 1])
            store.update("t", ids, np.ones((4, 2), np.float32))
            store.flush()
            store.delete("t", ids[1:2])
            store.flush()
            assert store._table("t").written.count() == 3
        with embstore.open(tmp_path / "s", read_only=True) as store:
            np.testing.assert_array_equal(store._table("t").written.ids(), ids[[0, 2, 3]])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**27, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("backend", PERSISTENT)
def test_a_table_of_a_range_too_wide_for_a_bitmap_keeps_a_list_and_still_catches_a_loss(
        tmp_path, backend):
    # 2**62 ids (a hashed feature's range): a bitmap would take 512 PiB, and the open failed
    # with numpy's MemoryError; the record keeps the rows' ids instead
    wide = 2**62
    spec = embstore.TableSpec("t", dim=DIM, num_embeddings=wide)
    ids = np.array([0, 7, wide - 1])
    with embstore.open(tmp_path / "s", tables=[spec],
                       tiers=[embstore.TierSpec("dram", capacity=2),
                              embstore.TierSpec(backend)]) as store:
        store.update("t", ids, np.ones((3, DIM), np.float32))
    assert written_file(tmp_path / "s", "t").stat().st_size == _written.BODY_OFFSET + 8 * 3
    _drop_from_medium(tmp_path / "s", backend, ids[2:])
    with embstore.open(tmp_path / "s") as store:
        with pytest.raises(CorruptStoreError, match=f"id {wide - 1} was written"):
            store.lookup("t", ids)
        assert store.lost_rows("t").tolist() == [wide - 1]
    assert [f.id for f in fsck.check(tmp_path / "s")] == [wide - 1]


def test_a_bitmap_written_for_a_range_now_kept_as_a_list_is_still_read(tmp_path, monkeypatch):
    _make(tmp_path / "s", "rocksdb", bounded=True)  # a bitmap of ROWS + NEVER ids
    size = written_file(tmp_path / "s", "t").stat().st_size
    _drop_from_medium(tmp_path / "s", "rocksdb", np.array([1234]))
    monkeypatch.setattr(_written, "BITMAP_MAX_IDS", ROWS // 2)  # such a range takes a list now
    with embstore.open(tmp_path / "s") as store:
        with pytest.raises(CorruptStoreError, match="id 1234 was written"):
            store.lookup("t", np.array([1234]))
        store.update("t", np.array([ROWS]), np.ones((1, DIM), np.float32))
    assert written_file(tmp_path / "s", "t").stat().st_size == size  # kept as it was
    with embstore.open(tmp_path / "s") as store:
        assert store.lost_rows("t").tolist() == [1234]
        np.testing.assert_array_equal(store.lookup("t", np.array([ROWS])), np.ones((1, DIM)))


@pytest.mark.parametrize("n", [1, 7, 9, 8 * _written._CHUNK_BYTES + 3])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_a_packed_bitmap_holds_exactly_its_ids_across_chunks(n, density):
    rng = np.random.default_rng(n)
    ids = np.flatnonzero(rng.random(n) < density)
    packed = _written._bitmap(n, ids)
    assert len(packed) == (n + 7) // 8
    np.testing.assert_array_equal(_written._bitmap_ids(packed), ids)
    assert _written._bitmap_count(packed) == len(ids)
    probe = np.arange(n)
    np.testing.assert_array_equal(_written._bits_set(packed, probe), np.isin(probe, ids))
    assert np.array_equal(packed, np.packbits(np.isin(probe, ids), bitorder="little"))


def test_bitmap_bits_repeated_ids_and_ids_outside_it():
    n = 100
    rng = np.random.default_rng(5)
    ids = rng.integers(0, n, 300)  # many ids twice or more, bits of one byte together
    packed = _written._bitmap(n, ids)
    model = np.isin(np.arange(n), ids)
    assert np.array_equal(packed, np.packbits(model, bitorder="little"))
    gone = np.concatenate([ids[:40], ids[:10], [-1, 8 * len(packed), 2**40]])  # repeats, strays
    assert _written._change_bits(packed, gone, clear=True) == (len(np.unique(ids[:40])), 3)
    model[ids[:40]] = False
    assert np.array_equal(packed, np.packbits(model, bitorder="little"))
    with pytest.raises(AssertionError, match="outside a bitmap"):
        _written._set_bits(packed, np.array([5, 8 * len(packed)]))


@pytest.mark.parametrize("offset", [0, _written.CRC_OFFSET, 16, _written.BODY_OFFSET + 3, -1])
def test_a_damaged_record_is_reported_as_such(tmp_path, offset):
    _make(tmp_path / "s", "lmdb", bounded=False)
    file = written_file(tmp_path / "s", "t")
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x10
    file.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="written-id record .* is damaged"):
        embstore.open(tmp_path / "s")
    file.write_bytes(bytes(data[:10]))
    with pytest.raises(CorruptStoreError, match="shorter than its 24-byte header"):
        embstore.open(tmp_path / "s")


def test_a_record_with_a_good_checksum_and_a_foreign_id_is_refused(tmp_path):
    _make(tmp_path / "s", "lmdb", bounded=True)
    file = written_file(tmp_path / "s", "t")
    rest = struct.pack("<Q", 7) + b"\x00"
    file.write_bytes(struct.pack("<8sII", _written.MAGIC, _written.BITMAP, zlib.crc32(rest))
                     + rest)
    with pytest.raises(CorruptStoreError, match="a bitmap of 7 bits"):
        embstore.open(tmp_path / "s")


@pytest.mark.parametrize("backend", PERSISTENT)
def test_a_missing_record_is_damage_and_can_be_rebuilt_from_the_rows(tmp_path, backend):
    # the data file and the record both removed must not read as an empty, new table
    _make(tmp_path / "s", backend, bounded=False)
    written_file(tmp_path / "s", "t").unlink()
    with pytest.raises(CorruptStoreError, match="written-id record .* is missing"):
        embstore.open(tmp_path / "s")
    assert embstore.rebuild_written_records(tmp_path / "s") == ["t"]
    with embstore.open(tmp_path / "s") as store:
        assert len(store.lost_rows("t")) == 0
    assert written_file(tmp_path / "s", "t").stat().st_size == _written.BODY_OFFSET + 8 * ROWS
    written_file(tmp_path / "s", "t").unlink()  # still required after the rebuild
    with pytest.raises(CorruptStoreError):
        embstore.open(tmp_path / "s")


def test_checkpoints_and_restores_carry_exact_records(tmp_path):
    rows = _make(tmp_path / "s", "lmdb", bounded=True)
    with embstore.open(tmp_path / "s") as store:
        store.checkpoint(tmp_path / "c0", step=0)
        store.delete("t", np.arange(10))
        store.update("t", np.array([ROWS + 5]), rows[:1])
        store.checkpoint(tmp_path / "c1", step=1, incremental=True)
    embstore.restore(tmp_path / "c1", tmp_path / "r")
    for path in (tmp_path / "c0", tmp_path / "r"):
        assert fsck.check(path) == []
        with embstore.open(path) as store:
            assert len(store.lost_rows("t")) == 0
    with embstore.open(tmp_path / "r") as store:
        assert np.array_equal(store.lookup("t", np.array([ROWS + 5])), rows[:1])


@pytest.mark.parametrize("how", ["rows", "file"])
@pytest.mark.parametrize("bounded", [True, False], ids=["bitmap", "idlist"])
@pytest.mark.parametrize("backend", PERSISTENT)
def test_a_count_and_a_full_checkpoint_refuse_rows_the_medium_lost(tmp_path, backend, bounded,
                                                                   how):
    # a checkpoint once copied what the medium still had and wrote a record of just that:
    # the lost rows read from it as rows never written
    _make_damaged(tmp_path / "s", backend, bounded, how)
    with embstore.open(tmp_path / "s") as store:  # an empty medium opens: its rows read lost
        lost = "id 7 " if how == "rows" else "id 0 "
        with pytest.raises(CorruptStoreError, match=f"table .t.: {lost}.*was written but its "
                                                    "row is gone from"):
            store.num_rows("t")
        seen = []
        with pytest.raises(CorruptStoreError, match="gone from"):
            for ids, _, _ in store.items("t", batch_rows=1000):
                seen.append(ids)
        assert sum(map(len, seen)) == (ROWS - 2 if how == "rows" else 0)  # the pages first
        with pytest.raises(CorruptStoreError, match="gone from"):
            store.checkpoint(tmp_path / "c", step=1)
        assert not (tmp_path / "c").exists()
        if how == "rows":
            assert store.lost_rows("t").tolist() == [7, 1234]
        (finding,) = fsck.check(store)  # the lost rows, not a count that disagrees
        assert "written row(s) lost by the medium" in finding.message


class _InterruptAfterSet:
    """The bitmap kernel, raising KeyboardInterrupt once right after a set returns.

    That is where a Ctrl-C that came during the C loop is raised.
    """

    def __init__(self, real):
        self.real, self.armed = real, True

    def __getattr__(self, name):
        return getattr(self.real, name)

    def bitmap_set(self, *args):
        changed = self.real.bitmap_set(*args)
        if self.armed and not args[4]:  # a set, not a clear
            self.armed = False
            raise KeyboardInterrupt
        return changed


def test_an_interrupted_write_leaves_the_record_count_true(tmp_path, monkeypatch):
    # the count once moved in Python after the kernel moved the bits: an interrupt between
    # them left it off by the batch, and a later loss of as many rows went unseen
    spec = embstore.TableSpec("t", dim=4, num_embeddings=10_000)
    with embstore.open(tmp_path / "s", tables=[spec], tiers=[embstore.TierSpec("lmdb")]) as s:
        s.update("t", np.arange(1000), np.ones((1000, 4), np.float32))
        record = s._table("t").written
        assert record.count() == 1000
        monkeypatch.setattr(_written, "lib", _InterruptAfterSet(_written.lib))
        with pytest.raises(KeyboardInterrupt):
            s.update("t", np.arange(1000, 1500), np.ones((500, 4), np.float32))
        assert record.count() == _written._bitmap_count(record._packed) == 1000
        s.flush()
        bottom = s._table("t").chain.tiers[-1].backend
        getattr(bottom, "wrapped", bottom).delete(np.array([7, 8, 9]))
        with pytest.raises(CorruptStoreError, match="id 7 "):
            s.num_rows("t")


@pytest.mark.parametrize("backend", PERSISTENT)
def test_rows_written_while_items_are_read_are_no_loss(tmp_path, backend, monkeypatch):
    rows = _make(tmp_path / "s", backend, bounded=True)
    with embstore.open(tmp_path / "s") as store:
        listed = []  # the list of every id (under the lock) is for a loss only
        real = store._lost
        monkeypatch.setattr(store, "_lost", lambda *a, **k: listed.append(1) or real(*a, **k))
        seen = []
        for k, (ids, weights, _) in enumerate(store.items("t", batch_rows=500)):
            seen.append(ids)
            np.testing.assert_array_equal(weights, rows[ids])
            if k == 2:  # new ids, kept dirty in the DRAM tier: the pages may not show them
                store.update("t", np.arange(ROWS, ROWS + 300), np.ones((300, DIM), np.float32))
            if k == 3:
                store.delete("t", np.array([0, ROWS + 1]))  # one shown, one never
        assert set(range(1, ROWS)) <= set(np.concatenate(seen).tolist())
        assert not listed
        assert store.num_rows("t") == ROWS + 298


@pytest.mark.parametrize("backend", [b for b in PERSISTENT if b != "pmem"] or ["lmdb"])
def test_an_incremental_checkpoint_refuses_a_changed_row_the_medium_lost(tmp_path, backend):
    _make(tmp_path / "s", backend, bounded=True)
    with embstore.open(tmp_path / "s") as store:
        store.checkpoint(tmp_path / "c0", step=0)
        store.update("t", np.array([9, 1234]), np.ones((2, DIM), np.float32))
        store.delete("t", np.array([5]))  # changed and not found, but deleted: no loss
        store.flush()
        bottom = store._table("t").chain.tiers[-1].backend
        getattr(bottom, "wrapped", bottom).delete(np.array([1234]))  # behind the record
        with pytest.raises(CorruptStoreError, match="id 1234 was written but its row is gone"):
            store.checkpoint(tmp_path / "c1", step=1, incremental=True)
        assert not (tmp_path / "c1").exists()
        store.update("t", np.array([1234]), np.full((1, DIM), 2, np.float32))  # rewritten
        store.checkpoint(tmp_path / "c2", step=2, incremental=True)
    embstore.restore(tmp_path / "c2", tmp_path / "r")
    with embstore.open(tmp_path / "r") as store:
        assert (store.lookup("t", np.array([9, 1234])) == [[1], [2]]).all()
        assert store.num_rows("t") == ROWS - 1 and store.lost_rows("t").tolist() == []


def _flip_trials(tmp_path: Path, backend: str, bounded: bool, trials: int) -> dict[str, int]:
    base = tmp_path / "base"
    rows = _make(base, backend, bounded)
    init = _spec(bounded).init(np.arange(ROWS, ROWS + NEVER), DIM, np.dtype(np.float32))
    files = sorted(p for p in base.rglob("*") if p.is_file() and p.stat().st_size
                   and p.name not in ("LOCK", "lock.mdb"))
    sizes = [p.stat().st_size for p in files]  # every byte of the store as likely as another
    rng = random.Random(f"{backend}-{bounded}")
    tally = {"trials": 0, "detected": 0, "served_wrong": 0, "lookups": 0}
    for trial in range(trials):
        copy = tmp_path / f"t{trial}"
        shutil.copytree(base, copy)
        victim = copy / rng.choices(files, weights=sizes)[0].relative_to(base)
        data = bytearray(victim.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
        tally["trials"] += 1
        errors = 0
        try:
            with embstore.open(copy) as store:
                for lo in range(0, ROWS + NEVER, 500):
                    ids = np.arange(lo, lo + 500)
                    tally["lookups"] += 1
                    try:
                        got = store.lookup("t", ids)
                    except EmbstoreError:
                        errors += 1
                        continue
                    want = np.concatenate([rows, init])[lo:lo + 500]
                    tally["served_wrong"] += int((~(got == want).all(axis=1)).sum())
        except EmbstoreError:
            errors += 1
        tally["detected"] += errors > 0
        shutil.rmtree(copy)
    return tally


def _check_flips(tmp_path: Path, backend: str, bounded: bool, trials: int) -> None:
    tally = _flip_trials(tmp_path, backend, bounded, trials)
    print(f"byte flips {backend} {'bitmap' if bounded else 'idlist'}: {tally}")
    assert tally["served_wrong"] == 0, tally
    assert tally["trials"] == trials


@pytest.mark.parametrize("bounded", [True, False], ids=["bitmap", "idlist"])
@pytest.mark.parametrize("backend", PERSISTENT)
def test_byte_flips_never_serve_a_lost_or_damaged_row(tmp_path, backend, bounded):
    _check_flips(tmp_path, backend, bounded, trials=12)


@pytest.mark.slow
@pytest.mark.parametrize("bounded", [True, False], ids=["bitmap", "idlist"])
@pytest.mark.parametrize("backend", PERSISTENT)
def test_byte_flips_never_serve_a_lost_or_damaged_row_300_trials(tmp_path, backend, bounded):
    _check_flips(tmp_path, backend, bounded, trials=300)


def test_a_read_only_record_holds_still_until_the_writer_deletes_or_flushes(tmp_path):
    path = tmp_path / "s"
    tiers = [embstore.TierSpec("rocksdb")]
    with embstore.open(path, tables=[embstore.TableSpec("t", dim=2)], tiers=tiers) as w:
        w.update("t", np.arange(4), np.ones((4, 2), np.float32))
        w.flush()
        with embstore.open(path, read_only=True) as r:
            record = r._tables["t"].written
            assert record is not None and record.held_still()
            w.delete("t", np.array([1]))  # a journal append
            assert not record.held_still()
        with embstore.open(path, read_only=True) as r:
            record = r._tables["t"].written
            assert record is not None and record.held_still()
            w.flush()  # the record rewritten
            assert not record.held_still()
            record.file.unlink()
            assert not record.held_still()


@pytest.mark.parametrize("eviction", ["lru", "clock", "wtinylfu"])
def test_a_row_written_to_the_cache_is_flushed_even_if_the_policy_bookkeeping_is_interrupted(
        tmp_path, monkeypatch, eviction):
    # the row lands in the DRAM tier, then the eviction policy's record of it is cut short:
    # the row must still be dirty, so the flush writes it down and a reopen reads it
    tiers = [embstore.TierSpec("dram", capacity=8, eviction=eviction),
             embstore.TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=[embstore.TableSpec("t", dim=4)],
                       tiers=tiers) as store:
        store.update("t", [7], np.full((1, 4), 1.0, np.float32))
        store.flush()
        store.update("t", np.arange(20, 40), np.zeros((20, 4), np.float32))  # 7 evicted
        store.flush()
        cache = store._tables["t"].chain.tiers[0]
        calls: list[int] = []  # the first call of either raises
        for name in ("record_insert_slots", "record_insert"):
            if hasattr(cache.eviction, name):
                monkeypatch.setattr(cache.eviction, name,
                                    _raise_once(getattr(cache.eviction, name), calls))
        with pytest.raises(_Interrupted):
            store.update("t", [7], np.full((1, 4), 3.0, np.float32))
        monkeypatch.undo()
        assert store.lookup("t", [7]).tolist() == [[3.0] * 4]
        store.flush()
        # and the policy tracks it again: the tier's count and its capacity still hold
        store.update("t", np.arange(100, 120), np.zeros((20, 4), np.float32))
        assert cache.rows == len(cache.backend) == len(cache.eviction) <= 8
    with embstore.open(tmp_path / "s") as store:
        assert store.lookup("t", [7]).tolist() == [[3.0] * 4]


def _raise_interrupted(*args, **kwargs):
    raise _Interrupted


def _raise_once(method, calls: list[int]):
    """`method`, raising _Interrupted instead of running while `calls` is empty."""

    def once(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise _Interrupted
        return method(*args, **kwargs)

    return once


@pytest.mark.parametrize("eviction", ["lru", "clock", "wtinylfu"])
@pytest.mark.parametrize("write", ["delete", "bulk_load"])
def test_a_cached_row_whose_drop_is_interrupted_stays_dirty_and_evictable(
        tmp_path, monkeypatch, eviction, write):
    # a delete or a bulk load drops the cached copy: the policy and the dirty bits forget it
    # first, then the tier deletes it. Cut short in between, the row is still served, so it
    # must still reach the tier below at the next flush and still leave when evicted
    capacity = 8
    tiers = [embstore.TierSpec("dram", capacity=capacity, eviction=eviction),
             embstore.TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=[embstore.TableSpec("t", dim=4)],
                       tiers=tiers) as store:
        store.update("t", [7], np.full((1, 4), 1.0, np.float32))
        store.flush()
        store.update("t", [7], np.full((1, 4), 3.0, np.float32))  # newer than the tier below
        cache = store._tables["t"].chain.tiers[0]
        monkeypatch.setattr(cache.backend, "delete", _raise_interrupted)
        with pytest.raises(_Interrupted):
            if write == "delete":
                store.delete("t", [7])
            else:
                store.bulk_load("t", [7], np.full((1, 4), 5.0, np.float32))
        monkeypatch.undo()
        assert store.lookup("t", [7]).tolist() == [[3.0] * 4]
        store.flush()
        store.update("t", np.arange(100, 100 + 3 * capacity),
                     np.zeros((3 * capacity, 4), np.float32))
        assert cache.rows == len(cache.backend) == len(cache.eviction) <= capacity
    with embstore.open(tmp_path / "s") as store:
        assert store.lookup("t", [7]).tolist() == [[3.0] * 4]


@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb"])
def test_a_delete_cut_short_in_a_bottom_that_evicts_leaves_its_rows_tracked(
        tmp_path, monkeypatch, bottom):
    # a store of record with feature expiry (an eviction policy of its own): a delete stopped
    # before the medium's write leaves every row there, and the policy must still know them
    tiers = [embstore.TierSpec("dram", capacity=4, eviction="lru"),
             embstore.TierSpec(bottom, capacity=40, eviction="lru")]
    with embstore.open(tmp_path / "s", tables=[embstore.TableSpec("t", dim=4)],
                       tiers=tiers) as store:
        store.update("t", np.arange(30), np.ones((30, 4), np.float32))
        store.flush()
        below = store._tables["t"].chain.tiers[-1]
        monkeypatch.setattr(below.backend, "delete", _raise_interrupted)
        with pytest.raises(_Interrupted):
            store.delete("t", np.arange(10, 20))
        monkeypatch.undo()
        assert below.rows == len(below.backend) == len(below.eviction) == 30
        store.update("t", np.arange(100, 120), np.ones((20, 4), np.float32))
        assert below.rows == len(below.backend) == len(below.eviction) == 40


@pytest.mark.parametrize("how", ["rows", "file"])
@pytest.mark.parametrize("backend", PERSISTENT)
def test_describe_and_info_report_the_rows_a_medium_lost(tmp_path, backend, how, capsys):
    from embstore.tools.cli import main

    _make_damaged(tmp_path / "s", backend, True, how)
    try:
        with embstore.open(tmp_path / "s", read_only=True) as store:
            table = store.describe()["tables"]["t"]
    except EmbstoreError:  # RocksDB and LMDB refuse to open a removed database at all
        assert how == "file" and backend in ("rocksdb", "lmdb")
    else:  # "rows" counts what the medium holds; a removed file read as an empty table
        assert table["lost_rows"] == (2 if how == "rows" else ROWS)
    assert main(["info", str(tmp_path / "s")]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and err.count("\n") == 1 and "fsck" in err
