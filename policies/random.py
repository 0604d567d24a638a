"""Uniformly random eviction."""

from __future__ import annotations

from typing import ClassVar, final

import numpy as np

from ._tracked import Tracked, TrackedEviction

__all__ = ["RandomEviction"]


@final
class RandomEviction(TrackedEviction):
    """Evict ids drawn uniformly without replacement from the tracked ones.

    The tracked slots are kept packed in one array (removal moves the last ones into the
    holes), so a draw of n victims costs O(n), not O(tracked).

    Args:
        seed: seeds the numpy Generator that draws the victims.
    """

    name: ClassVar[str] = "random"
    reads_matter: ClassVar[bool] = False

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self._t = Tracked({"pos": (np.int64, -1)})
        self._dense = np.zeros(1024, dtype=np.int32)

    def _record_insert(self, ids: np.ndarray, now: float) -> None:
        before = len(self._t)
        slots = self._t.insert(np.sort(ids))
        fresh = slots[self._t.cols["pos"][slots] < 0]
        end = before + len(fresh)
        if end > len(self._dense):
            grown = np.zeros(max(end, 2 * len(self._dense)), dtype=np.int32)
            grown[:before] = self._dense[:before]
            self._dense = grown
        self._dense[before:end] = fresh
        self._t.cols["pos"][fresh] = np.arange(before, end)

    def _unpack(self, freed: np.ndarray, before: int) -> None:
        # fill the holes below the new length with the survivors above it
        pos = self._t.cols["pos"]
        after = before - len(freed)
        p = pos[freed]
        pos[freed] = -1
        holes = np.sort(p[p < after])
        tail = self._dense[after:before]
        movers = tail[self._t.alive[tail]]
        self._dense[holes] = movers
        pos[movers] = holes

    def _record_remove(self, ids: np.ndarray) -> None:
        before = len(self._t)
        freed = self._t.remove(ids)
        if len(freed):
            self._unpack(freed, before)

    def _choose_victims(self, n: int, now: float) -> np.ndarray:
        before = len(self._t)
        slots = self._dense[self.rng.choice(before, size=n, replace=False)]
        victims = self._t.remove_slots(slots)
        self._unpack(slots, before)
        return victims
