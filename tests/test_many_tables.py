"""Stores of many tables: the calls over several tables at once, and a store of 40 tables.

`lookup_many`, `update_many` and `apply_gradients_many` give exactly what the per-table calls
give, check every table's input before changing anything, and a store of tens of tables on
each persistent medium opens, trains, flushes and reopens with every row as trained.
"""

from __future__ import annotations

import dataclasses
import os
import stat

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, fsck
from embstore.errors import (
    BackendUnavailableError,
    DimensionMismatchError,
    DtypeMismatchError,
    InvalidIdsError,
    InvalidValuesError,
    NonFiniteValueError,
    ReadOnlyError,
    StorageIOError,
    StoreClosedError,
    UnknownTableError,
)
from embstore.manifest import write_atomic_many


def _specs() -> list[TableSpec]:
    return [TableSpec("a", dim=4, init=embstore.init.Uniform(-0.1, 0.1, seed=1)),
            TableSpec("b", dim=8, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1)),
            TableSpec("c", dim=4, precision="fp16",
                      optimizer=embstore.optim.Adam(lr=0.01))]


def _grads(n: int, dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)


def _batch(seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for k, spec in enumerate(_specs()):
        ids = rng.integers(0, 30, 12).astype(np.int64)  # duplicates on purpose
        out[spec.name] = (ids, _grads(len(ids), spec.dim, seed + k))
    return out


def _rows(store: embstore.EmbeddingStore) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    ids = np.arange(30, dtype=np.int64)
    return {t: (store.lookup(t, ids), store.lookup_state(t, ids)) for t in store.tables}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for t in a:
        for x, y in zip(a[t], b[t], strict=True):
            np.testing.assert_array_equal(x, y)


def test_lookup_many_returns_what_each_tables_lookup_returns():
    with embstore.open(None, tables=_specs()) as one, \
            embstore.open(None, tables=_specs()) as other:
        for store in (one, other):
            for t, (ids, g) in _batch(1).items():
                store.apply_gradients(t, ids, g)
        ids = {"a": np.array([3, 3, 40]), "b": [1, 29], "c": np.arange(5, dtype=np.int32)}
        many = one.lookup_many(ids)
        state = one.lookup_many(ids, state=True)
        assert list(many) == ["a", "b", "c"]
        for t, i in ids.items():
            np.testing.assert_array_equal(many[t], other.lookup(t, i))
            np.testing.assert_array_equal(state[t], other.lookup_state(t, i))
        assert one.lookup_many({}) == {}


def test_apply_gradients_many_equals_the_per_table_calls_bit_for_bit(tmp_path):
    tiers = [TierSpec("dram", capacity=8, eviction="lru"), TierSpec("rocksdb")]
    with embstore.open(tmp_path / "many", tables=_specs(), tiers=tiers) as many, \
            embstore.open(None, tables=_specs()) as single:
        for step in range(4):
            batch = _batch(10 + step)
            many.apply_gradients_many(batch)
            for t, (ids, g) in batch.items():
                single.apply_gradients(t, ids, g)
        _assert_same(_rows(many), _rows(single))


def test_update_many_equals_the_per_table_calls():
    with embstore.open(None, tables=_specs()) as many, \
            embstore.open(None, tables=_specs()) as single:
        batch = {t: (ids, g * np.float32(0.1)) for t, (ids, g) in _batch(3).items()}
        many.update_many(batch)
        for t, (ids, rows) in batch.items():
            single.update(t, ids, rows)
        _assert_same(_rows(many), _rows(single))


def _bad_requests() -> list[tuple[str, object, type[Exception]]]:
    good = _batch(5)
    a, b = good["a"], good["b"]
    return [
        ("unknown table last", {"a": a, "nope": b}, UnknownTableError),
        ("float ids in the second table", {"a": a, "b": (b[0] + 0.5, b[1])}, InvalidIdsError),
        ("wrong width", {"a": a, "b": (b[0], b[1][:, :4])}, DimensionMismatchError),
        ("wrong dtype", {"a": a, "b": (b[0], b[1].astype(np.float64))}, DtypeMismatchError),
        ("one row short", {"a": a, "b": (b[0], b[1][1:])}, InvalidValuesError),
        ("NaN", {"a": a, "b": (b[0], np.where(b[1] > 1, np.nan, b[1]).astype(np.float32))},
         NonFiniteValueError),
        ("not a pair", {"a": a, "b": b[0]}, InvalidValuesError),
        ("not a mapping", [("a", a)], InvalidValuesError),
    ]


@pytest.mark.parametrize("case", _bad_requests(), ids=lambda c: c[0])
@pytest.mark.parametrize("call", ["apply_gradients_many", "update_many"])
def test_bad_input_to_a_many_call_raises_and_changes_nothing(tmp_path, case, call):
    _, requests, error = case
    tiers = [TierSpec("dram", capacity=8, eviction="lru"), TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=_specs(), tiers=tiers) as store:
        store.apply_gradients_many(_batch(0))
        before_stats = store.stats()
        before_steps = store.describe()
        with pytest.raises(error):
            getattr(store, call)(requests)
        assert store.stats() == before_stats  # not even a read of the first table
        assert store.describe()["tables"] == before_steps["tables"]
        with embstore.open(None, tables=_specs()) as reference:
            reference.apply_gradients_many(_batch(0))
            _assert_same(_rows(store), _rows(reference))


@pytest.mark.parametrize("requests", [{"a": [1], "nope": [2]}, {"a": [1], "b": [0.5]},
                                      {"a": np.zeros((2, 2), np.int64)}])
def test_bad_input_to_lookup_many_raises_before_any_table_is_read(tmp_path, requests):
    tiers = [TierSpec("dram", capacity=8, eviction="lru"), TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=_specs(), tiers=tiers) as store:
        store.apply_gradients_many(_batch(0))
        store.flush()
        before = store.stats()
        with pytest.raises((UnknownTableError, InvalidIdsError)):
            store.lookup_many(requests)
        assert store.stats() == before


def test_many_calls_on_a_read_only_or_closed_store(tmp_path):
    with embstore.open(tmp_path / "s", tables=_specs(), tiers=[TierSpec("rocksdb")]) as store:
        store.apply_gradients_many(_batch(0))
    with embstore.open(tmp_path / "s", read_only=True) as store:
        before = _rows(store)
        with pytest.raises(ReadOnlyError):
            store.apply_gradients_many(_batch(1))
        with pytest.raises(ReadOnlyError):
            store.update_many(_batch(1))
        _assert_same(_rows(store), before)
        assert store.lookup_many({"a": [1]})["a"].shape == (1, 4)
    store.close()
    for call, arg in (("lookup_many", {"a": [1]}), ("apply_gradients_many", _batch(1)),
                      ("update_many", _batch(1))):
        with pytest.raises(StoreClosedError):
            getattr(store, call)(arg)


def _forty_tables() -> list[TableSpec]:
    dims = [8, 16, 4, 12]
    return [TableSpec(f"table_{i:02d}", dim=dims[i % 4],
                      optimizer=embstore.optim.RowWiseAdagrad(lr=0.05),
                      init=embstore.init.Uniform(-0.1, 0.1, seed=i))
            for i in range(40)]


def _forty_batch(specs: list[TableSpec], seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for k, spec in enumerate(specs):
        ids = np.unique(rng.integers(0, 5 + 10 * k, 20)).astype(np.int64)
        out[spec.name] = (ids, _grads(len(ids), spec.dim, 1000 * seed + k))
    return out


def _available(bottom: str) -> None:
    try:
        embstore.registry.load_backend(bottom)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))


