"""Vectorised 64-bit hashing of int64 ids for sketches and filters."""

from __future__ import annotations

from typing import Any

import numpy as np

from embstore._access_log_read import seed_key
from embstore._kernels._policy_kernels import ffi as _ffi
from embstore._kernels._policy_kernels import lib as _kernels

__all__: list[str] = []

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


_SECOND = 0x5BD1E995  # the second hash's seed offset


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
    if sketch.dtype != np.uint8 or sketch.ndim != 2 or not sketch.flags.c_contiguous:
        raise TypeError("a sketch is a C-contiguous uint8 array [depth, 2**bits / 2] of "
                        "4-bit counters")
    depth, width = sketch.shape
    bits = (2 * width).bit_length() - 1
    if 2 * width != 1 << bits:
        raise ValueError(f"a sketch row holds a power of two counters, not {2 * width}")
    return (_ffi.cast("uint8_t *", sketch.ctypes.data), bits, depth,
            _ffi.cast("int64_t *", ids.ctypes.data), len(ids), seed_key(seed),
            seed_key(seed + _SECOND))


def sketch_count(sketch: np.ndarray, ids: np.ndarray, seed: int, top: int) -> None:
    """Add one per occurrence of each of `ids` to its counters in `sketch`, at most `top`.

    `sketch` is uint8[depth, 2**bits / 2], two 4-bit counters a byte (counter i of a row in
    byte i // 2, the low nibble when i is even). An id's counter in row r is counter
    `positions(ids, seed, depth, bits)[r]` of that row: this is ``np.add.at`` over those
    counters and a clip at `top` (<= 15), in C.
    """
    if not 0 <= top <= 15:
        raise ValueError(f"4-bit counters saturate at 15 at most, not {top}")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    _kernels.sketch_count(*_sketch_args(sketch, ids, seed), top)


def sketch_estimate(sketch: np.ndarray, ids: np.ndarray, seed: int) -> np.ndarray:
    """The least of each id's counters in `sketch` (uint8[N]): its count-min estimate."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty(len(ids), dtype=np.uint8)
    _kernels.sketch_estimate(*_sketch_args(sketch, ids, seed),
                             _ffi.cast("uint8_t *", out.ctypes.data))
    return out


def sketch_halve(sketch: np.ndarray) -> None:
    """Halve every 4-bit counter of `sketch` in place (TinyLFU's ageing)."""
    np.right_shift(sketch, 1, out=sketch)
    np.bitwise_and(sketch, 0x77, out=sketch)  # drop the bit each high nibble shifted down
