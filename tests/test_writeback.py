"""The background writer of the bottom tier: order, bounded queue, draining view, shutdown."""

from __future__ import annotations

import threading
import time

import numpy as np

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
