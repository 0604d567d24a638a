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


def test_close_waits_for_a_prefetch_reading_the_store_of_record(tmp_path, monkeypatch) -> None:
    """close() during a prefetch's unlocked read closes the tiers only after the read ends."""
    import threading

    from embstore import _prefetch

    tiers = [TierSpec("dram", capacity=8, eviction="lru"), TierSpec("rocksdb")]
    path = tmp_path / "s"
    store = embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=tiers)
    rows = np.arange(256, dtype=np.float32).reshape(64, 4)
    store.bulk_load("t", np.arange(64), rows)
    store.update("t", np.arange(4), -rows[:4])  # dirty rows: close writes them back
    reading, release = threading.Event(), threading.Event()
    read = _prefetch.PrefetchJob.read

    def slow_read(job: _prefetch.PrefetchJob) -> tuple[np.ndarray, np.ndarray]:
        reading.set()
        assert release.wait(10)
        return read(job)

    monkeypatch.setattr(_prefetch.PrefetchJob, "read", slow_read)
    errors: list[BaseException] = []

    def run(fn) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    fetcher = threading.Thread(target=run, args=(lambda: store.prefetch("t", np.arange(8, 64)),))
    fetcher.start()
    assert reading.wait(10)
    closer = threading.Thread(target=run, args=(store.close,))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() went on while a prefetch read the store of record"
    release.set()
    fetcher.join(10)
    closer.join(10)
    assert not errors, errors
    assert store.closed
    with embstore.open(path) as again:
        expected = rows.copy()
        expected[:4] *= -1
        np.testing.assert_array_equal(again.lookup("t", np.arange(64)), expected)


class _Interrupted(BaseException):
    """Stands for Ctrl-C arriving inside a prefetch."""


@pytest.mark.parametrize("where", ["begin", "watch", "read"])
def test_a_prefetch_cut_short_leaves_no_job_watching_and_close_does_not_wait_for_it(
        tmp_path, monkeypatch, where: str) -> None:
    # right after the job was made, right after it was registered, or while it reads: the
    # chain must stop telling it of writes, and close() must not wait for a read that is over
    import threading

    from embstore import _prefetch

    tiers = [TierSpec("dram", capacity=8, eviction="lru"), TierSpec("rocksdb")]
    store = embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=4)], tiers=tiers)
    store.bulk_load("t", np.arange(64), np.ones((64, 4), np.float32))
    chain = store._tables["t"].chain
    real = {"begin": _prefetch.begin, "watch": _prefetch.watch,
            "read": _prefetch.PrefetchJob.read}[where]

    def interrupted(*args):
        real(*args)
        raise _Interrupted

    monkeypatch.setattr(_prefetch.PrefetchJob if where == "read" else _prefetch, where,
                        interrupted)
    with pytest.raises(_Interrupted):
        store.prefetch("t", np.arange(20, 40))
    monkeypatch.undo()
    assert chain.watchers == []
    assert store.prefetch("t", np.arange(40, 50)) == 10  # later prefetches go on
    closing = threading.Thread(target=store.close)
    closing.start()
    closing.join(10)
    assert not closing.is_alive() and store.closed
