"""Half-precision rows: weights stored as fp16 or bf16, optimizer state as float32.

A table with `TableSpec.precision` "fp16" or "bf16" keeps each row in every tier as bytes:

    offset   size           field
    0        2 * dim        weights, float16 (IEEE binary16) or bfloat16 (the top 16 bits of a
                            float32), little-endian
    2 * dim  4 * state      optimizer state, float32, little-endian

so that every tier holds the same bits and results stay identical whatever the tier layout.
Updates are computed in float32 and rounded back: explicit writes (`update`, `bulk_load`,
initial values) to nearest, ties to even; optimizer steps stochastically, with the random bits
a pure function of (table, id, column, the table's count of gradient steps), as FBGEMM rounds
its FP16 weights. Stochastic rounding keeps small updates from vanishing: a step smaller than
half a unit in the last place moves the weight with a probability proportional to its size,
so updates are unbiased on average instead of being rounded away.
"""

from __future__ import annotations

import zlib

import numpy as np

from ._kernels._half_kernels import ffi, lib
from .init import stream_key

__all__ = ["PRECISIONS", "RowCodec"]

PRECISIONS = ("fp32", "fp16", "bf16")

# the float32 value of every fp16 bit pattern: decoding is one table lookup per weight
_FP16_VALUES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
    .astype(np.float32)


class RowCodec:
    """Encodes float32 rows [N, dim + state] of one half-precision table to stored bytes."""

    def __init__(self, name: str, precision: str, dim: int, state_width: int) -> None:
        self.precision = precision
        self.dim = dim
        self.state_width = state_width
        self.weight_bytes = 2 * dim
        self.row_bytes = 2 * dim + 4 * state_width
        self.seed = zlib.crc32(name.encode())  # the table's part of the rounding seed

    # --- bytes -> float32 ------------------------------------------------------------------

    def _bits(self, raw: np.ndarray) -> np.ndarray:
        """The stored 16-bit weights of rows `raw` (uint8 [N, row_bytes]): uint16 [N, dim]."""
        return np.ascontiguousarray(raw[:, : self.weight_bytes]).view("<u2")

    def stored_weights(self, raw: np.ndarray) -> np.ndarray:
        """Weights as stored: float16 [N, dim], or bfloat16 bit patterns as uint16 [N, dim]."""
        bits = self._bits(raw)
        return bits.view(np.float16) if self.precision == "fp16" else bits

    def _decode_bits(self, bits: np.ndarray) -> np.ndarray:
        out = np.empty(bits.shape, dtype=np.float32)
        if bits.size:
            lib.half_decode(ffi.cast("uint16_t *", bits.ctypes.data), bits.size,
                            int(self.precision == "bf16"),
                            ffi.cast("float *", _FP16_VALUES.ctypes.data),
                            ffi.cast("float *", out.ctypes.data))
        return out

    def decode_weights(self, raw: np.ndarray) -> np.ndarray:
        """float32 [N, dim] weights of stored rows `raw`."""
        return self._decode_bits(self._bits(raw))

    def decode(self, raw: np.ndarray) -> np.ndarray:
        """float32 [N, dim + state] rows of stored rows `raw`."""
        out = np.empty((len(raw), self.dim + self.state_width), dtype=np.float32)
        out[:, : self.dim] = self.decode_weights(raw)
        if self.state_width:
            out[:, self.dim:] = np.ascontiguousarray(raw[:, self.weight_bytes:]).view("<f4")
        return out

    def quantize(self, weights: np.ndarray) -> np.ndarray:
        """float32 `weights` as they read back once stored (rounded to nearest)."""
        return self._decode_bits(self.round_nearest(weights))

    # --- float32 -> bytes ------------------------------------------------------------------

    def _encode(self, weights: np.ndarray, ids: np.ndarray | None, seed_key: int) -> np.ndarray:
        w = np.asarray(weights, dtype=np.float32)
        if w.ndim != 2 or w.strides[1] != 4:
            w = np.ascontiguousarray(w)
        out = np.empty(w.shape, dtype=np.uint16)
        keep = None if ids is None else np.ascontiguousarray(ids, dtype=np.int64)
        if w.size:
            lib.half_encode(ffi.cast("float *", w.ctypes.data), w.shape[0], w.shape[1],
                            w.strides[0] // 4, int(self.precision == "bf16"),
                            ffi.NULL if keep is None else ffi.cast("int64_t *", keep.ctypes.data),
                            seed_key, ffi.cast("uint16_t *", out.ctypes.data))
        return out

    def overflowed(self, rounded: np.ndarray) -> np.ndarray:
        """bool[N]: which rows of 16-bit weights `rounded` [N, dim] hold an infinity or NaN.

        Finite float32 weights beyond the format's range round to infinity (|w| > 65504 in
        fp16, about 3.4e38 in bf16).
        """
        exponent = np.uint16(0x7C00 if self.precision == "fp16" else 0x7F80)
        return ((rounded & exponent) == exponent).any(axis=1)  # type: ignore[no-any-return]

    def round_nearest(self, weights: np.ndarray) -> np.ndarray:
        """uint16 [N, dim]: `weights` (float32) rounded to nearest, ties to even."""
        return self._encode(weights, None, 0)

    def round_stochastic(self, weights: np.ndarray, ids: np.ndarray, step: int) -> np.ndarray:
        """uint16 [N, dim]: `weights` rounded up or down at random, in proportion to distance.

        The random bits are a pure function of (table, id, column, `step`): those of
        `embstore.init.hash_bits(seed, ids, dim, stream=step)`.
        """
        return self._encode(weights, ids, stream_key(self.seed, step))

    def encode(self, rows: np.ndarray, rounded: np.ndarray) -> np.ndarray:
        """Pack stored rows: uint8 [N, row_bytes].

        From the 16-bit weights `rounded` [N, dim] and the float32 optimizer state of `rows`
        [N, dim + state].
        """
        raw = np.empty((len(rows), self.row_bytes), dtype=np.uint8)
        raw[:, : self.weight_bytes] = np.ascontiguousarray(rounded, dtype="<u2").view(np.uint8)
        if self.state_width:
            raw[:, self.weight_bytes:] = np.ascontiguousarray(
                rows[:, self.dim:], dtype="<f4").view(np.uint8)
        return raw
