"""Large batches split over threads give the bits of one thread, and undo as one call does."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, _parallel, optim
from embstore.errors import ConfigError, NonFiniteValueError

ROWS = 3 * _parallel.MIN_ROWS_PER_THREAD + 1000  # splits into 3 ranges at 3 or more threads


@pytest.fixture
def threads():
    before = embstore.get_num_threads()
    yield embstore.set_num_threads
    embstore.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, "2", 1.5, True, None])
def test_a_thread_count_that_is_not_a_whole_number_from_1_is_refused(threads, bad):
    with pytest.raises(ConfigError, match="whole number"):
        threads(bad)


def test_the_environment_variable_sets_the_default(monkeypatch):
    monkeypatch.setenv("EMBSTORE_NUM_THREADS", "3")
    assert _parallel._default_threads() == 3
    monkeypatch.setenv("EMBSTORE_NUM_THREADS", "many")
    with pytest.raises(ConfigError, match="EMBSTORE_NUM_THREADS"):
        _parallel._default_threads()


@pytest.mark.parametrize("n, count", [(10, 4), (4 * _parallel.MIN_ROWS_PER_THREAD + 3, 4),
                                      (5 * _parallel.MIN_ROWS_PER_THREAD, 2)])
def test_ranges_cover_every_row_once_in_order(threads, n, count):
    threads(count)
    parts = _parallel.run_ranges(n, lambda start, stop: (start, stop))
    assert [start for start, _ in parts] == [r[0] for _, r in parts]
    covered = np.concatenate([np.arange(a, b) for _, (a, b) in parts])
    assert np.array_equal(covered, np.arange(n))
    assert len(parts) == min(count, max(1, n // _parallel.MIN_ROWS_PER_THREAD))


def test_an_error_in_any_range_is_raised_after_all_ranges_end(threads):
    threads(4)
    ended = []

    def work(start, stop):
        if start:
            raise ValueError(f"range {start}")
        ended.append(start)
        return start

    with pytest.raises(ValueError, match="range"):
        _parallel.run_ranges(4 * _parallel.MIN_ROWS_PER_THREAD, work)
    assert ended == [0]


def _train(count: int, threads, tiers) -> tuple[np.ndarray, np.ndarray]:
    threads(count)
    rng = np.random.default_rng(7)
    spec = TableSpec("t", dim=16, optimizer=optim.RowWiseAdagrad(lr=0.05))
    with embstore.open(None, tables=[spec], tiers=tiers) as store:
        ids = rng.permutation(10 * ROWS)[:ROWS] * 7919 + 13  # hashed ids: the bucket index
        store.update("t", ids, rng.standard_normal((ROWS, 16)).astype(np.float32))
        for _ in range(3):
            batch = rng.choice(ids, ROWS)
            store.apply_gradients("t", batch, rng.standard_normal((ROWS, 16)).astype(np.float32))
        return store.lookup("t", ids), store.lookup_state("t", ids)


@pytest.mark.parametrize("tiers", [None, [TierSpec("dram", capacity=ROWS // 2, eviction="lru"),
                                          TierSpec("dram")]], ids=["dram", "dram-over-dram"])
def test_tables_are_bit_identical_whatever_the_thread_count(threads, tiers):
    tiers = tiers or [TierSpec("dram")]
    weights1, state1 = _train(1, threads, tiers)
    weights4, state4 = _train(4, threads, tiers)
    assert weights1.tobytes() == weights4.tobytes()
    assert state1.tobytes() == state4.tobytes()


@pytest.mark.parametrize("shuffled", [False, True], ids=["slot-order", "shuffled"])
@pytest.mark.parametrize("bad_rows", [[5], [ROWS // 2], [ROWS - 1], [ROWS - 9, 40, 17, ROWS // 2]],
                         ids=str)
def test_an_overflow_in_any_range_undoes_every_range(threads, bad_rows, shuffled):
    # Long ranges are stepped in slot order: in a shuffled batch that is not the batch's
    # order, and the error must still name the batch's first bad row and every range undo.
    threads(3)
    spec = TableSpec("t", dim=4, optimizer=optim.SGD(1.0))
    with embstore.open(None, tables=[spec]) as store:
        ids = np.arange(ROWS) * 31 + 5
        rng = np.random.default_rng(3)
        store.update("t", ids, rng.standard_normal((ROWS, 4)).astype(np.float32))
        batch = rng.permutation(ids) if shuffled else ids
        grads = np.full((ROWS, 4), 0.25, np.float32)
        for row in bad_rows:
            store.update("t", batch[row:row + 1], np.full((1, 4), -3e38, np.float32))
            grads[row] = 3e38  # -3e38 - 3e38 overflows in this row alone
        before = store.lookup("t", ids).copy()
        with pytest.raises(NonFiniteValueError, match=f"row {batch[min(bad_rows)]} "):
            store.apply_gradients("t", batch, grads)
        assert store.lookup("t", ids).tobytes() == before.tobytes()


def test_a_pool_outgrown_by_a_larger_batch_still_takes_the_work_of_one_that_holds_it():
    pools = _parallel.ThreadPool("test-kernel")
    held = pools.executor(1)  # a batch split in two got this pool...
    grown = pools.executor(3)  # ...while a larger batch made a larger one
    assert grown is not held
    got = _parallel.run_split([0, 5, 10, 15],
                              lambda a, b: (list(range(a, b)), threading.get_ident()), held)
    assert [ids for ids, _ in got] == [list(range(0, 5)), list(range(5, 10)),
                                       list(range(10, 15))]
    assert got[0][1] == threading.get_ident()
    assert {thread for _, thread in got[1:]} != {threading.get_ident()}  # the held pool ran them


def test_ranges_no_thread_could_be_started_for_run_on_the_calling_thread():
    class NoThreads:
        def submit(self, *args):
            raise RuntimeError("can't start new thread")

    got = _parallel.run_split([0, 2, 4, 6], lambda a, b: (a, b, threading.get_ident()),
                              NoThreads())  # type: ignore[arg-type]
    assert got == [(a, b, threading.get_ident()) for a, b in ((0, 2), (2, 4), (4, 6))]
