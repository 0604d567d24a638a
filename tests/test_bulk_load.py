"""EmbeddingStore.bulk_load: SST ingestion on RocksDB, one durable write elsewhere."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

import embstore
from embstore.errors import ConfigError, DimensionMismatchError, InvalidValuesError

BOTTOMS = ["rocksdb", "lmdb", "pmem", "dram"]


def _open(path, bottom, *, cache=4):
    spec = embstore.TableSpec("t", dim=4, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))
    tiers = [embstore.TierSpec("dram", capacity=cache), embstore.TierSpec(bottom)]
    return embstore.open(path, tables=[spec], tiers=tiers)


@pytest.mark.parametrize("bottom", BOTTOMS)
def test_bulk_load_replaces_cached_rows_and_survives_reopen(tmp_path, bottom):
    path = tmp_path / "s"
    with _open(path, bottom) as store:
        store.update("t", np.array([1, 2, 3]), np.full((3, 4), 9, np.float32))  # dirty, cached
        store.apply_gradients("t", np.array([1]), np.ones((1, 4), np.float32))
        ids = np.array([7, 2, 1, 100, 7])
        weights = np.arange(20, dtype=np.float32).reshape(5, 4)
        store.bulk_load("t", ids, weights)
        expected = {7: weights[4], 2: weights[1], 1: weights[2], 100: weights[3],
                    3: np.full(4, 9, np.float32)}
        keys = np.array(sorted(expected))
        np.testing.assert_array_equal(store.lookup("t", keys),
                                      np.stack([expected[k] for k in keys]))
        # loaded rows start with the optimizer's initial state, even where a cached row had
        # trained state
        np.testing.assert_array_equal(store.lookup_state("t", np.array([1, 7])), 0)
        assert store.num_rows("t") == 5
    with embstore.open(path) as store:
        np.testing.assert_array_equal(store.lookup("t", keys),
                                      np.stack([expected[k] for k in keys]))


def test_bulk_load_with_state_and_in_chunks(tmp_path):
    with _open(tmp_path / "s", "rocksdb") as store:
        rng = np.random.default_rng(0)
        ids = rng.permutation(50_000)
        weights = rng.standard_normal((50_000, 4)).astype(np.float32)
        state = rng.random((50_000, 1)).astype(np.float32)
        for start in range(0, len(ids), 16_384):
            sl = slice(start, start + 16_384)
            store.bulk_load("t", ids[sl], weights[sl], state[sl])
        assert store.num_rows("t") == 50_000
        probe = rng.choice(50_000, 500, replace=False)
        pos = np.argsort(ids)[probe]
        np.testing.assert_array_equal(store.lookup("t", probe), weights[pos])
        np.testing.assert_array_equal(store.lookup_state("t", probe), state[pos])
        assert not list((tmp_path / "s").rglob(".bulk-*"))  # no SST left behind
    assert embstore.fsck.check(tmp_path / "s") == []


@pytest.mark.parametrize("bad,error", [
    (lambda s: s.bulk_load("t", np.array([1, 2]), np.ones((2, 3), np.float32)),
     DimensionMismatchError),
    (lambda s: s.bulk_load("t", np.array([1, 2]), np.ones((2, 4), np.float32),
                           np.ones((2, 2), np.float32)), InvalidValuesError),
    (lambda s: s.bulk_load("t", np.array([1, 2]), np.ones((2, 4), np.float32),
                           np.full((2, 1), np.nan, np.float32)), InvalidValuesError),
    (lambda s: s.bulk_load("t", np.array([1.5]), np.ones((1, 4), np.float32)),
     embstore.errors.InvalidIdsError),
    # a negative sum of squares: the row's next step would be NaN
    (lambda s: s.bulk_load("t", np.array([1, 2]), np.ones((2, 4), np.float32),
                           np.array([[0.5], [-1.0]], np.float32)), InvalidValuesError),
])
def test_bad_bulk_load_changes_nothing(tmp_path, bad, error):
    with _open(tmp_path / "s", "rocksdb") as store:
        store.update("t", np.array([1]), np.ones((1, 4), np.float32))
        with pytest.raises(error):
            bad(store)
        assert store.num_rows("t") == 1
        np.testing.assert_array_equal(store.lookup("t", np.array([1, 2])),
                                      [[1, 1, 1, 1], [0, 0, 0, 0]])


def test_bulk_load_refuses_a_bottom_tier_with_its_own_policy(tmp_path):
    spec = embstore.TableSpec("t", dim=4)
    tiers = [embstore.TierSpec("rocksdb", admission="frequency")]
    with embstore.open(tmp_path / "s", tables=[spec], tiers=tiers) as store, \
            pytest.raises(ConfigError, match="policy"):
        store.bulk_load("t", np.array([1]), np.ones((1, 4), np.float32))


def _load_then_die(path: str, bottom: str) -> None:
    store = _open(path, bottom)
    store.bulk_load("t", np.arange(1000), np.ones((1000, 4), np.float32))
    os.kill(os.getpid(), signal.SIGKILL)  # no flush, no close


@pytest.mark.crash
@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb", "pmem"])
def test_bulk_load_is_durable_when_it_returns(tmp_path, bottom):
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_load_then_die, args=(str(tmp_path / "s"), bottom))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    with embstore.open(tmp_path / "s") as store:
        assert store.num_rows("t") == 1000
        np.testing.assert_array_equal(store.lookup("t", np.arange(1000)), 1)
