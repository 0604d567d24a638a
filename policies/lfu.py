"""Least-frequently-used eviction with aging."""

from __future__ import annotations

import math
from typing import Any, ClassVar, final

import numpy as np

from embstore.policy import EvictionPolicy

from ._tracked import Tracked, as_ids, smallest

__all__ = ["LFUEviction"]


@final
class LFUEviction(EvictionPolicy):
    """Evict the ids with the fewest accesses; counts age so that old popularity fades.

    Each tracked id has a count: 1 on insert, +1 per access (duplicates in a batch count).
    Every `aging_period` units of `now` all counts are multiplied by `aging_factor` (0.5
    halves them, as in TinyLFU's reset; a factor near 1 is a slow exponential decay).
    Victims are the smallest counts, ties going to the least recently used, then the lowest
    id. A choice costs one O(tracked) partition: LFU order changes on every access, and a
    heap or bucket list per id would mean Python objects or per-id loops.

    Args:
        aging_period: time between agings, in units of `now`; None disables aging.
        aging_factor: multiplier applied to every count each period, in (0, 1].
        seed: kept for the common interface; LFU uses no randomness.

    Raises:
        ValueError: a setting is out of range.
    """

    name: ClassVar[str] = "lfu"

    def __init__(self, *, aging_period: float | None = 100.0, aging_factor: float = 0.5,
                 seed: int = 0) -> None:
        if aging_period is not None and not aging_period > 0:
            raise ValueError(f"LFUEviction aging_period must be > 0 or None, got {aging_period!r}")
        if not 0 < aging_factor <= 1:
            raise ValueError(f"LFUEviction aging_factor must be in (0, 1], got {aging_factor!r}")
        super().__init__(seed=seed)
        self.aging_period = None if aging_period is None else float(aging_period)
        self.aging_factor = float(aging_factor)
        self._t = Tracked({"count": (np.float64, 0.0), "seen": (np.int64, 0)})
        self._epoch: int | None = None  # index of the aging period of the last call
        self._calls = 0

    def __len__(self) -> int:
        return len(self._t)

    def _age(self, now: float) -> None:
        if self.aging_period is None:
            return
        epoch = math.floor(now / self.aging_period)
        if self._epoch is not None and epoch > self._epoch:
            hw = self._t.index.high_water
            self._t.cols["count"][:hw] *= self.aging_factor ** (epoch - self._epoch)
        self._epoch = epoch if self._epoch is None else max(epoch, self._epoch)

    def record_access(self, ids: np.ndarray, now: float) -> None:
        # docstring inherited
        self._age(now)
        slots = self._t.find(ids)
        if not len(slots):
            return
        self._calls += 1
        uniq, counts = np.unique(slots, return_counts=True)
        self._t.cols["count"][uniq] += counts
        self._t.cols["seen"][uniq] = self._calls

    def record_insert(self, ids: np.ndarray, now: float) -> None:
        # docstring inherited
        self._age(now)
        if not len(ids):
            return
        self._calls += 1
        slots = self._t.insert(as_ids(ids))
        self._t.cols["count"][slots] = 1.0
        self._t.cols["seen"][slots] = self._calls

    def record_remove(self, ids: np.ndarray) -> None:
        # docstring inherited
        self._t.remove(ids)

    def choose_victims(self, n: int, now: float) -> np.ndarray:
        # docstring inherited
        self._age(now)
        n = min(int(n), len(self))
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        live = np.flatnonzero(self._t.alive[: self._t.index.high_water])
        chosen = smallest(live, self._t.cols["count"], self._t.cols["seen"], self._t.ids, n)
        return self._t.remove_slots(chosen)

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"aging_period": self.aging_period, "aging_factor": self.aging_factor,
                "seed": self.seed}
