"""CLOCK (second-chance) eviction: FIFO order, a referenced id is passed over once."""

from __future__ import annotations

from typing import ClassVar, final

import numpy as np

from ._tracked import SlotLog, Tracked, TrackedEviction, slots_by_id

__all__ = ["CLOCKEviction"]


@final
class CLOCKEviction(TrackedEviction):
    """Second chance: the hand evicts the first id whose reference bit is clear.

    The circle is a FIFO log whose head is the hand. An id accessed since the hand last passed
    has its bit set; the hand clears the bit and moves the id behind itself (re-appends it)
    instead of evicting it. Inserted ids start with the bit clear, at the tail. The hand is a
    small C loop over the log (`SlotLog.clock_sweep`), so a call costs O(entries swept).

    Ids inserted in one call enter the log in id order, so its choices do not depend on the
    order of ids within a call, and a tier sharing its backend's index evicts exactly as
    `embstore simulate` predicts. (The order of first occurrence would put a batch's hottest
    new ids at the front, to be evicted first: 5% more misses on the calibrated trace.)

    Args:
        seed: kept for the common interface; CLOCK uses no randomness.
    """

    name: ClassVar[str] = "clock"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self._t = Tracked({"stamp": (np.int64, 0), "ref": (np.bool_, False)})
        self._log = SlotLog()

    def _access(self, slots: np.ndarray, now: float) -> None:
        self._t.cols["ref"][slots] = True

    def _record_insert(self, ids: np.ndarray, now: float) -> None:
        slots = self._t.insert(np.sort(ids))
        self._log.push(slots, self._t.cols["stamp"], self._t.alive)

    def record_insert_slots(self, ids: np.ndarray, slots: np.ndarray, now: float) -> None:
        # docstring inherited
        if len(ids):
            self._t.insert_at(ids, slots, reset=("ref",))  # the log's push sets the stamp
            self._log.push(slots_by_id(ids, slots), self._t.cols["stamp"], self._t.alive)

    def choose_victim_slots(self, n: int, now: float) -> tuple[np.ndarray, np.ndarray]:
        # docstring inherited
        t = self._t
        slots = self._log.clock_sweep(min(int(n), len(t)), len(t), t.cols["stamp"], t.alive,
                                      t.cols["ref"])
        return t.remove_slots(slots), slots

    def _choose_victims(self, n: int, now: float) -> np.ndarray:
        return self.choose_victim_slots(n, now)[0]
