"""`EmbeddingStore.prefetch`: rows a prefetch finds up stay up until its batch runs."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec


# rocksdb is read without the store's lock (`embstore._prefetch`), lmdb under it
# (`TableChain.bring_up`); CLOCK and LRU are the policies whose choice an access changes
@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb"])
@pytest.mark.parametrize("eviction", ["clock", "lru"])
def test_rows_a_prefetch_finds_up_outlast_the_rows_promoted_after_them(
        tmp_path, bottom: str, eviction: str) -> None:
    tiers = [TierSpec("dram", capacity=8, eviction=eviction), TierSpec(bottom)]
    with embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=4)], tiers=tiers) as store:
        rows = np.arange(64, dtype=np.float32).reshape(16, 4)
        store.bulk_load("t", np.arange(16), rows)
        top = store._tables["t"].chain.tiers[0]
        assert store.prefetch("t", np.arange(8)) == 8  # the tier is full, none read yet
        hits = top.counters["hits"]
        # the next batch needs 0 and 1, already up; the batch after it six new rows, whose
        # promotion evicts six: not 0 or 1, which the first of the two batches will read
        assert store.prefetch("t", np.array([1, 0, 1])) == 0
        assert store.prefetch("t", np.arange(8, 14)) == 6
        held = top.backend.contains(np.arange(16))
        np.testing.assert_array_equal(np.flatnonzero(held), [0, 1, 8, 9, 10, 11, 12, 13])
        assert top.counters["hits"] == hits  # the lookup counts its hits, not the prefetch
        misses = top.counters["misses"]
        np.testing.assert_array_equal(store.lookup("t", np.array([0, 1])), rows[:2])
        assert top.counters["misses"] == misses
        assert top.counters["hits"] == hits + 2