# rocksdb, the slowest to open forty column families (13 s), in the slow job
@pytest.mark.parametrize("bottom", [pytest.param("rocksdb", marks=pytest.mark.slow), "lmdb", "pmem",
                                    "dram"])
def test_forty_tables_open_train_flush_and_reopen_as_trained(tmp_path, bottom):
    _available(bottom)
    specs = _forty_tables()
    tiers = [TierSpec("dram", capacity=16, eviction="lru"), TierSpec(bottom)]
    path = tmp_path / "store"
    with embstore.open(path, tables=specs, tiers=tiers) as store, \
            embstore.open(None, tables=specs) as reference:
        for step in range(3):
            batch = _forty_batch(specs, step)
            store.lookup_many({t: ids for t, (ids, _) in batch.items()})
            store.apply_gradients_many(batch)
            for t, (ids, g) in batch.items():
                reference.apply_gradients(t, ids, g)
        store.flush()
        expected = _rows_of(reference, specs)
    # every table's written-id record exists, 0600, written by the flush
    records = sorted((path / "written").glob("*.ids"))
    assert [r.stem for r in records] == [s.name for s in specs]
    assert all(stat.S_IMODE(r.stat().st_mode) == 0o600 for r in records)
    assert not list((path / "written").glob("*.tmp"))
    with embstore.open(path) as store:
        assert store.tables == [s.name for s in specs]
        _assert_same(_rows_of(store, specs), expected)
        assert all(store.num_rows(s.name) > 0 for s in specs)
    assert fsck.check(path) == []


