"""A write that follows a read of the same ids reuses the slots the read found (`SlotMemo`).

The slots must never be stale: an id that left the top tier since the read (deleted,
evicted) may have handed its slot to another id, and a caller may change its ids array
between the two calls. In every case the table must equal a store that took the same calls
without the lookup before each write.
"""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, optim
from embstore._slot_memo import SlotMemo
from embstore.index import BucketIdIndex

DIM = 4


def _store(tiers=None):
    spec = TableSpec("t", dim=DIM, optimizer=optim.RowWiseAdagrad(0.1))
    if tiers is None:
        return embstore.open(None, tables=[spec])
    return embstore.open(None, tables=[spec], tiers=tiers)


def _rows(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def _table(store, ids):
    return np.hstack([store.lookup("t", ids), store.lookup_state("t", ids)])


def test_a_write_after_an_id_left_and_its_slot_was_reused_steps_the_right_rows() -> None:
    with_memo, plain = _store(), _store()
    for s in (with_memo, plain):
        s.update("t", np.arange(10), _rows(10))
    batch = np.arange(10)
    with_memo.lookup("t", batch)  # slots of 0..9 remembered
    for s in (with_memo, plain):
        s.delete("t", [3])  # frees id 3's slot ...
        s.update("t", [100], _rows(1, seed=1))  # ... which id 100 takes
    grads = _rows(10, seed=2)
    with_memo.apply_gradients("t", batch, grads)
    plain.apply_gradients("t", batch, grads)
    ids = np.array([*range(10), 100])
    assert np.array_equal(_table(with_memo, ids), _table(plain, ids))
    # a stale slot would have stepped id 100's row with id 3's gradient
    assert np.array_equal(with_memo.lookup("t", [100]), _rows(1, seed=1))


def test_a_write_after_the_caller_changed_its_ids_array_steps_the_new_ids() -> None:
    with_memo, plain = _store(), _store()
    for s in (with_memo, plain):
        s.update("t", np.arange(20), _rows(20))
    batch = np.arange(10, dtype=np.int64)
    with_memo.lookup("t", batch)
    batch += 10  # the same array object, other ids
    grads = _rows(10, seed=3)
    with_memo.apply_gradients("t", batch, grads)
    plain.apply_gradients("t", batch, grads)
    ids = np.arange(20)
    assert np.array_equal(_table(with_memo, ids), _table(plain, ids))


@pytest.mark.parametrize("policy", ["lru", "wtinylfu"])
def test_a_write_after_evictions_from_a_cache_tier_steps_the_right_rows(tmp_path, policy,
                                                                        monkeypatch) -> None:
    tiers = (TierSpec("dram", capacity=12, eviction=policy), TierSpec("rocksdb"))
    stores = [embstore.open(tmp_path / name, tables=[TableSpec(
        "t", dim=DIM, optimizer=optim.RowWiseAdagrad(0.1))], tiers=tiers)
        for name in ("memo", "plain")]
    with_memo, plain = stores
    for s in stores:
        s.update("t", np.arange(40), _rows(40))
    rng = np.random.default_rng(4)
    recalled = []
    recall = SlotMemo.recall

    def counting(self, index, ids):
        slots = recall(self, index, ids)
        recalled.append(slots is not None)
        return slots

    monkeypatch.setattr(SlotMemo, "recall", counting)
    for step in range(60):
        batch = rng.choice(40, 6, replace=False)
        for _ in range(2):  # the second read finds them all in the cache
            with_memo.lookup("t", batch)
        # sometimes another batch is read in between (a pipeline's next step), and
        # moves rows in and out of the cache
        if step % 2:
            other = rng.choice(40, 6, replace=False)
            for s in stores:
                s.lookup("t", other)
        grads = _rows(6, seed=step)
        for s in stores:
            s.apply_gradients("t", batch, grads)
    monkeypatch.undo()
    assert any(recalled) and not all(recalled)  # both ways were taken
    ids = np.arange(40)
    assert np.array_equal(_table(with_memo, ids), _table(plain, ids))
    for s in stores:
        s.close()


def test_a_remembered_read_is_used_for_the_write_and_then_forgotten(monkeypatch) -> None:
    store = _store()
    store.update("t", np.arange(10), _rows(10))
    chain = store._table("t").chain
    index = chain.tiers[0].slot_backend.index
    batch = np.arange(10)
    store.lookup("t", batch)
    assert chain._slot_memo.recall(index, batch) is not None  # the read was remembered
    store.lookup("t", batch)
    calls = []
    find = BucketIdIndex.find
    monkeypatch.setattr(BucketIdIndex, "find",
                        lambda self, ids: calls.append(len(ids)) or find(self, ids))
    store.apply_gradients("t", batch, _rows(10, seed=5))  # no probe: the read's slots
    assert calls == []
    store.apply_gradients("t", batch, _rows(10, seed=6))  # used once: probes again
    assert calls == [10]


def test_a_read_too_large_for_a_batch_is_not_remembered(monkeypatch) -> None:
    # a read of a whole table must not leave a copy of its ids behind
    from embstore import _slot_memo

    monkeypatch.setattr(_slot_memo, "_MAX_IDS", 8)
    store = _store()
    store.update("t", np.arange(20), _rows(20))
    chain = store._table("t").chain
    index = chain.tiers[0].slot_backend.index
    store.lookup("t", np.arange(9))
    store.lookup("t", np.arange(8))
    assert chain._slot_memo.recall(index, np.arange(9)) is None
    assert chain._slot_memo.recall(index, np.arange(8)) is not None
