"""Deterministic initializers: the value of a row that was never written.

Each initializer is a pure, vectorised function of (seed, id, column): a counter-based hash
(splitmix64), not a stateful RNG. The same id gets the same row on any tier layout, cache size,
batch order, process or shard, which is what makes results independent of placement.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np

from ._named import Named, number_setting
from .errors import ConfigError

__all__ = ["Constant", "Initializer", "Normal", "Uniform", "Zeros", "from_config",
           "initializer_names"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic, in place where possible)."""
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def stream_key(seed: int, stream: int = 0) -> int:
    """The 64-bit key of (seed, stream) that `hash_bits` mixes each id with."""
    # Python ints (arbitrary precision, masked) for the scalar key: numpy scalars warn on wrap
    key = _mix64(np.array([(seed * 2 + 1 + stream * int(_GOLDEN)) & (2**64 - 1)],
                          dtype=np.uint64))
    return int(key[0])


def hash_bits(seed: int, ids: np.ndarray, dim: int, stream: int = 0) -> np.ndarray:
    """uint64[N, dim] of well-mixed bits, a pure function of (seed, stream, id, column)."""
    seed_key = np.uint64(stream_key(seed, stream))
    row_key = _mix64(ids.astype(np.int64).view(np.uint64) ^ seed_key)
    cols = (np.arange(1, dim + 1, dtype=np.uint64) * _GOLDEN)
    return _mix64(row_key[:, None] + cols[None, :])


_MAX_Z = 8.572  # the largest |z| of `Normal`'s Box-Muller over 53-bit uniforms, rounded up


def _unit_interval(bits: np.ndarray) -> np.ndarray:
    """float64 uniform in [0, 1) with 53 random bits."""
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def _number(owner: str, name: str, value: Any) -> float:
    return number_setting(f"{owner} {name}", value)


def _seed(owner: str, value: Any) -> int:
    """`value` as an int seed, or a ConfigError (a float or bool would be silently cut).

    Seeds are int64 or uint64 (stores keep the seeds they were made with, any of those): the
    key they make (`stream_key`) keeps 63 bits of a seed, so 2**64 or more would give the
    very rows of a small seed (0). Within that range, s and s + 2**63 still share their rows:
    give tables small distinct seeds.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{owner} seed must be an int, got {value!r}")
    if not -(2**63) <= int(value) < 2**64:
        raise ConfigError(f"{owner} seed must fit in int64 or uint64, got {value!r}: a larger "
                          "seed would repeat the rows of a smaller one")
    return int(value)


class Initializer(Named):
    """Produces the initial rows of ids that have never been written."""

    _family: ClassVar[str] = "initializer"
    _registry: ClassVar[dict[str, type[Named]]] = {}

    @abstractmethod
    def __call__(self, ids: np.ndarray, dim: int, dtype: np.dtype) -> np.ndarray:
        """Rows array[len(ids), dim] of `dtype` for int64 `ids`; pure in (settings, id)."""

    def value_range(self) -> tuple[float, float] | None:
        """(lowest, highest): bounds of every value it gives, before the cast to the dtype.

        None where unknown (a table then checks one row's values instead).
        """
        return None


class Zeros(Initializer):
    """Every element 0."""

    name: ClassVar[str] = "zeros"

    def __call__(self, ids: np.ndarray, dim: int, dtype: np.dtype) -> np.ndarray:
        # docstring inherited
        return np.zeros((len(ids), dim), dtype=dtype)

    def value_range(self) -> tuple[float, float]:
        # docstring inherited
        return 0.0, 0.0

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {}


class Constant(Initializer):
    """Every element `value`."""

    name: ClassVar[str] = "constant"

    def __init__(self, value: float) -> None:
        self.value = _number("Constant", "value", value)

    def __call__(self, ids: np.ndarray, dim: int, dtype: np.dtype) -> np.ndarray:
        # docstring inherited
        with np.errstate(over="ignore"):  # a value past the dtype's range is its infinity
            return np.full((len(ids), dim), self.value, dtype=dtype)

    def value_range(self) -> tuple[float, float]:
        # docstring inherited
        return self.value, self.value

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"value": self.value}


class Uniform(Initializer):
    """Elements uniform in [low, high), a pure function of (seed, id, column)."""

    name: ClassVar[str] = "uniform"

    def __init__(self, low: float = -0.05, high: float = 0.05, *, seed: int = 0) -> None:
        low, high = _number("Uniform", "low", low), _number("Uniform", "high", high)
        if not (np.isfinite(low) and np.isfinite(high) and low < high):
            raise ConfigError(f"Uniform needs finite low < high, got low={low}, high={high}")
        self.low, self.high, self.seed = low, high, _seed("Uniform", seed)

    def __call__(self, ids: np.ndarray, dim: int, dtype: np.dtype) -> np.ndarray:
        # docstring inherited
        u = _unit_interval(hash_bits(self.seed, ids, dim))
        return (self.low + (self.high - self.low) * u).astype(dtype)

    def value_range(self) -> tuple[float, float]:
        # docstring inherited: low + (high - low) * u, whose span can overflow a float64
        if not np.isfinite(self.high - self.low):
            return -np.inf, np.inf
        return self.low, self.high

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"low": self.low, "high": self.high, "seed": self.seed}


class Normal(Initializer):
    """Elements normal with `mean` and `std` (Box-Muller over two hashed uniforms)."""

    name: ClassVar[str] = "normal"

    def __init__(self, mean: float = 0.0, std: float = 0.01, *, seed: int = 0) -> None:
        mean, std = _number("Normal", "mean", mean), _number("Normal", "std", std)
        if not (np.isfinite(mean) and np.isfinite(std) and std > 0):
            raise ConfigError(f"Normal needs finite mean and std > 0, got {mean}, {std}")
        self.mean, self.std, self.seed = mean, std, _seed("Normal", seed)

    def __call__(self, ids: np.ndarray, dim: int, dtype: np.dtype) -> np.ndarray:
        # docstring inherited
        u1 = 1.0 - _unit_interval(hash_bits(self.seed, ids, dim, stream=1))  # (0, 1]: log-safe
        u2 = _unit_interval(hash_bits(self.seed, ids, dim, stream=2))
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        return (self.mean + self.std * z).astype(dtype)

    def value_range(self) -> tuple[float, float]:
        # docstring inherited: u1 >= 2**-53 bounds |z| by sqrt(2 * 53 * ln 2) = 8.5718
        with np.errstate(over="ignore"):  # past float64: inf, refused
            return (float(np.float64(self.mean) - _MAX_Z * np.float64(self.std)),
                    float(np.float64(self.mean) + _MAX_Z * np.float64(self.std)))

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"mean": self.mean, "std": self.std, "seed": self.seed}


initializer_names = Initializer.registered_names
from_config = Initializer.from_config
