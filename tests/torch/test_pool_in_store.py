"""Sum pooling straight from a DRAM tier (`_core.pool_in_store`), without a copy of the rows.

It must be torch.embedding_bag's "sum" to the bit (a pipeline's staged rows and every other
tier chain pool with torch, and the tables must not depend on which way a batch went), count
and log its reads as the lookup it replaces, and fall back to that lookup where the top tier
lacks rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embstore
import embstore.torch as et
from embstore import EmbeddingStore


def _filled_store(dim, rows=2000, tiers=None, path=None, **kwargs):
    store = embstore.open(path, tables=[embstore.TableSpec(
        "t", dim=dim, optimizer=embstore.optim.RowWiseAdagrad(0.1))], tiers=tiers, **kwargs)
    rng = np.random.default_rng(dim)
    store.update("t", np.arange(rows), rng.standard_normal((rows, dim)).astype(np.float32))
    return store


def _bags(seed, rows=2000, bags=64):
    rng = np.random.default_rng(seed)  # ids mostly distinct: what pool_in_store takes
    lengths = rng.integers(0, 12, bags)  # empty bags too
    lengths[0] = 0
    ids = torch.from_numpy(rng.integers(0, rows, int(lengths.sum())))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    return ids, offsets


@pytest.fixture
def in_store_reads(monkeypatch):
    """How many forwards pooled in the store, and how many fell back to a lookup."""
    counts = {"pooled": 0, "fell back": 0}
    real = EmbeddingStore._read_top_in_place

    def spy(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        counts["pooled" if result is not None else "fell back"] += 1
        return result

    monkeypatch.setattr(EmbeddingStore, "_read_top_in_place", spy)
    return counts


@pytest.mark.parametrize("dim", [1, 8, 31, 32, 40, 64, 100])
def test_pooling_in_store_is_torch_embedding_bag_to_the_bit(dim, in_store_reads):
    # dims below, at and above the kernel's blocks of columns, with a tail
    store = _filled_store(dim)
    bag = et.EmbeddingBag(store, "t", mode="sum")
    for seed in range(3):
        ids, offsets = _bags(seed)
        with torch.no_grad():
            out = bag(ids, offsets)
        weights = torch.from_numpy(store.lookup("t", np.arange(2000)).copy())
        expected = torch.nn.functional.embedding_bag(ids, weights, offsets, mode="sum")
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    assert in_store_reads == {"pooled": 3, "fell back": 0}


def test_training_pooled_in_store_equals_training_on_looked_up_rows(in_store_reads):
    # the same steps with the pooling in place and (one feature weighted by ones, which
    # takes the looked-up path) without: the same outputs and tables, bit for bit
    stores = [_filled_store(40), _filled_store(40)]
    bags = [et.EmbeddingBag(s, "t", mode="sum") for s in stores]
    for seed in range(5):
        ids, offsets = _bags(seed)
        in_place = bags[0](ids, offsets)
        looked_up = bags[1](ids, offsets, torch.ones(len(ids)))
        assert torch.equal(in_place.view(torch.int32), looked_up.view(torch.int32))
        grad = torch.randn(in_place.shape, generator=torch.Generator().manual_seed(seed))
        in_place.backward(grad)
        looked_up.backward(grad)
    everything = np.arange(2000)
    np.testing.assert_array_equal(stores[0].lookup("t", everything),
                                  stores[1].lookup("t", everything))
    np.testing.assert_array_equal(stores[0].lookup_state("t", everything),
                                  stores[1].lookup_state("t", everything))
    assert in_store_reads["pooled"] == 5


def test_a_top_tier_lacking_rows_falls_back_to_a_lookup(tmp_path, in_store_reads):
    tiers = [embstore.TierSpec("dram", capacity=16), embstore.TierSpec("rocksdb")]
    store = _filled_store(8, tiers=tiers, path=tmp_path / "s")
    reference = _filled_store(8)
    ids, offsets = _bags(1)
    out = et.EmbeddingBag(store, "t", mode="sum")(ids, offsets)
    expected = et.EmbeddingBag(reference, "t", mode="sum")(ids, offsets)
    assert torch.equal(out, expected)
    assert in_store_reads["fell back"] == 1  # the cache of 16 rows lacked some
    store.close()


def test_pooling_in_store_counts_and_logs_its_reads_as_a_lookup(tmp_path, in_store_reads):
    from embstore._access_log import read_access_log

    pooled = _filled_store(8, record_accesses=tmp_path / "log")
    looked_up = _filled_store(8)
    ids, offsets = _bags(2)
    with torch.no_grad():
        et.EmbeddingBag(pooled, "t", mode="sum")(ids, offsets)
    looked_up.lookup("t", np.unique(ids.numpy()))
    assert in_store_reads["pooled"] == 1
    for a, b in zip(pooled.tier_statistics("t"), looked_up.tier_statistics("t"), strict=True):
        assert (a.lookups, a.hits, a.misses) == (b.lookups, b.hits, b.misses)
    pooled.flush()
    # the rows' update, then the forward's batch as the model used it (repeats included)
    assert [b.tolist() for b in read_access_log(tmp_path / "log").batches("t")] == \
        [list(range(2000)), ids.tolist()]


def test_batches_that_repeat_most_ids_are_looked_up(in_store_reads):
    # a lookup reads each distinct row once, and pooling then reads a compact copy: the
    # better way when most positions repeat a row
    store = _filled_store(8)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 10, 200))
    out = et.EmbeddingBag(store, "t", mode="sum")(ids, torch.arange(0, 200, 20))
    weights = torch.from_numpy(store.lookup("t", np.arange(10)).copy())
    expected = torch.nn.functional.embedding_bag(ids, weights, torch.arange(0, 200, 20),
                                                 mode="sum")
    assert torch.equal(out, expected)
    assert in_store_reads == {"pooled": 0, "fell back": 0}
