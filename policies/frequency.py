"""Frequency-threshold admission over a count-min sketch, TinyLFU-style aging."""

from __future__ import annotations

from typing import Any, ClassVar, final

import numpy as np

from embstore.errors import ConfigError
from embstore.policy import AdmissionPolicy, whole_setting

from ._hashing import positions

__all__ = ["FrequencyAdmission"]


@final
class FrequencyAdmission(AdmissionPolicy):
    """Admit an id once its estimated access count reaches `threshold`.

    Every call adds its ids (duplicates count) to a count-min sketch of `depth` rows of `width`
    counters; an id's estimate is the minimum of its counters, which never undercounts. After
    `reset_after` additions every counter is halved (TinyLFU's reset), so the estimate tracks
    recent popularity and the sketch does not saturate. Hashing is splitmix64 on numpy
    uint64; updates are one `np.add.at` per call.

    Args:
        threshold: estimated count (this call included) needed to enter, >= 1.
        width: counters per row, a power of two.
        depth: rows (independent hashes), >= 1.
        reset_after: additions between halvings; None means 8 x width.
        seed: seeds the hash functions.

    Raises:
        ConfigError: a setting is out of range.
    """

    name: ClassVar[str] = "frequency"

    def __init__(self, *, threshold: int = 2, width: int = 1 << 18, depth: int = 4,
                 reset_after: int | None = None, seed: int = 0) -> None:
        threshold = whole_setting("FrequencyAdmission", "threshold", threshold, 1, 2**32)
        width = whole_setting("FrequencyAdmission", "width", width, 1, 2**32)
        if width & (width - 1):
            raise ConfigError(f"FrequencyAdmission width must be a power of two, got {width!r}")
        depth = whole_setting("FrequencyAdmission", "depth", depth, 1, 64)
        if reset_after is not None:
            reset_after = whole_setting("FrequencyAdmission", "reset_after", reset_after, 1,
                                        2**63 - 1)
        super().__init__(seed=seed)
        self.threshold = int(threshold)
        self.width = int(width)
        self.depth = int(depth)
        self.reset_after = None if reset_after is None else int(reset_after)
        self._bits = self.width.bit_length() - 1
        self._sketch = np.zeros((self.depth, self.width), dtype=np.uint32)
        self._added = 0

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Estimated recent access counts of `ids` (uint32[N]); does not record them."""
        pos = positions(ids, self.seed, self.depth, self._bits)
        return self._sketch[np.arange(self.depth)[:, None], pos].min(axis=0)

    def _admit(self, ids: np.ndarray, now: float) -> np.ndarray:
        uniq, inverse, counts = np.unique(ids,
                                          return_inverse=True, return_counts=True)
        pos = positions(uniq, self.seed, self.depth, self._bits)
        flat = (pos + (np.arange(self.depth, dtype=np.int64) * self.width)[:, None]).ravel()
        np.add.at(self._sketch.reshape(-1), flat,
                  np.tile(counts.astype(np.uint32), self.depth))
        est = self._sketch.reshape(-1)[flat].reshape(self.depth, -1).min(axis=0)
        self._added += int(counts.sum())
        limit = 8 * self.width if self.reset_after is None else self.reset_after
        if self._added >= limit:
            self._sketch >>= 1
            self._added //= 2
        return (est >= self.threshold)[inverse.reshape(-1)]

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"threshold": self.threshold, "width": self.width, "depth": self.depth,
                "reset_after": self.reset_after, "seed": self.seed}
