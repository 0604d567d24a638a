"""Which rows of a cache tier are dirty (newer than the tier below): two ways to keep the set.

`DirtyIds` keys the set by id in its own hash table and serves any backend. `DirtySlots`
keeps one bit per slot of a `SupportsSlots` backend's own index: the tier already knows the
slots of the rows it writes and evicts, so marking, testing and clearing a batch cost no hash
probe. Both take the slots where the caller has them (None otherwise).
"""

from __future__ import annotations

import numpy as np

from .index import IdIndex

__all__ = ["DirtyIds", "DirtySet", "DirtySlots"]


class DirtyIds:
    """Dirty ids in a private hash table."""

    def __init__(self) -> None:
        self._ids = IdIndex()

    def mark(self, ids: np.ndarray, slots: np.ndarray | None) -> None:
        """Mark distinct `ids` dirty."""
        self._ids.add(ids)

    def which(self, ids: np.ndarray,
              slots: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(dirty bool[N], slots or None) of distinct `ids` (at `slots`, where known)."""
        return self._ids.find(ids) >= 0, None

    def clear(self, ids: np.ndarray, slots: np.ndarray | None) -> None:
        """Forget distinct `ids` (clean or gone)."""
        self._ids.remove(ids)

    def items(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids, slots or None) of every dirty row."""
        return self._ids.items()[0], None


class DirtySlots:
    """Dirty rows as one bit per slot of the backend's index (`SupportsSlots.index`).

    A slot's bit is cleared whenever its id leaves the tier (eviction, delete), before the
    backend frees the slot for another id.
    """

    def __init__(self, index: IdIndex) -> None:
        self._index = index
        # never empty: an absent id's slot (-1) then reads the last bit, which `which` masks
        self._bits = np.zeros(1024, dtype=bool)

    def _slots(self, ids: np.ndarray, slots: np.ndarray | None) -> np.ndarray:
        if slots is None:
            slots = self._index.find(ids)
        high = self._index.high_water
        if high > len(self._bits):
            grown = np.zeros(max(high, 2 * len(self._bits), 1024), dtype=bool)
            grown[: len(self._bits)] = self._bits
            self._bits = grown
        return slots

    def mark(self, ids: np.ndarray, slots: np.ndarray | None) -> None:
        """Mark distinct `ids` (held by the backend, at `slots` if given) dirty."""
        slots = self._slots(ids, slots)  # first: it may replace the bit array
        self._bits[slots] = True

    def which(self, ids: np.ndarray,
              slots: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Dirty bits and slots of distinct `ids` held by the backend.

        Returns (dirty bool[N], slots int32[N]); `slots` are used where known.
        """
        slots = self._slots(ids, slots)
        return self._bits[slots] & (slots >= 0), slots

    def clear(self, ids: np.ndarray, slots: np.ndarray | None) -> None:
        """Forget distinct `ids`; absent ones (slot -1) are skipped."""
        slots = self._slots(ids, slots)
        self._bits[slots[slots >= 0]] = False

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of every dirty row."""
        ids, slots = self._index.items()
        slots = self._slots(ids, slots)  # first: it may replace the bit array
        dirty = self._bits[slots]
        return ids[dirty], slots[dirty]


DirtySet = DirtyIds | DirtySlots
