"""Write-back into the store of record on a second thread, overlapped with the work above it.

A dirty row evicted from the tier just above the bottom must reach the bottom before anyone
can miss it there. `BackgroundWriter` applies those writes in submission order on one
thread, while the caller goes on with the cache tiers on a second core. Only the parts of
`put` that release the GIL overlap the caller's Python: embstore's C kernels do, but
rocksdict's `write` holds the GIL while RocksDB inserts into its memtable (the reason the
demo keeps RocksDB's memtables small). `DrainedBackend` stands for the
bottom backend everywhere else: each use first waits until every queued write is applied, so
every read, flush, statistic or close sees exactly what the synchronous chain would (the same
puts, in the same order: tables stay bit-identical).

A write that fails (a full disk, say) stops the queue with the rows still held. The next use
of the bottom retries the queued writes in order on the calling thread and raises if one fails
again: nothing is dropped, and no read returns a value older than one waiting in the queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any, ClassVar, final

import numpy as np

from . import _crash
from ._unique import unique_first, unique_sorted
from .backend import Backend

__all__ = ["BackgroundWriter", "DrainedBackend"]

MAX_PENDING = 4
"""Batches queued at most; a caller submitting more waits, which bounds the rows held."""


class BackgroundWriter:
    """Applies `backend.put(ids, rows)` calls in order on a daemon thread started on demand.

    The caller hands over `ids` and `rows` and must not change them afterwards.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._jobs: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Queue a write of distinct `ids`.

        Raises (keeping it queued) while an earlier failed write still fails.
        """
        with self._cond:
            self._jobs.append((ids, rows))
            if self._error is None:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="embstore-writeback")
                    self._thread.start()
                self._cond.notify_all()
                while len(self._jobs) > MAX_PENDING and self._error is None:
                    self._cond.wait()
            if self._error is not None:
                self._retry()

    def queued_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Where queued writes hold `ids` (int64[N]): (queued bool[N], their rows [Q, dim]).

        A queued id's row is the one its newest queued write stores, which is what the bottom
        will hold once the queue is applied. None while a failed write waits for its retry.
        """
        with self._cond:
            if self._error is not None:
                return None
            jobs = list(self._jobs)
        # newest first, so that an id's first occurrence is its newest write
        jobs = [job for job in reversed(jobs) if len(job[0])]
        if not jobs:
            return (np.zeros(len(ids), dtype=bool),
                    np.zeros((0, self._backend.spec.dim), self._backend.spec.dtype))
        held, first = unique_first(np.concatenate([job_ids for job_ids, _ in jobs]))
        pos = np.minimum(np.searchsorted(held, ids), len(held) - 1)
        queued = held[pos] == ids
        src = first[pos[queued]]
        starts = np.cumsum([0] + [len(job_ids) for job_ids, _ in jobs])
        job_of = np.searchsorted(starts, src, side="right") - 1
        rows = np.empty((len(src), jobs[0][1].shape[1]), dtype=jobs[0][1].dtype)
        for j in unique_sorted(job_of).tolist():
            sel = np.flatnonzero(job_of == j)
            rows[sel] = jobs[j][1][src[sel] - starts[j]]
        return queued, rows

    def retarget(self, backend: Backend) -> None:
        """Write into `backend` from now on (queued writes too)."""
        with self._cond:
            self._backend = backend

    def drain(self) -> None:
        """Return once every queued write is applied; raises a write that fails again."""
        with self._cond:
            while self._jobs and self._error is None:
                self._cond.wait()
            if self._error is not None:
                self._retry()

    def close(self) -> None:
        """Apply what is queued, then stop the thread (also when a write fails: then raises)."""
        try:
            self.drain()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()

    def _retry(self) -> None:
        # called with the lock held while the thread waits on the error: the queued writes
        # are applied here, in order; the first failure stays queued and is raised
        while self._jobs:
            ids, rows = self._jobs[0]
            self._backend.put(ids, rows)
            self._jobs.popleft()
        self._error = None
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._jobs or self._error is not None) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                ids, rows = self._jobs[0]
            try:
                _crash.point("writeback.before_put")
                self._backend.put(ids, rows)
                _crash.point("writeback.after_put")
            except BaseException as exc:  # held for the caller, which retries and raises it
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                continue
            with self._cond:
                self._jobs.popleft()
                self._cond.notify_all()


@final
class DrainedBackend(Backend):
    """The bottom backend as the rest of the store sees it while a `BackgroundWriter` writes.

    A `Backend` whose every use waits for the queued writes first.

    `wrapped` is the backend itself, for the writer and for instrumentation. Closing the view
    applies what is queued, stops the writer, then closes `wrapped` (also when a write fails:
    the failure is raised after).
    """

    name: ClassVar[str] = "drained"
    # its own flush fails on a queued write, which is retried; the medium's failed sync
    # bars the wrapped backend's later flushes
    bars_flush_after_failure: ClassVar[bool] = False

    def __init__(self, backend: Backend, writer: BackgroundWriter) -> None:
        super().__init__(backend.spec)
        self.wrapped = backend
        self._writer = writer

    def drain(self) -> None:
        """Return once every queued write is applied (raises a write that fails again)."""
        self._writer.drain()

    def writer_backend(self, backend: Backend) -> None:
        """Make the writer write into `backend` from now on (for fault injection).

        Call after `drain()`; `backend` must stand for `wrapped` (a wrapper of it).
        """
        self._writer.retarget(backend)

    def _queued(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """`BackgroundWriter.queued_rows`, where the medium serves reads beside the writer.

        Else None, once the queue is drained (which retries and raises a failed write).
        """
        queued = (self._writer.queued_rows(ids) if self.wrapped.supports_concurrent_reads
                  else None)
        if queued is None:
            self._writer.drain()
        return queued

    def _get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        queued = self._queued(ids)
        if queued is None or not queued[0].any():
            return self.wrapped.get(ids)
        mask, queued_rows = queued
        rows = np.empty((len(ids), self.spec.dim), dtype=self.spec.dtype)
        found = np.ones(len(ids), dtype=bool)
        rows[mask] = queued_rows
        rest = np.flatnonzero(~mask)
        if len(rest):
            rows[rest], found[rest] = self.wrapped.get(np.ascontiguousarray(ids[rest]))
        return rows, found

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self._writer.drain()
        self.wrapped.put(ids, rows)

    def _delete(self, ids: np.ndarray) -> np.ndarray:
        self._writer.drain()
        return self.wrapped.delete(ids)

    def _contains(self, ids: np.ndarray) -> np.ndarray:
        queued = self._queued(ids)
        if queued is None or not queued[0].any():
            return self.wrapped.contains(ids)
        found = queued[0].copy()
        rest = np.flatnonzero(~found)
        if len(rest):
            found[rest] = self.wrapped.contains(np.ascontiguousarray(ids[rest]))
        return found

    def _refresh(self) -> None:
        self._writer.drain()
        self.wrapped.refresh()

    def _ids(self) -> np.ndarray:
        self._writer.drain()
        return self.wrapped.ids()

    def _items(self, batch_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        self._writer.drain()
        pages = self.wrapped.items(batch_rows)
        while True:
            self._writer.drain()  # writes queued while the caller held a page come first
            page = next(pages, None)
            if page is None:
                return
            yield page

    def _len(self) -> int:
        self._writer.drain()
        return len(self.wrapped)

    def _flush(self) -> None:
        self._writer.drain()
        self.wrapped.flush()

    def _close(self) -> None:
        try:
            self._writer.close()  # queued write-backs first: they are the bottom's rows
        finally:
            self.wrapped.close()

    def nbytes(self) -> int:
        # docstring inherited
        self._writer.drain()
        return self.wrapped.nbytes()

    def statistics(self) -> dict[str, Any]:
        # docstring inherited
        self._check_open()
        self._writer.drain()
        return self.wrapped.statistics()

    def __repr__(self) -> str:
        return f"DrainedBackend({self.wrapped!r})"