def _rows_of(store: embstore.EmbeddingStore, specs: list[TableSpec]
             ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    ids = {s.name: np.arange(5 + 10 * k, dtype=np.int64) for k, s in enumerate(specs)}
    return {t: (store.lookup_many(ids)[t], store.lookup_many(ids, state=True)[t]) for t in ids}


def test_an_lmdb_store_holds_more_tables_than_the_max_tables_option(tmp_path):
    _available("lmdb")
    specs = [TableSpec(f"t{i}", dim=2) for i in range(70)]  # the option's default is 64
    with embstore.open(tmp_path / "s", tables=specs, tiers=[TierSpec("lmdb")]) as store:
        store.update_many({s.name: (np.array([i]), np.full((1, 2), i, np.float32))
                           for i, s in enumerate(specs)})
    with embstore.open(tmp_path / "s") as store:
        got = store.lookup_many({s.name: [i] for i, s in enumerate(specs)})
        assert [float(got[s.name][0, 0]) for s in specs] == [float(i) for i in range(70)]
    assert fsck.check(tmp_path / "s") == []


def test_adding_tables_to_a_rocksdb_store_keeps_the_earlier_ones(tmp_path):
    first = [TableSpec(f"t{i}", dim=2) for i in range(5)]
    more = [TableSpec(f"u{i}", dim=3) for i in range(5)]
    with embstore.open(tmp_path / "s", tables=first, tiers=[TierSpec("rocksdb")]) as store:
        store.update("t3", np.array([7]), np.ones((1, 2), np.float32))
    with embstore.open(tmp_path / "s", tables=more) as store:
        assert store.tables == [s.name for s in first + more]
        store.update("u4", np.array([1]), np.full((1, 3), 2, np.float32))
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store.lookup("t3", [7]), np.ones((1, 2), np.float32))
        np.testing.assert_array_equal(store.lookup("u4", [1]), np.full((1, 3), 2, np.float32))


def test_a_table_whose_spec_changed_is_refused_on_reopen_with_many_tables(tmp_path):
    specs = [TableSpec(f"t{i}", dim=2) for i in range(6)]
    embstore.open(tmp_path / "s", tables=specs, tiers=[TierSpec("rocksdb")]).close()
    changed = [dataclasses.replace(specs[2], dim=5)]
    with pytest.raises(embstore.errors.ConfigError):
        embstore.open(tmp_path / "s", tables=changed)
    with embstore.open(tmp_path / "s") as store:  # still opens as it was
        assert store.table_spec("t2").dim == 2


def test_write_atomic_many_replaces_every_file_on_its_own(tmp_path):
    files = [(tmp_path / f"f{i}", f"new {i}".encode()) for i in range(20)]
    for file, _ in files[:5]:
        file.write_bytes(b"old")
    write_atomic_many(files)
    assert [f.read_bytes() for f, _ in files] == [d for _, d in files]
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f, _ in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f, _ in files)


@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb"])
def test_a_linked_tier_directory_of_many_tables_is_refused_before_it_is_opened(tmp_path,
                                                                             bottom):
    _available(bottom)
    specs = [TableSpec(f"t{i}", dim=2) for i in range(3)]
    embstore.open(tmp_path / "s", tables=specs, tiers=[TierSpec(bottom)]).close()
    tier = tmp_path / "s" / f"tier0-{bottom}"
    target = tmp_path / "elsewhere"
    os.rename(tier, target)
    tier.symlink_to(target)
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    with pytest.raises(embstore.errors.CorruptStoreError, match="symbolic link"):
        embstore.open(tmp_path / "s")
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before


def test_a_sync_that_fails_in_a_flush_of_many_tables_is_raised(tmp_path, monkeypatch):
    specs = [TableSpec(f"t{i}", dim=2) for i in range(12)]  # synced on several threads
    with embstore.open(tmp_path / "s", tables=specs, tiers=[TierSpec("pmem")]) as store:
        store.update_many({s.name: (np.array([1]), np.ones((1, 2), np.float32))
                           for s in specs})

        def broken() -> None:
            raise StorageIOError("t7's device went away")

        monkeypatch.setattr(store._tables["t7"].chain, "sync", broken)
        with pytest.raises(StorageIOError, match="went away"):
            store.flush()
        monkeypatch.undo()
        store.flush()
    with embstore.open(tmp_path / "s") as store:
        assert all(store.num_rows(s.name) == 1 for s in specs)
