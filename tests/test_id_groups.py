"""`IdGroups` (distinct ids, inverse, last positions) agrees with numpy on every batch, with its
grouping table reused across batches of any size, across threads and past an epoch wrap.
"""

from __future__ import annotations

import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from embstore import index
from embstore.index import IdGroups


def _check(ids: np.ndarray) -> None:
    g = IdGroups(ids)
    first = np.unique(ids, return_index=True)[1]
    np.testing.assert_array_equal(g.unique, ids[np.sort(first)])  # first-occurrence order
    np.testing.assert_array_equal(g.unique[g.inverse], ids)
    for k, i in enumerate(g.unique.tolist()):
        assert g.last[k] == np.flatnonzero(ids == i)[-1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(0, 40), max_size=300),
                min_size=1, max_size=6))
def test_groups_match_numpy_batch_after_batch(batches: list[list[int]]) -> None:
    # one thread's table serves every batch: a slot a larger earlier batch filled must read
    # as empty to a later, smaller one
    for ids in batches:
        _check(np.array(ids, dtype=np.int64))


def test_a_batch_larger_than_the_kept_table_is_grouped_in_its_own(monkeypatch) -> None:
    monkeypatch.setattr(index, "_group_tables", threading.local())
    monkeypatch.setattr(index, "_KEPT_GROUP_SLOTS", 64)
    rng = np.random.default_rng(0)
    small = rng.integers(0, 20, 25)
    _check(small)
    kept = index._group_tables.table
    _check(rng.integers(0, 500, 400))  # needs 1024 slots, more than the 64 kept
    assert index._group_tables.table is kept
    _check(small)


def test_the_epoch_wraps_to_a_cleared_table(monkeypatch) -> None:
    monkeypatch.setattr(index, "_group_tables", threading.local())
    ids = np.array([5, 7, 5, 9], dtype=np.int64)
    _check(ids)
    index._group_tables.epoch = 0xFFFFFFFF  # the next batch would need epoch 2**32
    _check(np.array([9, 5, 1], dtype=np.int64))
    assert index._group_tables.epoch == 1
    _check(ids)


def test_threads_group_at_once_each_with_its_own_table() -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4, timeout=10)

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            start.wait()
            for _ in range(50):
                _check(rng.integers(0, 300, int(rng.integers(1, 400))))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors
