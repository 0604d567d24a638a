"""Prefetching rows from the store of record without holding the store's lock.

A pipeline brings the next batches' rows up into a table's DRAM tier while the current batch
trains. Reading them from the bottom tier (RocksDB, LMDB) is the slow part, and a read under
the store's lock would stall the training thread's own calls for as long. So the read runs
unlocked, in three steps:

1. `begin` (lock held): the distinct ids the DRAM tier lacks (those it holds count as read
   by its policy, so that promoting later batches' rows does not evict them before their
   batch runs); those with a write-back still queued for the bottom (their stored value is
   not the latest yet) are promoted at once from the queue, which holds the latest, and the
   rest make the job. The caller registers it with the chain (`watch`), which tells it every
   id written to or deleted from the bottom from now on (`TableChain.note_bottom_write`);
2. `read` (no lock): the bottom backend's own `get`, concurrently with the training thread
   and the write-back thread; only backends with `supports_concurrent_reads` are read so;
3. `end` (lock held): rows of ids that were written or deleted meanwhile, or that reached
   the DRAM tier meanwhile (they are newer there), are dropped; the rest are promoted into
   the DRAM tier as clean rows, as a lookup would have promoted them.

So a prefetched row is one the bottom held after every write that reached it before `end`:
what a lookup at `end` would have promoted. Values never depend on prefetching.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .index import IdGroups, IdIndex

if TYPE_CHECKING:
    from .backend import Backend
    from .hierarchy import TableChain

__all__ = ["PrefetchJob", "begin", "end", "watch"]


@dataclass(eq=False)
class PrefetchJob:
    """One unlocked read of a chain's bottom tier, between `begin` and `end`.

    Jobs compare by identity: two threads may prefetch the same table at once, and `end`
    must unregister its own job (a field-wise comparison would compare the id arrays).
    """

    ids: np.ndarray
    """Distinct ids to read (int64)."""
    backend: Backend
    """The bottom tier's own backend (not the draining view)."""
    written: list[np.ndarray] = field(default_factory=list)
    """Ids written to or deleted from the bottom since `watch`."""
    reading: bool = False
    """From `watch` until its caller is done reading: the backend must stay open."""

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """The bottom's rows and found mask of `ids`; call without the store's lock."""
        return self.backend.get(self.ids)


def begin(chain: TableChain, ids: np.ndarray) -> tuple[int, PrefetchJob | None]:
    """Start prefetching `ids` into `chain`'s top tier (the store's lock held).

    Returns the number of distinct ids the top tier lacks, and the job to read them without
    the lock, or None when there is nothing to read or the chain cannot be read so (then the
    rows were brought up under the lock, by `TableChain.bring_up`).
    """
    if len(chain.tiers) == 1:
        return 0, None
    u = IdGroups(np.ascontiguousarray(ids)).unique
    bottom = chain.tiers[-1]
    missing = np.ascontiguousarray(u[~chain.touch_top(u)])
    raw = getattr(bottom.backend, "wrapped", bottom.backend)
    writer = chain.writer
    if (not len(missing) or len(chain.tiers) != 2 or writer is None
            or not raw.supports_concurrent_reads):
        return chain.bring_up(missing), None
    queued = writer.queued_rows(missing)
    if queued is None:  # a failed write-back waits for its retry: read under the lock
        return chain.bring_up(missing), None
    if queued[0].any():
        # their stored value is not the latest yet: the queue's is, and is promoted now
        n = len(missing)
        bottom.counters["lookups"] += len(queued[1])
        bottom.counters["hits"] += len(queued[1])
        chain.promote(np.ascontiguousarray(missing[queued[0]]), queued[1],
                      np.full(len(queued[1]), bottom.level, dtype=np.int64))
        missing = np.ascontiguousarray(missing[~queued[0]])
        if not len(missing):
            return n, None
    return len(missing), PrefetchJob(missing, raw)


def watch(chain: TableChain, job: PrefetchJob) -> None:
    """Tell `job` of every id written to or deleted from `chain`'s bottom from now on.

    Called under the store's lock, after `begin` returned the job: whoever holds the job
    then owns its `end`, which unregisters it, and clears `job.reading` when its read is
    over (the store's close waits for that).
    """
    job.reading = True
    chain.watchers.append(job)


def end(chain: TableChain, job: PrefetchJob, rows: np.ndarray | None,
        found: np.ndarray | None) -> None:
    """Promote what `job` read that is still current (the store's lock held).

    `rows` None: the read failed; the job is only unregistered. A job that is not (or no
    longer) registered is left alone: an interrupt may have come before `watch`.
    """
    if job not in chain.watchers:  # (jobs compare by identity)
        return
    chain.watchers.remove(job)
    if rows is None or found is None:
        return
    keep = found.copy()
    if job.written:
        written = IdGroups(np.ascontiguousarray(np.concatenate(job.written))).unique
        changed = IdIndex(2 * len(written))
        changed.add(written)
        keep &= changed.find(job.ids) < 0
    if keep.any():
        keep[keep] = ~chain.tiers[0].backend.contains(np.ascontiguousarray(job.ids[keep]))
    bottom = chain.tiers[-1]
    hits = int(np.count_nonzero(found))
    bottom.counters["lookups"] += len(job.ids)
    bottom.counters["hits"] += hits
    bottom.counters["misses"] += len(job.ids) - hits
    sel = np.flatnonzero(keep)
    if len(sel):
        level_of = np.full(len(sel), bottom.level, dtype=np.int64)
        chain.promote(np.ascontiguousarray(job.ids[sel]), np.ascontiguousarray(rows[sel]),
                      level_of)
