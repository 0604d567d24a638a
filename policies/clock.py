"""CLOCK (second-chance) eviction: FIFO order, a referenced id is passed over once."""

from __future__ import annotations

from typing import Any, ClassVar, final

import numpy as np

from ._tracked import SlotLog, Tracked, TrackedEviction, as_ids

__all__ = ["CLOCKEviction"]


@final
class CLOCKEviction(TrackedEviction):
    """Second chance: the hand evicts the first id whose reference bit is clear.

    The circle is a FIFO log whose head is the hand. An id accessed since the hand last passed
    has its bit set; the hand clears the bit and moves the id behind itself (re-appends it)
    instead of evicting it. Inserted ids start with the bit clear. The hand's sweep is done on
    chunks of the log with numpy, cut at the n-th victim, so a call costs O(entries swept).

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

    def record_insert(self, ids: np.ndarray, now: float) -> None:
        # docstring inherited
        if not len(ids):
            return
        slots = self._t.insert(np.sort(as_ids(ids)))
        self._log.push(slots, self._t.cols["stamp"], self._t.alive)

    def choose_victims(self, n: int, now: float) -> np.ndarray:
        # docstring inherited
        need = min(int(n), len(self))
        ref, stamp, alive = self._t.cols["ref"], self._t.cols["stamp"], self._t.alive
        victims: list[np.ndarray] = []
        while need > 0:
            slots, where, end = self._log.peek_live(max(2 * need, 4096), stamp, alive)
            is_victim = ~ref[slots]
            hit = np.flatnonzero(np.cumsum(is_victim) == need)
            cut = int(hit[0]) + 1 if len(hit) else len(slots)
            swept = slots[:cut]
            chosen = swept[is_victim[:cut]]
            passed = swept[~is_victim[:cut]]
            self._log.advance(int(where[cut - 1]) + 1 if cut < len(slots) else end)
            # second chance: clear the bit and put the id behind the hand
            ref[passed] = False
            self._log.push(passed, stamp, alive)
            if len(chosen):
                victims.append(self._t.remove_slots(chosen))
                need -= len(chosen)
        return np.concatenate(victims) if victims else np.zeros(0, dtype=np.int64)

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"seed": self.seed}
