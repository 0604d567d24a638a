"""First-in first-out eviction: insertion order only, accesses change nothing."""

from __future__ import annotations

from typing import ClassVar, final

import numpy as np

from ._tracked import SlotLog, Tracked, TrackedEviction

__all__ = ["FIFOEviction"]


@final
class FIFOEviction(TrackedEviction):
    """Evict the ids inserted longest ago (ids inserted in one call leave in id order).

    Args:
        seed: kept for the common interface; FIFO uses no randomness.
    """

    name: ClassVar[str] = "fifo"
    reads_matter: ClassVar[bool] = False  # FIFO order ignores accesses by definition

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self._t = Tracked({"stamp": (np.int64, 0)})
        self._log = SlotLog()

    def _record_insert(self, ids: np.ndarray, now: float) -> None:
        ids = np.sort(ids)
        slots = self._t.insert(ids)
        self._log.push(slots, self._t.cols["stamp"], self._t.alive)

    def _choose_victims(self, n: int, now: float) -> np.ndarray:
        return self._pop_oldest(self._log, n)
