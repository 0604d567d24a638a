"""`BucketIdIndex` (the DRAM tier's index) agrees with a dict under inserts, removals and growth."""

from __future__ import annotations

import numpy as np
import pytest

from embstore.index import BucketIdIndex


@pytest.mark.parametrize("seed", range(4))
def test_bucket_index_matches_a_dict_under_churn(seed) -> None:
    rng = np.random.default_rng(seed)
    index = BucketIdIndex(8 if seed % 2 else 4096)  # growth from tiny, or a roomy start
    truth: dict[int, int] = {}
    universe = rng.integers(-2**63, 2**63 - 1, 3000, dtype=np.int64)
    universe[:10] = np.arange(10)  # small ids and extremes too
    universe[10] = np.iinfo(np.int64).min
    universe[11] = np.iinfo(np.int64).max
    for _ in range(60):
        ids = np.unique(rng.choice(universe, rng.integers(1, 400)))
        if rng.random() < 0.6:
            slots, inserted = index.add(ids)
            for i, s, new in zip(ids.tolist(), slots.tolist(), inserted.tolist(), strict=True):
                assert new == (i not in truth)
                if new:
                    assert s not in truth.values()
                    truth[i] = s
                assert truth[i] == s
        else:
            slots = index.remove(ids)
            for i, s in zip(ids.tolist(), slots.tolist(), strict=True):
                assert s == truth.pop(i, -1)
        assert len(index) == len(truth)
        # every length around the kernel's prefetch distance (16 ids), and longer
        probe = np.unique(rng.choice(universe, int(rng.choice([1, 15, 16, 17, 33, 500]))))
        assert index.find(probe).tolist() == [truth.get(i, -1) for i in probe.tolist()]
    ids, slots = index.items()
    assert dict(zip(ids.tolist(), slots.tolist(), strict=True)) == truth


def test_bucket_index_stays_compact() -> None:
    index = BucketIdIndex()
    n = 200_000
    ids = (np.arange(n, dtype=np.int64) * 7919 + 13)
    for start in range(0, n, 30_000):
        index.add(ids[start:start + 30_000])
    assert len(index) == n
    assert index.nbytes() / n <= 16.5
    assert (index.find(ids) >= 0).all()


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 47, 1000, 20_001])
def test_the_pipelined_gather_returns_every_row_found_and_slot_at_any_batch_size(n) -> None:
    # the kernel is software-pipelined in blocks of ids: every block boundary and tail
    from embstore import registry
    from embstore.backend import BackendSpec

    dim = 5  # rows of 20 bytes: not a whole cache line
    backend = registry.load_backend("dram").open(BackendSpec(path=None, dim=dim, table="t"))
    rng = np.random.default_rng(n)
    stored = rng.choice(1 << 40, 3000, replace=False).astype(np.int64)
    rows = rng.standard_normal((3000, dim), dtype=np.float32)
    backend.put(stored, rows)
    model = {int(i): r for i, r in zip(stored, rows, strict=True)}
    # present ids (some twice) and absent ones, mixed
    ids = np.where(rng.random(n) < 0.7, rng.choice(stored, n), rng.integers(1 << 41, 1 << 42, n))
    got, found, slots = backend.get_with_slots(ids)
    want_found = np.array([int(i) in model for i in ids], dtype=bool)
    assert np.array_equal(found, want_found)
    want = np.array([model.get(int(i), np.zeros(dim, np.float32)) for i in ids]
                    ).reshape(n, dim)
    assert np.array_equal(got, want)
    assert np.array_equal(slots, backend.index.find(ids))
    assert (slots[~want_found] == -1).all()
    # the leading columns alone (weights without state): a contiguous copy of those columns
    for columns in (1, 3, dim):
        lead, lead_found, lead_slots = backend.get_leading(ids, columns)
        assert lead.flags.c_contiguous and lead.shape == (n, columns)
        assert np.array_equal(lead, want[:, :columns])
        assert np.array_equal(lead_found, want_found) and np.array_equal(lead_slots, slots)
    for bad in (0, dim + 1):
        with pytest.raises(ValueError):
            backend.get_leading(ids, bad)
    backend.close()


def test_removals_from_a_full_small_index_keep_every_other_id() -> None:
    # a few buckets at the highest load: clusters wrap past the table's end, so a removal's
    # backward shift must measure distances cyclically; single removals, a batch of exactly
    # the kernel's prefetch distance (16) and longer ones. Many small tables, because any
    # one layout exercises the wrap-around only by chance
    for seed in range(60):
        rng = np.random.default_rng(seed)
        index = BucketIdIndex(40)
        room = int(index._nb * 5 * BucketIdIndex.MAX_LOAD)
        ids = np.unique(rng.integers(-2**63, 2**63 - 1, room, dtype=np.int64))
        slots, _ = index.add(ids)
        assert index._nb == -(-40 // 5)  # no growth: the load is as high as it gets
        truth = dict(zip(ids.tolist(), slots.tolist(), strict=True))
        order = rng.permutation(ids)
        for batch in (order[:1], order[1:2], order[2:18], order[18:]):
            assert index.remove(batch).tolist() == [truth.pop(i) for i in batch.tolist()]
            rest = np.array(sorted(truth), dtype=np.int64)
            assert index.find(rest).tolist() == [truth[i] for i in rest.tolist()], seed
        assert len(index) == 0


@pytest.mark.parametrize("batch", [2000, 3000, 6000])
def test_a_cache_index_reaches_its_working_room_whatever_its_batches(batch) -> None:
    # growing toward it in bounded steps stopped at the first step past the rows held:
    # load 0.49, 0.33 or 0.72 at capacity, where removals run 2x slower than at 0.25
    capacity = 100_000
    idx = BucketIdIndex(1024, working_capacity=4 * capacity)
    start = 0
    while len(idx) < capacity:
        n = min(batch, capacity - len(idx))
        idx.add(np.arange(start, start + n, dtype=np.int64))
        start += n
    assert len(idx) / (idx.buckets()[1] * 5) <= 0.25 + 1e-9
    # and no more room than that: 4x a cache's size, in 64-byte buckets of five
    assert idx.nbytes() <= 1.05 * 4 * capacity / 5 * 64 + 4 * capacity
