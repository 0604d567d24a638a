"""The store's lock: held per page by `items` and by a checkpoint's copy, never between pages;
`num_rows` changes nothing; unlocked prefetch reads of one table may overlap.
"""

from __future__ import annotations

import threading

import numpy as np

import embstore
from embstore import TableSpec, TierSpec


def _in_other_thread(fn) -> bool:  # type: ignore[no-untyped-def]
    """Run `fn` on another thread; whether it finished within 10 s."""
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return done.wait(10)


def test_items_holds_no_lock_between_pages_and_a_caller_may_stop_halfway() -> None:
    with embstore.open(None, tables=[TableSpec("t", dim=4)]) as store:
        store.update("t", np.arange(100), np.ones((100, 4), np.float32))
        pages = store.items("t", batch_rows=10)
        ids, weights, _ = next(pages)
        assert len(ids) == 10 and (weights == 1).all()
        # the caller holds a page: another thread still reads and writes
        assert _in_other_thread(lambda: store.lookup("t", np.arange(5)))
        assert _in_other_thread(lambda: store.update("t", [500], np.zeros((1, 4), np.float32)))
        del pages  # stopped halfway: nothing stays locked
        assert _in_other_thread(lambda: store.num_rows("t"))


def test_items_pages_cover_every_row_once() -> None:
    with embstore.open(None, tables=[TableSpec("t", dim=2)],
                       tiers=[TierSpec("dram", capacity=8, eviction="lru"),
                              TierSpec("dram")]) as store:
        store.update("t", np.arange(50), np.ones((50, 2), np.float32))
        seen = np.concatenate([ids for ids, _, _ in store.items("t", batch_rows=7)])
        assert sorted(seen.tolist()) == list(range(50))


def test_num_rows_counts_dirty_cache_rows_without_writing_them_back(tmp_path) -> None:
    tiers = [TierSpec("dram", capacity=100, eviction="lru"), TierSpec("lmdb")]
    with embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=2)], tiers=tiers) as store:
        store.update("t", np.arange(10), np.ones((10, 2), np.float32))
        store.flush()  # 0..9 in the bottom too
        store.update("t", np.arange(5, 20), np.ones((15, 2), np.float32))  # 10..19 only above
        before = store.tier_statistics("t")
        assert store.num_rows("t") == 20
        after = store.tier_statistics("t")
        assert after[0].writebacks == before[0].writebacks == 10  # the flush's only
        assert after[1].rows == 10  # nothing reached the store of record


def test_a_lookup_completes_while_a_checkpoint_of_a_large_table_is_copying(tmp_path) -> None:
    import embstore.checkpoint as ck_mod

    n = 4 * ck_mod.BATCH_ROWS  # four pages
    tiers = [TierSpec("dram", capacity=1000, eviction="lru"), TierSpec("dram")]
    with embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=4)], tiers=tiers) as store:
        store.update("t", np.arange(n), np.ones((n, 4), np.float32))
        completed: list[tuple[int, bool]] = []

        def progress(table: str, copied: int, total: int) -> None:
            if copied < total:  # the copy is under way, between two pages
                ok = _in_other_thread(lambda: store.lookup("t", np.arange(1000)))
                ok &= _in_other_thread(
                    lambda: store.update("t", [n - 1], np.zeros((1, 4), np.float32)))
                completed.append((copied, ok))

        store.checkpoint(tmp_path / "ck", progress=progress)
        assert len(completed) == 3 and all(ok for _, ok in completed)
    with embstore.open(tmp_path / "ck", read_only=True) as ck:
        assert ck.num_rows("t") == n
        np.testing.assert_array_equal(ck.lookup("t", [n - 1]), np.ones((1, 4), np.float32))


def test_two_threads_may_prefetch_one_table_at_once(tmp_path, monkeypatch) -> None:
    # both unlocked reads are in flight together (a barrier holds each until the other has
    # begun): each thread's end must unregister its own job and promote its own rows
    from embstore import _prefetch

    spec = TableSpec("t", dim=4, init=embstore.init.Constant(1.0))
    tiers = [TierSpec("dram", capacity=1000), TierSpec("rocksdb")]
    ids = np.arange(200, dtype=np.int64)
    rows = np.arange(800, dtype=np.float32).reshape(200, 4)
    with embstore.open(tmp_path / "s", tables=[spec], tiers=tiers) as store:
        store.update("t", ids, rows)
    both_reading = threading.Barrier(2, timeout=10)
    read = _prefetch.PrefetchJob.read

    def read_together(job: _prefetch.PrefetchJob) -> tuple[np.ndarray, np.ndarray]:
        both_reading.wait()
        return read(job)

    monkeypatch.setattr(_prefetch.PrefetchJob, "read", read_together)
    with embstore.open(tmp_path / "s") as store:  # caches start empty: every row below
        missing: list[int] = []
        errors: list[BaseException] = []

        def prefetch(part: np.ndarray) -> None:
            try:
                missing.append(store.prefetch("t", part))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        workers = [threading.Thread(target=prefetch, args=(part,))
                   for part in (ids[:90], ids[90:])]
        for w in workers:
            w.start()
        for w in workers:
            w.join(20)
        assert not errors and sorted(missing) == [90, 110]
        chain = store._tables["t"].chain
        assert not chain.watchers
        assert chain.tiers[0].backend.contains(ids).all()
        np.testing.assert_array_equal(store.lookup("t", ids), rows)
