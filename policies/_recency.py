"""The recency log shared by LRU and TTL eviction."""

from __future__ import annotations

import numpy as np

from ._tracked import SlotLog, Tracked, TrackedEviction

__all__: list[str] = []


class RecencyEviction(TrackedEviction):
    """Evict the ids whose last access or insert is oldest (base of LRU and TTL).

    Recency is the order of calls (the tier's `now` never decreases); ids touched in one call
    are ordered by first occurrence in the call, so ties break deterministically. Each access
    appends the slot to a log and makes its older entry stale, so an access batch costs
    O(batch) and a victim scan O(victims + stale entries), not an O(tracked) partition.
    """

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self._t = Tracked({"stamp": (np.int64, 0), "time": (np.float64, 0.0)})
        self._log = SlotLog()

    def _touch(self, slots: np.ndarray, now: float) -> None:
        # one pass in C; a repeat within the call is known by its stamp, no hashed dedupe
        self._log.touch(slots, self._t.cols["stamp"], self._t.alive, self._t.cols["time"],
                        float(now))

    def _access(self, slots: np.ndarray, now: float) -> None:
        self._touch(slots, now)

    def _record_insert(self, ids: np.ndarray, now: float) -> None:
        self._touch(self._t.insert(ids), now)

    def _choose_victims(self, n: int, now: float) -> np.ndarray:
        return self._pop_oldest(self._log, n)

    def _expire_before(self, limit: float) -> np.ndarray:
        """Untrack and return the ids last touched at a time <= `limit`, oldest first."""
        taken: list[np.ndarray] = []
        while len(self):
            # the log is in call order and `now` never decreases, so times rise along it
            slots, where, end = self._log.peek_live(
                max(1024, len(self) // 16), self._t.cols["stamp"], self._t.alive
            )
            if not len(slots):
                break
            old = self._t.cols["time"][slots] <= limit
            k = int(np.argmin(old)) if not old.all() else len(slots)
            if k:
                taken.append(self._t.remove_slots(slots[:k]))
            if k < len(slots):
                self._log.advance(int(where[k]))
                break
            self._log.advance(end)
        return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
