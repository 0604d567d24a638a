"""The background writer of the bottom tier: order, bounded queue, draining view, shutdown."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from embstore import registry
from embstore._writeback import MAX_PENDING, BackgroundWriter, DrainedBackend
from embstore.backend import BackendSpec


def _dram():  # type: ignore[no-untyped-def]
    return registry.load_backend("dram").open(BackendSpec(path=None, dim=4, table="t"))


def test_writes_land_in_submission_order_and_close_stops_the_thread() -> None:
    backend = _dram()
    writer = BackgroundWriter(backend)
    for k in range(20):  # ids 1 and 2 in every batch: the last write must win
        writer.submit(np.array([1, 2, 10 + k]), np.full((3, 4), k, np.float32))
    writer.drain()
    rows, found = backend.get(np.array([1, 2, 10, 29]))
    assert found.all()
    np.testing.assert_array_equal(rows[:2], np.full((2, 4), 19, np.float32))
    np.testing.assert_array_equal(rows[2:], np.array([[0] * 4, [19] * 4], np.float32))
    thread = writer._thread
    assert thread is not None and thread.is_alive()
    writer.close()
    assert not thread.is_alive()


def test_a_writer_that_falls_behind_holds_at_most_max_pending_batches() -> None:
    backend = _dram()
    writer = BackgroundWriter(backend)
    queued: list[int] = []
    put = backend.put

    def slow_put(ids, rows):  # type: ignore[no-untyped-def]
        queued.append(len(writer._jobs))
        time.sleep(0.005)
        put(ids, rows)

    backend.put = slow_put
    for k in range(4 * MAX_PENDING):
        writer.submit(np.array([k]), np.zeros((1, 4), np.float32))
    writer.close()
    assert len(backend) == 4 * MAX_PENDING
    assert max(queued) <= MAX_PENDING + 1  # the one being written plus the queue


def test_every_use_of_the_drained_view_waits_for_the_queue() -> None:
    backend = _dram()
    writer = BackgroundWriter(backend)
    view = DrainedBackend(backend, writer)
    release = threading.Event()
    put = backend.put

    def held_put(ids, rows):  # type: ignore[no-untyped-def]
        release.wait(5)
        put(ids, rows)

    backend.put = held_put
    writer.submit(np.array([7]), np.ones((1, 4), np.float32))
    threading.Timer(0.05, release.set).start()
    rows, found = view.get(np.array([7]))  # must not read before the write landed
    assert found.all() and (rows == 1).all()
    assert len(view) == 1
    writer.close()


def _held_rocksdb(tmp_path):  # type: ignore[no-untyped-def]
    """A RocksDB medium whose writes wait for `release`, its writer and the drained view."""
    backend = registry.load_backend("rocksdb").open(
        BackendSpec(path=tmp_path / "tier", dim=4, table="t"))
    writer = BackgroundWriter(backend)
    release = threading.Event()
    put = backend.put

    def held_put(ids, rows):  # type: ignore[no-untyped-def]
        assert release.wait(10), "the test never released the writer"
        put(ids, rows)

    return backend, writer, DrainedBackend(backend, writer), release, held_put


def test_a_medium_read_beside_the_writer_answers_queued_ids_from_the_queue(tmp_path) -> None:
    """RocksDB serves reads beside writes: a read does not wait for the queue, and each queued
    id reads as its newest queued write, the others as the medium holds them.
    """
    backend, writer, view, release, held_put = _held_rocksdb(tmp_path)
    backend.put(np.array([1, 2, 3]), np.full((3, 4), -1, np.float32))
    backend.put = held_put
    writer.submit(np.array([2, 5]), np.full((2, 4), 10, np.float32))
    writer.submit(np.array([6, 5]), np.array([[20] * 4, [21] * 4], np.float32))
    try:
        rows, found = view.get(np.array([5, 1, 2, 9, 6, 5]))  # the writer is still held
        np.testing.assert_array_equal(found, [True, True, True, False, True, True])
        np.testing.assert_array_equal(rows[:, 0], [21, -1, 10, 0, 20, 21])
        np.testing.assert_array_equal(view.contains(np.array([9, 6, 3, 2])),
                                      [False, True, True, True])
        assert len(writer._jobs) == 2  # nothing was applied meanwhile
    finally:
        release.set()
    writer.drain()
    rows, found = backend.get(np.array([5, 1, 2, 6]))
    assert found.all()
    np.testing.assert_array_equal(rows[:, 0], [21, -1, 10, 20])
    view.close()


def test_a_read_after_a_failed_write_retries_it_before_reading(tmp_path) -> None:
    """A failed queued write is never overlaid: the read applies the queue in order first,
    and raises when the write fails again.
    """
    backend = registry.load_backend("rocksdb").open(
        BackendSpec(path=tmp_path / "tier", dim=4, table="t"))
    writer = BackgroundWriter(backend)
    view = DrainedBackend(backend, writer)
    put, failures = backend.put, [2]

    def failing_put(ids, rows):  # type: ignore[no-untyped-def]
        if failures[0]:
            failures[0] -= 1
            raise OSError("injected")
        put(ids, rows)

    backend.put = failing_put
    writer.submit(np.array([4]), np.full((1, 4), 4, np.float32))
    deadline = time.monotonic() + 10
    while writer._error is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert writer.queued_rows(np.array([4])) is None  # the failure waits for its retry
    with pytest.raises(OSError, match="injected"):
        view.get(np.array([4]))  # the retry on this thread fails too
    rows, found = view.get(np.array([4]))  # the second retry lands, then the medium is read
    assert found.all() and (rows == 4).all()
    assert not writer._jobs
    view.close()


def test_a_prefetch_promotes_rows_whose_write_back_is_queued_from_the_queue(tmp_path) -> None:
    """Ids evicted dirty and still queued for RocksDB come back up at once, with the queued
    (latest) value, without waiting for the writer; the queue still lands them below.
    """
    import embstore
    from embstore import TableSpec, TierSpec

    tiers = [TierSpec("dram", capacity=4, eviction="fifo"), TierSpec("rocksdb")]
    spec = TableSpec("t", dim=4)
    with embstore.open(tmp_path / "s", tables=[spec], tiers=tiers) as store:
        chain = store._tables["t"].chain
        medium = chain.tiers[-1].backend.wrapped
        release, put = threading.Event(), medium.put

        def held_put(ids, rows):  # type: ignore[no-untyped-def]
            assert release.wait(10), "the test never released the writer"
            put(ids, rows)

        medium.put = held_put
        rows = np.arange(32, dtype=np.float32).reshape(8, 4)
        try:
            store.update("t", np.arange(8), rows)  # ids 0-3 evicted dirty: queued, held
            queued, queued_rows = chain.writer.queued_rows(np.arange(8))
            np.testing.assert_array_equal(queued, np.arange(8) < 4)
            np.testing.assert_array_equal(queued_rows, rows[:4])
            assert store.prefetch("t", np.array([1, 3])) == 2  # does not wait for the writer
            np.testing.assert_array_equal(
                chain.tiers[0].backend.contains(np.array([1, 3])), [True, True])
            assert len(chain.writer._jobs) >= 1  # nothing was drained
            before = chain.tiers[0].counters["misses"]
            np.testing.assert_array_equal(store.lookup("t", np.array([1, 3])), rows[[1, 3]])
            assert chain.tiers[0].counters["misses"] == before  # served from DRAM
        finally:
            release.set()
        store.flush()
        np.testing.assert_array_equal(medium.get(np.arange(4))[0], rows[:4])
