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

from .init import hash_bits

__all__ = ["PRECISIONS", "RowCodec"]

PRECISIONS = ("fp32", "fp16", "bf16")


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

    def decode_weights(self, raw: np.ndarray) -> np.ndarray:
        """float32 [N, dim] weights of stored rows `raw`."""
        bits = self._bits(raw)
        if self.precision == "fp16":
            return bits.view(np.float16).astype(np.float32)
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)

    def decode(self, raw: np.ndarray) -> np.ndarray:
        """float32 [N, dim + state] rows of stored rows `raw`."""
        out = np.empty((len(raw), self.dim + self.state_width), dtype=np.float32)
        out[:, : self.dim] = self.decode_weights(raw)
        if self.state_width:
            out[:, self.dim:] = np.ascontiguousarray(raw[:, self.weight_bytes:]).view("<f4")
        return out

    def quantize(self, weights: np.ndarray) -> np.ndarray:
        """float32 `weights` as they read back once stored (rounded to nearest)."""
        bits = self.round_nearest(weights)
        if self.precision == "fp16":
            return bits.view(np.float16).astype(np.float32)
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)

    # --- float32 -> bytes ------------------------------------------------------------------

    def round_nearest(self, weights: np.ndarray) -> np.ndarray:
        """uint16 [N, dim]: `weights` (float32) rounded to nearest, ties to even."""
        if self.precision == "fp16":
            with np.errstate(over="ignore"):
                return np.ascontiguousarray(weights, dtype=np.float32).astype(np.float16) \
                    .view(np.uint16)
        u = np.ascontiguousarray(weights, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1)))
                   >> np.uint64(16)).astype(np.uint16)
        nan = np.isnan(weights)
        if nan.any():
            rounded[nan] = 0x7FC0
        return rounded

    def round_stochastic(self, weights: np.ndarray, ids: np.ndarray, step: int) -> np.ndarray:
        """uint16 [N, dim]: `weights` rounded up or down at random, in proportion to distance.

        The random bits are a pure function of (table, id, column, `step`).
        """
        w = np.ascontiguousarray(weights, dtype=np.float32)
        bits = hash_bits(self.seed, ids, self.dim, stream=step)
        if self.precision == "bf16":
            u = w.view(np.uint32).astype(np.uint64)
            noise = bits >> np.uint64(48)  # 16 random bits below the kept ones
            rounded = ((u + noise) >> np.uint64(16)).astype(np.uint16)
            nan = np.isnan(w)
            if nan.any():
                rounded[nan] = 0x7FC0
            return rounded
        with np.errstate(over="ignore", invalid="ignore"):
            near = w.astype(np.float16)
            near32 = near.astype(np.float32)
            # the other neighbour of w in float16, on the far side of w from `near`
            other = np.nextafter(near, np.where(near32 < w, np.float16(np.inf),
                                                np.float16(-np.inf)))
            other32 = other.astype(np.float32).astype(np.float64)
            gap = other32 - near32
            # probability of taking `other`: w's distance from `near` over the gap
            p = np.where(gap != 0, (w.astype(np.float64) - near32) / gap, 0.0)
            draw = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)
            take = (draw < p) & np.isfinite(near32) & (near32 != w)
        return np.where(take, other, near).view(np.uint16)

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
