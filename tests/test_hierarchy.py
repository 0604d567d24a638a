"""Tier-chain behaviour the dict model does not show: statistics, write-back on eviction,
feature admission and expiry in the bottom tier, and policy configuration errors.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec
from embstore import errors as E

ONES = np.ones((1, 4), np.float32)


def _spec() -> TableSpec:
    return TableSpec("t", dim=4, init=embstore.init.Constant(0.5))


def test_statistics_count_hits_misses_promotions_evictions_and_writebacks(tmp_path):
    tiers = [TierSpec("dram", capacity=2, eviction="lru"), TierSpec("lmdb")]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", [1, 2, 3], np.ones((3, 4), np.float32))  # 3 rows into 2: one evicted
        top, bottom = store.tier_statistics("t")
        assert (top.rows, top.evictions, top.writebacks, bottom.rows) == (2, 1, 1, 1)
        store.lookup("t", [1, 2, 3])
        top, bottom = store.tier_statistics("t")
        assert top.hits + top.misses == top.lookups
        assert bottom.hits >= 1 and top.promotions >= 1
        store.flush()
        assert store.tier_statistics("t")[1].rows == 3  # every dirty row written down


@pytest.mark.parametrize("eviction", ["fifo", "clock", "lru"])
def test_a_clean_row_in_a_reused_slot_is_never_written_back(tmp_path, eviction):
    """Dirty marks follow the row, not the DRAM slot it leaves for the next id."""
    tiers = [TierSpec("dram", capacity=1, eviction=eviction), TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", [1], ONES * 1)
        store.update("t", [2], ONES * 2)  # evicts 1: dirty, written back
        store.flush()  # writes 2 back: every row clean
        assert store.tier_statistics("t")[0].writebacks == 2
        for i in (1, 2, 1, 2):  # each lookup promotes one clean row into the freed slot
            np.testing.assert_array_equal(store.lookup("t", [i]), ONES * i)
        top = store.tier_statistics("t")[0]
        assert top.promotions == 4 and top.evictions == 5
        assert top.writebacks == 2  # clean evictions wrote nothing
        store.update("t", [3], ONES * 3)  # a dirty row again, in a reused slot
        store.lookup("t", [1])  # evicts 3: written back
        assert store.tier_statistics("t")[0].writebacks == 3
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store.lookup("t", [1, 2, 3]),
                                      np.concatenate([ONES * 1, ONES * 2, ONES * 3]))


def _failing_puts(backend, failures: int):  # type: ignore[no-untyped-def]
    """Make the next `failures` puts of the bottom medium raise, as a full disk would."""
    medium = backend.wrapped  # under the chain's drained view: the writer's own target
    real_put = medium.put
    left = [failures]

    def put(ids, rows):  # type: ignore[no-untyped-def]
        if left[0]:
            left[0] -= 1
            raise E.CapacityError("no space left on device (injected)")
        real_put(ids, rows)

    medium.put = put


@pytest.mark.parametrize("bottom", ["lmdb", "pmem", "rocksdb"])
def test_a_failed_background_write_back_is_raised_and_kept_until_it_succeeds(tmp_path, bottom):
    """Write-backs into the bottom run on a second thread: a failure surfaces at the next use
    of the bottom, and the rows stay queued, never lost nor shadowed by an older value.
    """
    tiers = [TierSpec("dram", capacity=4, eviction="fifo"), TierSpec(bottom)]
    ids = np.arange(10)
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", ids, np.zeros((10, 4), np.float32))
        store.flush()  # the bottom holds zeros for every id
        _failing_puts(store._tables["t"].chain.tiers[-1].backend, failures=2)
        store.update("t", ids, rows)  # 6 dirty rows evicted: their write fails in the thread
        writer = store._tables["t"].chain.writer
        deadline = time.monotonic() + 10
        while writer._error is None and time.monotonic() < deadline:
            time.sleep(0.001)  # until then a medium read beside the writer (rocksdb) reads
            # the queued rows from the queue, right but not yet failed
        with pytest.raises(E.CapacityError, match="injected"):
            store.lookup("t", ids)  # misses read the bottom: the retry fails too
        # the disk has room again: the queued rows land before any read of the bottom
        np.testing.assert_array_equal(store.lookup("t", ids), rows)
        assert store.tier_statistics("t")[1].rows == 10
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store.lookup("t", ids), rows)


def test_a_failed_background_write_back_fails_the_flush(tmp_path):
    tiers = [TierSpec("dram", capacity=2, eviction="lru"), TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        _failing_puts(store._tables["t"].chain.tiers[-1].backend, failures=2)
        store.update("t", [1, 2, 3, 4], np.ones((4, 4), np.float32))  # 1, 2 fail in the thread
        with pytest.raises(E.CapacityError):
            store.flush()  # nothing may be promised durable while a write-back is stuck
        store.flush()  # the disk has room again: everything queued lands, then the sync
        assert store.tier_statistics("t")[1].rows == 4
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store.lookup("t", [1, 2, 3, 4]), np.ones((4, 4)))


def test_feature_admission_drops_updates_of_unadmitted_ids(tmp_path):
    tiers = [TierSpec("rocksdb", admission="frequency", admission_options={"threshold": 2})]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", [7], ONES * 3)  # first sighting: no stored row yet
        np.testing.assert_array_equal(store.lookup("t", [7]), np.full((1, 4), 0.5, np.float32))
        assert store.num_rows("t") == 0
        store.update("t", [7], ONES * 3)  # second: admitted
        np.testing.assert_array_equal(store.lookup("t", [7]), ONES * 3)
        stats = store.stats()["t"]
        assert stats["updates_dropped"] == 1
        assert stats["tiers"][0].admissions_rejected == 1


def test_feature_expiry_removes_idle_rows_including_those_stored_before_reopen(tmp_path):
    tiers = [TierSpec("lmdb", eviction="ttl", eviction_options={"ttl": 3})]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", [1, 2], np.ones((2, 4), np.float32))
    with embstore.open(tmp_path / "s") as store:
        assert store.num_rows("t") == 2
        for step in range(6):  # keep id 2 busy; id 1 goes idle
            store.update("t", [2, 100 + step], np.ones((2, 4), np.float32))
        ids = {int(x) for batch, _, _ in store.items("t") for x in batch}
        assert 1 not in ids and 2 in ids
        np.testing.assert_array_equal(store.lookup("t", [1]), np.full((1, 4), 0.5, np.float32))
        assert store.tier_statistics("t")[0].evictions >= 1


@pytest.mark.parametrize("tier", [
    TierSpec("dram", capacity=2, eviction="always"),
    TierSpec("lmdb", capacity=2, eviction="lru", eviction_options={"bogus": 1}),
    TierSpec("dram", capacity=2, admission="lru"),
    TierSpec("dram", capacity=2, eviction="lru", eviction_options={"bogus": 1}),
    TierSpec("dram", capacity=2, admission="frequency", admission_options={"threshold": 0}),
])
def test_wrong_policy_configuration_is_a_config_error(tmp_path, tier):
    with pytest.raises(E.ConfigError):
        embstore.open(tmp_path / "s", tables=[_spec()], tiers=[tier, TierSpec("lmdb")])
    assert not (tmp_path / "s").exists()  # a failed create leaves nothing behind
    embstore.open(tmp_path / "s", tables=[_spec()], tiers=[TierSpec("lmdb")]).close()


def test_an_expired_row_is_not_served_from_a_clean_copy_in_a_cache(tmp_path):
    tiers = [TierSpec("dram", capacity=8, eviction="lru"),
             TierSpec("lmdb", capacity=4, eviction="lru")]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", [0, 1, 2, 3], np.ones((4, 4), np.float32))
        store.flush()  # stored below; clean copies stay in DRAM
        store.update("t", [10, 11, 12, 13], np.full((4, 4), 2, np.float32))
        store.flush()  # the store of record takes 10..13 and expires 0..3
        assert store.tier_statistics("t")[1].evictions == 4
        np.testing.assert_array_equal(store.lookup("t", [0, 1, 2, 3]),
                                      np.full((4, 4), 0.5, np.float32))
        assert store.num_rows("t") == len({int(i) for b, _, _ in store.items("t") for i in b})
        store.checkpoint(tmp_path / "ck")
        live = store.lookup("t", np.arange(16))
    with embstore.open(tmp_path / "ck", read_only=True) as ck:
        np.testing.assert_array_equal(ck.lookup("t", np.arange(16)), live)


def test_a_row_expired_below_a_newer_dirty_copy_keeps_the_newer_value(tmp_path):
    tiers = [TierSpec("dram", capacity=8, eviction="lru", admission="frequency",
                      admission_options={"threshold": 2}),
             TierSpec("lmdb", capacity=3, eviction="lru")]
    with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
        store.update("t", [5], ONES)  # first sighting: straight into the store of record
        store.update("t", [5], ONES * 2)  # admitted above: dirty, newer than the stored row
        store.update("t", [20, 21, 22, 23], np.full((4, 4), 3, np.float32))  # expire 5 below
        assert store.tier_statistics("t")[1].evictions >= 1
        np.testing.assert_array_equal(store.lookup("t", [5]), ONES * 2)
        store.checkpoint(tmp_path / "ck")  # its flush writes 5 back
        live = store.lookup("t", [5, 20, 21, 22, 23])
        assert store.num_rows("t") == 3
    with embstore.open(tmp_path / "ck", read_only=True) as ck:
        np.testing.assert_array_equal(ck.lookup("t", [5, 20, 21, 22, 23]), live)
        np.testing.assert_array_equal(ck.lookup("t", [5]), ONES * 2)
