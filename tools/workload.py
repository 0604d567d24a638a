"""Synthetic id workloads for benchmarks and demos: bounded Zipf draws over scattered ids."""

from __future__ import annotations

import numpy as np

__all__ = ["ZipfIds"]


class ZipfIds:
    """Draws ids whose ranks follow a Zipf(a) law bounded to `n_rows` distinct ids.

    Rank r (0 = hottest) has probability proportional to 1 / (r + 1)**a. Ranks map to ids
    through a seeded permutation of scattered int64 values, so hot ids are spread over the id
    space as hashed production ids are.

    Attributes:
        ids: int64[n_rows], the id of each rank.
    """

    def __init__(self, n_rows: int, a: float = 1.05, *, seed: int = 0) -> None:
        self.n_rows = n_rows
        self.a = a
        rng = np.random.default_rng(seed)
        weights = 1.0 / np.arange(1, n_rows + 1, dtype=np.float64) ** a
        self._cdf = np.cumsum(weights)
        self._cdf /= self._cdf[-1]
        # distinct scattered ids: a random odd multiplier is a bijection on 64-bit words
        mult = np.uint64(rng.integers(1, 2**62) * 2 + 1)
        self.ids = (np.arange(n_rows, dtype=np.uint64) * mult).view(np.int64)
        self._rng = rng

    def ranks(self, size: int) -> np.ndarray:
        """int64[size] ranks (row positions in a dense table) drawn from the Zipf law."""
        u = self._rng.random(size)
        return np.minimum(np.searchsorted(self._cdf, u), self.n_rows - 1).astype(np.int64)
