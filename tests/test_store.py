"""Behaviour of the public store API on the default (DRAM) chain."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec
from embstore.errors import (
    ConfigError,
    ReadOnlyError,
    StoreClosedError,
    StoreLockedError,
)


def _spec(**kw) -> TableSpec:
    kw.setdefault("init", embstore.init.Uniform(-0.1, 0.1, seed=3))
    return TableSpec("user", dim=4, **kw)


def test_unwritten_ids_return_their_initial_rows():
    with embstore.open(None, tables=[_spec()]) as store:
        ids = np.array([7, -3, 7, 2**62])
        rows = store.lookup("user", ids)
        expected = embstore.init.Uniform(-0.1, 0.1, seed=3)(ids, 4, np.dtype(np.float32))
        np.testing.assert_array_equal(rows, expected)
        np.testing.assert_array_equal(rows[0], rows[2])
        assert store.num_rows("user") == 0  # reads store nothing


def test_initial_rows_are_identical_in_another_process():
    ids = [5, 99, -7]
    code = ("import numpy as np, embstore, json;"
            "s = embstore.open(None, tables=[embstore.TableSpec('user', dim=4, "
            "init=embstore.init.Normal(0, 1, seed=11))]);"
            f"print(json.dumps(s.lookup('user', np.array({ids})).tolist()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    with embstore.open(None, tables=[_spec(init=embstore.init.Normal(0, 1, seed=11))]) as s:
        np.testing.assert_array_equal(np.array(json.loads(out), np.float32),
                                      s.lookup("user", np.array(ids)))


def test_update_with_duplicate_ids_keeps_the_last_row():
    with embstore.open(None, tables=[_spec()]) as store:
        rows = np.arange(12, dtype=np.float32).reshape(3, 4)
        store.update("user", np.array([1, 2, 1]), rows)
        np.testing.assert_array_equal(store.lookup("user", [1, 2]), rows[[2, 1]])
        assert store.num_rows("user") == 2


def test_any_integer_dtype_is_accepted_for_ids():
    with embstore.open(None, tables=[_spec()]) as store:
        row = np.ones((1, 4), np.float32)
        for dtype in (np.int8, np.uint16, np.int32, np.uint32, np.uint64):
            store.update("user", np.array([5], dtype=dtype), row * dtype(5).itemsize)
        np.testing.assert_array_equal(store.lookup("user", [5]), row * 8)


def test_sgd_sums_duplicate_gradients_before_one_update():
    spec = _spec(optimizer=embstore.optim.SGD(lr=0.5))
    with embstore.open(None, tables=[spec]) as store:
        before = store.lookup("user", [9])
        grads = np.array([[1, 2, 3, 4], [10, 20, 30, 40]], np.float32)
        store.apply_gradients("user", np.array([9, 9]), grads)
        expected = before - np.float32(0.5) * (grads[0] + grads[1])
        np.testing.assert_array_equal(store.lookup("user", [9]), expected)


def test_delete_returns_the_count_and_restores_initial_values():
    with embstore.open(None, tables=[_spec()]) as store:
        initial = store.lookup("user", [1, 2])
        store.update("user", [1, 2], np.zeros((2, 4), np.float32))
        assert store.delete("user", [1, 1, 3]) == 1
        np.testing.assert_array_equal(store.lookup("user", [1, 2]),
                                      np.vstack([initial[0], np.zeros(4, np.float32)]))


def test_close_persists_and_reopen_needs_only_the_path(tmp_path):
    path = tmp_path / "store"
    rows = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    with embstore.open(path, tables=[_spec()]) as store:
        store.update("user", np.arange(100) * 3, rows)
        store.delete("user", [0])
    with embstore.open(path) as store:
        assert store.tables == ["user"]
        assert store.table_spec("user") == _spec()
        np.testing.assert_array_equal(store.lookup("user", np.arange(1, 100) * 3), rows[1:])
        assert store.num_rows("user") == 99


def test_reopen_adds_new_tables_and_rejects_changed_ones(tmp_path):
    path = tmp_path / "store"
    with embstore.open(path, tables=[_spec()]) as store:
        store.update("user", [1], np.ones((1, 4), np.float32))
    with pytest.raises(ConfigError, match="exists with"):
        embstore.open(path, tables=[TableSpec("user", dim=8)])
    with pytest.raises(ConfigError, match="fixed at creation"):
        embstore.open(path, tiers=[TierSpec("dram", capacity=10), TierSpec("dram")])
    with embstore.open(path, tables=[TableSpec("item", dim=2)]) as store:
        assert sorted(store.tables) == ["item", "user"]
    with embstore.open(path) as store:
        assert sorted(store.tables) == ["item", "user"]
        np.testing.assert_array_equal(store.lookup("user", [1]), np.ones((1, 4), np.float32))


def test_a_second_handle_is_refused_while_the_store_is_open(tmp_path):
    path = tmp_path / "store"
    store = embstore.open(path, tables=[_spec()])
    with pytest.raises(StoreLockedError):
        embstore.open(path)
    code = f"import embstore; embstore.open({str(path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "StoreLockedError" in proc.stderr
    store.close()
    embstore.open(path).close()


def test_read_only_store_rejects_writes_and_allows_shared_readers(tmp_path):
    path = tmp_path / "store"
    with embstore.open(path, tables=[_spec()]) as store:
        store.update("user", [1], np.ones((1, 4), np.float32))
    with embstore.open(path, read_only=True) as a, embstore.open(path, read_only=True) as b:
        for call in (lambda: a.update("user", [1], np.zeros((1, 4), np.float32)),
                     lambda: a.apply_gradients("user", [1], np.zeros((1, 4), np.float32)),
                     lambda: a.delete("user", [1])):
            with pytest.raises(ReadOnlyError):
                call()
        np.testing.assert_array_equal(b.lookup("user", [1]), np.ones((1, 4), np.float32))


def test_every_call_on_a_closed_store_raises():
    store = embstore.open(None, tables=[_spec()])
    store.close()
    store.close()  # idempotent
    for call in (lambda: store.lookup("user", [1]), store.flush, store.stats,
                 lambda: store.update("user", [1], np.ones((1, 4), np.float32)),
                 lambda: store.delete("user", [1])):
        with pytest.raises(StoreClosedError):
            call()


def test_stats_count_lookups_hits_and_rows():
    with embstore.open(None, tables=[_spec()]) as store:
        store.update("user", [1, 2], np.ones((2, 4), np.float32))
        store.lookup("user", [1, 2, 3])
        (tier,) = store.stats()["user"]["tiers"]
        assert (tier.lookups, tier.hits, tier.misses, tier.rows) == (3, 2, 1, 2)
        assert tier.bytes > 0 and tier.backend == "dram"


def test_import_embstore_pulls_in_no_optional_heavy_module():
    code = ("import sys, embstore; bad = [m for m in ('torch', 'rocksdict', 'lmdb') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_registry_finds_backends_without_importing_them():
    code = ("import sys; from embstore import registry; names = registry.backend_names(); "
            "assert {'dram', 'rocksdb', 'lmdb'} <= set(names), names; "
            "assert 'rocksdict' not in sys.modules and 'lmdb' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tier_row_counts_stay_exact_through_evictions_and_deletes(tmp_path):
    tiers = [TierSpec("dram", capacity=7, eviction="lru"),
             TierSpec("dram", capacity=30, eviction="fifo"), TierSpec("rocksdb")]
    rng = np.random.default_rng(5)
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        for _ in range(30):
            store.update("user", rng.integers(0, 80, 20), np.ones((20, 4), np.float32))
            store.lookup("user", rng.integers(0, 120, 25))
            store.delete("user", rng.integers(0, 80, 3))
            chain = store._tables["user"].chain
            for tier in chain.tiers[:2]:
                assert tier.rows == len(tier.backend) <= tier.capacity_rows
