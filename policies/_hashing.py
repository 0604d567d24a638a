"""Vectorised 64-bit hashing of int64 ids for sketches and filters."""

from __future__ import annotations

import numpy as np

__all__: list[str] = []

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(ids: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 finaliser of `ids` xor a seed-derived key: uint64[N], well mixed.

    uint64 array arithmetic wraps modulo 2**64 without warnings, which is what the mixer needs.
    """
    x = np.asarray(ids, dtype=np.int64).view(np.uint64) ^ np.uint64(
        (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64)
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def positions(ids: np.ndarray, seed: int, k: int, bits: int) -> np.ndarray:
    """K positions in [0, 2**bits) per id (int64[k, N]), by double hashing h1 + i*h2."""
    h1 = splitmix64(ids, seed)
    h2 = splitmix64(ids, seed + 0x5BD1E995) | np.uint64(1)  # odd: all k positions differ
    i = np.arange(k, dtype=np.uint64)[:, None]
    mask = np.uint64((1 << bits) - 1)
    return ((h1[None, :] + i * h2[None, :]) & mask).astype(np.int64)
