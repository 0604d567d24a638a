"""`embstore.testing.FaultyBackend`, and the background writer's failure, retry and shutdown
paths driven by it.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

from embstore import registry
from embstore._writeback import BackgroundWriter, DrainedBackend
from embstore.backend import Backend, BackendSpec
from embstore.errors import CapacityError, ConfigError
from embstore.testing import METHODS, FaultyBackend

DIM = 4


def _dram() -> Backend:
    return registry.load_backend("dram").open(BackendSpec(path=None, dim=DIM, table="t"))


def _rows(value: float, n: int = 1) -> np.ndarray:
    return np.full((n, DIM), value, np.float32)


def test_the_nth_call_fails_once_and_changes_nothing() -> None:
    faulty = FaultyBackend(_dram(), method="put", nth=2)
    faulty.put(np.array([1]), _rows(1))
    with pytest.raises(OSError) as info:
        faulty.put(np.array([2]), _rows(2))
    assert info.value.errno == errno.EIO
    faulty.put(np.array([3]), _rows(3))  # transient: the next call goes through
    assert sorted(faulty.ids().tolist()) == [1, 3]
    assert (faulty.calls, faulty.faults) == (3, 1)


def test_a_persistent_fault_fails_every_later_call_until_disarmed() -> None:
    faulty = FaultyBackend(_dram(), method="get", nth=1, persistent=True,
                           error=CapacityError("injected"))
    faulty.put(np.array([1]), _rows(1))
    for _ in range(3):
        with pytest.raises(CapacityError):
            faulty.get(np.array([1]))
    faulty.disarm()
    rows, found = faulty.get(np.array([1]))
    assert found.all() and (rows == 1).all()
    assert faulty.faults == 3


@pytest.mark.parametrize("method", METHODS)
def test_every_method_can_be_failed(method: str) -> None:
    faulty = FaultyBackend(_dram(), method=method, persistent=True)
    ids = np.array([1])
    calls = {"get": lambda: faulty.get(ids), "put": lambda: faulty.put(ids, _rows(1)),
             "delete": lambda: faulty.delete(ids), "contains": lambda: faulty.contains(ids),
             "ids": faulty.ids, "items": lambda: faulty.items(), "flush": faulty.flush,
             "len": lambda: len(faulty), "close": faulty.close}
    with pytest.raises(OSError):
        calls[method]()
    if method == "close":
        assert faulty.is_closed and faulty.wrapped.is_closed  # closed all the same


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="method"):
        FaultyBackend(_dram(), method="scan")
    with pytest.raises(ConfigError, match="nth"):
        FaultyBackend(_dram(), method="put", nth=0)


def test_a_transient_write_back_failure_is_retried_and_nothing_is_lost() -> None:
    faulty = FaultyBackend(_dram(), method="put", nth=2)
    writer = BackgroundWriter(faulty)
    for k in range(5):  # id 1 in every batch: the last write must win
        writer.submit(np.array([1, 10 + k]), _rows(k, 2))
    writer.drain()  # the retry on this thread succeeds: no error
    rows, found = faulty.wrapped.get(np.array([1, 10, 11, 12, 13, 14]))
    assert found.all()
    np.testing.assert_array_equal(rows[0], _rows(4)[0])
    assert faulty.faults == 1
    writer.close()


def test_a_persistent_write_back_failure_is_raised_and_the_rows_stay_queued() -> None:
    faulty = FaultyBackend(_dram(), method="put", nth=1, persistent=True)
    writer = BackgroundWriter(faulty)
    view = DrainedBackend(faulty, writer)
    writer.submit(np.array([1, 2]), _rows(1, 2))  # fails on the writer's thread
    with pytest.raises(OSError):
        writer.drain()  # retried here, fails again: raised
    with pytest.raises(OSError):
        writer.submit(np.array([1]), _rows(2))  # raised, and kept queued
    with pytest.raises(OSError):
        view.get(np.array([1]))  # no read of an older value: it raises instead
    assert len(faulty.wrapped) == 0  # not applied, not dropped
    faulty.disarm()
    rows, found = view.get(np.array([1, 2]))  # the next use applies the queue in order
    assert found.all()
    np.testing.assert_array_equal(rows, np.concatenate([_rows(2), _rows(1)]))
    view.close()
    assert faulty.wrapped.is_closed


def test_shutdown_with_a_failing_write_raises_stops_the_thread_and_closes_the_medium() -> None:
    faulty = FaultyBackend(_dram(), method="put", nth=1, persistent=True)
    writer = BackgroundWriter(faulty)
    view = DrainedBackend(faulty, writer)
    writer.submit(np.array([5]), _rows(5))
    with pytest.raises(OSError):
        view.close()
    thread = writer._thread
    assert thread is not None and not thread.is_alive()
    assert view.is_closed and faulty.wrapped.is_closed


def test_write_backs_failing_at_every_call_in_turn_end_with_every_row() -> None:
    """Fault loop: fail the 1st put, then the 2nd, ... until a run has no fault; each run
    either succeeds or raises the injected error (a submit that raises keeps its batch), and
    once the medium recovers it holds the rows of every batch submitted, last write winning.
    """
    rng = np.random.default_rng(0)
    batches = [np.unique(rng.integers(0, 50, 20)) for _ in range(8)]
    nth = 0
    while True:
        nth += 1
        faulty = FaultyBackend(_dram(), method="put", nth=nth, persistent=True)
        writer = BackgroundWriter(faulty)
        expected: dict[int, float] = {}
        try:
            for k, ids in enumerate(batches):
                expected.update(dict.fromkeys(ids.tolist(), float(k)))
                writer.submit(ids, _rows(k, len(ids)))
            writer.drain()
        except OSError as exc:
            assert exc.errno == errno.EIO
        faulty.disarm()
        writer.close()
        stored = faulty.wrapped
        ids = np.array(sorted(expected))
        rows, found = stored.get(ids)
        assert found.all() and len(stored) == len(expected), nth
        np.testing.assert_array_equal(rows[:, 0], [expected[i] for i in ids.tolist()])
        if not faulty.faults:
            break
    assert nth == len(batches) + 1
