"""Vectorised 64-bit hashing of int64 ids for sketches and filters."""

from __future__ import annotations

from typing import Any

import numpy as np

from embstore._kernels._policy_kernels import ffi as _ffi
from embstore._kernels._policy_kernels import lib as _kernels

__all__: list[str] = []

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


_SECOND = 0x5BD1E995  # the second hash's seed offset


def seed_key(seed: int) -> int:
    """The key `splitmix64` xors ids with for `seed`."""
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64


def splitmix64(ids: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 finaliser of `ids` xor a seed-derived key: uint64[N], well mixed.

    uint64 array arithmetic wraps modulo 2**64 without warnings, which is what the mixer needs.
    """
    x = np.asarray(ids, dtype=np.int64).view(np.uint64) ^ np.uint64(seed_key(seed))
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def positions(ids: np.ndarray, seed: int, k: int, bits: int) -> np.ndarray:
    """K positions in [0, 2**bits) per id (int64[k, N]), by double hashing h1 + i*h2."""
    h1 = splitmix64(ids, seed)
    h2 = splitmix64(ids, seed + _SECOND) | np.uint64(1)  # odd: all k positions differ
    i = np.arange(k, dtype=np.uint64)[:, None]
    mask = np.uint64((1 << bits) - 1)
    return ((h1[None, :] + i * h2[None, :]) & mask).astype(np.int64)


def _sketch_args(sketch: np.ndarray, ids: np.ndarray, seed: int) -> tuple[Any, ...]:
    if sketch.dtype != np.uint16 or sketch.ndim != 2 or not sketch.flags.c_contiguous:
        raise TypeError("a sketch is a C-contiguous uint16 array [depth, 2**bits]")
    depth, width = sketch.shape
    bits = width.bit_length() - 1
    if width != 1 << bits:
        raise ValueError(f"a sketch row holds a power of two counters, not {width}")
    return (_ffi.cast("uint16_t *", sketch.ctypes.data), bits, depth,
            _ffi.cast("int64_t *", ids.ctypes.data), len(ids), seed_key(seed),
            seed_key(seed + _SECOND))


def sketch_count(sketch: np.ndarray, ids: np.ndarray, seed: int, top: int) -> None:
    """Add one per occurrence of each of `ids` to its counters in `sketch`, at most `top`.

    `sketch` is uint16[depth, 2**bits]; an id's counter in row r is at `positions(ids, seed,
    depth, bits)[r]`, so this is ``np.add.at`` over those cells and a clip at `top`, in C.
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    _kernels.sketch_count(*_sketch_args(sketch, ids, seed), top)


def sketch_estimate(sketch: np.ndarray, ids: np.ndarray, seed: int) -> np.ndarray:
    """The least of each id's counters in `sketch` (uint16[N]): its count-min estimate."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty(len(ids), dtype=np.uint16)
    _kernels.sketch_estimate(*_sketch_args(sketch, ids, seed),
                             _ffi.cast("uint16_t *", out.ctypes.data))
    return out
