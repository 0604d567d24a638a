"""Second-hit admission: a Bloom filter remembers ids seen once; the second sighting gets in."""

from __future__ import annotations

import math
from typing import Any, ClassVar, final

import numpy as np

from embstore.policy import AdmissionPolicy, real_setting, whole_setting

from ._hashing import positions

__all__ = ["SecondHitAdmission"]


@final
class SecondHitAdmission(AdmissionPolicy):
    """Admit an id only if an earlier call already saw it (within about two generations).

    One call is one sighting (duplicates in a call do not make a second). Sightings go into a
    Bloom filter sized for `capacity` ids at false-positive rate `fp_rate`; when it has taken
    `capacity` new ids it becomes the previous generation and a fresh one starts, and lookups
    check both, so memory stays bounded and old sightings are forgotten. A false positive
    admits a first sighting, with probability about `fp_rate`.

    Args:
        capacity: new ids per filter generation, >= 1.
        fp_rate: target false-positive rate of one generation, in (0, 1).
        seed: seeds the hash functions.

    Raises:
        ConfigError: a setting is out of range.
    """

    name: ClassVar[str] = "second_hit"

    def __init__(self, *, capacity: int = 1 << 20, fp_rate: float = 0.01, seed: int = 0) -> None:
        capacity = whole_setting("SecondHitAdmission", "capacity", capacity, 1, 2**40)
        fp_rate = real_setting("SecondHitAdmission", "fp_rate", fp_rate, 0, 1, low_open=True,
                               high_open=True)
        super().__init__(seed=seed)
        self.capacity = int(capacity)
        self.fp_rate = float(fp_rate)
        m = -self.capacity * math.log(self.fp_rate) / math.log(2) ** 2
        self._bits = max(6, math.ceil(math.log2(m)))
        self._k = max(1, round((1 << self._bits) / self.capacity * math.log(2)))
        self._cur = np.zeros(1 << (self._bits - 3), dtype=np.uint8)
        self._prev = np.zeros_like(self._cur)
        self._n_cur = 0

    @staticmethod
    def _has(bits: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return (((bits[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1) == 1).all(axis=0)

    def _admit(self, ids: np.ndarray, now: float) -> np.ndarray:
        uniq, inverse = np.unique(ids, return_inverse=True)
        pos = positions(uniq, self.seed, self._k, self._bits)
        in_cur = self._has(self._cur, pos)
        seen = in_cur | self._has(self._prev, pos)
        new = pos[:, ~in_cur].ravel()
        np.bitwise_or.at(self._cur, new >> 3, (1 << (new & 7)).astype(np.uint8))
        self._n_cur += int(np.count_nonzero(~in_cur))
        if self._n_cur >= self.capacity:
            self._prev, self._cur = self._cur, np.zeros_like(self._cur)
            self._n_cur = 0
        return seen[inverse.reshape(-1)]

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"capacity": self.capacity, "fp_rate": self.fp_rate, "seed": self.seed}
