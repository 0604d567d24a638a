"""The slots of the latest reads of a top tier, for the writes that follow them.

A training step reads a batch's distinct ids (`lookup`) and, after backward, writes the same
ids (`apply_gradients`). Where the read found every id in a slotted top tier it learnt their
slots; the write can step the rows at those slots without probing the index again, as long
as no id has left the index since (`IdIndex.removals`: an id keeps its slot until it is
removed; inserts and growth move entries, never slots).

A write is matched to a read by the ids' values (a copy is kept, so a caller reusing its
array cannot make a stale match), against the last few reads: a pipeline reads the next
batches between a step's forward and its backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .index import IdIndex

__all__ = ["SlotMemo"]

_KEPT = 4  # reads remembered: a pipeline of depth 2 reads two more batches in between
_MAX_IDS = 1 << 20
"""Larger reads are not remembered: a batch's distinct ids are fewer, and a read of a whole
table (an evaluation, an export) must not leave a copy of its ids behind."""


@dataclass
class _Read:
    index: IdIndex
    removals: int
    ids: np.ndarray
    slots: np.ndarray


class SlotMemo:
    """The ids and slots of the last few reads that found every id in one index."""

    def __init__(self) -> None:
        self._reads: list[_Read] = []

    def remember(self, index: IdIndex, ids: np.ndarray, slots: np.ndarray) -> None:
        """Note that `ids` (every one present) lie at `slots` of `index` now."""
        if len(ids) > _MAX_IDS:
            return
        self._reads.append(_Read(index, index.removals, ids.copy(), slots))
        if len(self._reads) > _KEPT:
            del self._reads[0]

    def recall(self, index: IdIndex, ids: np.ndarray) -> np.ndarray | None:
        """The slots of `ids` in `index` from a remembered read of the same ids, or None.

        A match is used once: the write that follows a read consumes it.
        """
        for k in range(len(self._reads) - 1, -1, -1):
            read = self._reads[k]
            if len(read.ids) != len(ids) or read.index is not index:
                continue
            if read.removals != index.removals:
                del self._reads[k]
                continue
            if np.array_equal(read.ids, ids):
                del self._reads[k]
                return read.slots
        return None
