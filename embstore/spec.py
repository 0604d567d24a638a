"""`TableSpec` and `TierSpec`: what a store holds and where.

Both serialise to plain JSON for the store's manifest, so reopening a store needs only its path.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import init as init_mod
from . import optim as optim_mod
from .errors import ConfigError

__all__ = ["TABLE_NAME_RULE", "TableSpec", "TierSpec", "is_table_name", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_INT64_MAX = 2**63 - 1
MAX_ROW_BYTES = 2**31
"""The most bytes one stored row (weights and optimizer state) may take."""


TABLE_NAME_RULE = ("1-128 characters of letters, digits, '_', '.', '-', not starting with '.' "
                   "or '-'")
"""What a table name may be: it names files, so nothing that could reach another directory."""


def json_copy(value: Any, what: str, *, allow_nan: bool = False,
              numpy_scalars: bool = False) -> Any:
    """`value` as JSON gives it back: tuples become lists.

    `numpy_scalars`: numpy scalars become Python's own (np.int64(5) -> 5, as capacity and
    dim take them), for a value the caller keeps as copied; else they are refused.

    Raises:
        ConfigError: `value` holds what JSON does not keep as it is (sets, arrays, numpy
            scalars unless allowed, and unless `allow_nan`, NaN or infinity).
    """
    def plain(obj: Any) -> Any:  # json calls it for what it cannot write itself
        if numpy_scalars and isinstance(obj, np.generic) and not isinstance(obj, np.void):
            return obj.item()
        raise TypeError(f"{type(obj).__name__} is no JSON value")

    try:
        return json.loads(json.dumps(value, allow_nan=allow_nan, default=plain))
    except (TypeError, ValueError, RecursionError):
        finite = "" if allow_nan else "finite "
        raise ConfigError(f"{what} must hold plain JSON values (str, int, {finite}float, bool, "
                          f"None, lists and dicts of them), got {value!r}") from None


def is_table_name(name: object) -> bool:
    """Whether `name` is a table name (`TABLE_NAME_RULE`), checked whole."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def parse_bytes(text: str) -> int:
    """Bytes in a size such as "512MiB", "2GB" or "4096".

    Raises:
        ConfigError: not a size.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"cannot read {text!r} as a size; write e.g. '512MiB', '2GB' or a whole number of "
            "bytes"
        )
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(size):
        raise ConfigError(f"{text!r} is beyond any size; write e.g. '512MiB' or '2GB'")
    return int(size)


_STORED_AS = {"fp16": "float16", "bf16": "bfloat16"}  # weights of a half-precision table


@dataclass(frozen=True)
class TierSpec:
    """One level of a table's tier chain.

    Args:
        backend: registered backend name ("dram", "pmem", "rocksdb", "lmdb", ...).
        capacity: None (unbounded), an int number of rows, or a size string ("512MiB") of row
            payload bytes. The bottom tier is normally unbounded: it is the store of record.
        eviction: eviction policy name; defaults to "clock" for bounded tiers (LRU's usual
            approximation: a hit only sets a bit, where exact LRU reorders; on the calibrated
            trace its hit ratio was also slightly higher).
        admission: admission policy name; defaults to "always".
        eviction_options: keyword settings of the eviction policy.
        admission_options: keyword settings of the admission policy.
        options: keyword options of the backend (e.g. RocksDB block cache size).
    """

    backend: str
    capacity: int | str | None = None
    eviction: str | None = None
    admission: str | None = None
    eviction_options: dict[str, Any] = field(default_factory=dict)
    admission_options: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"TierSpec.backend must be a backend name, got {self.backend!r}")
        cap: Any = self.capacity
        if isinstance(cap, np.integer):  # (np.bool_ is no np.integer)
            cap = int(cap)  # as dim and num_embeddings take them; kept a plain int
            object.__setattr__(self, "capacity", cap)
        if isinstance(cap, bool) or not (cap is None or isinstance(cap, (int, str))):
            raise ConfigError(f"TierSpec.capacity must be None, rows (int) or a size, got {cap!r}")
        if isinstance(cap, int) and not 1 <= cap <= _INT64_MAX:
            raise ConfigError(f"TierSpec.capacity must be 1 to 2**63 - 1 rows, got {cap}")
        if isinstance(cap, str):
            try:
                parse_bytes(cap)
            except ConfigError as exc:  # a capacity may be rows too: say how to give those
                raise ConfigError(f"TierSpec.capacity: {exc}, or rows as an int") from None
        if isinstance(cap, str) and parse_bytes(cap) < 1:
            raise ConfigError(f"TierSpec.capacity {cap!r} is zero bytes")
        if isinstance(cap, str) and parse_bytes(cap) > _INT64_MAX:
            raise ConfigError(f"TierSpec.capacity {cap!r} is more than 2**63 - 1 bytes; give a "
                              "size a medium can hold, or None for an unbounded tier")
        for key in ("eviction", "admission"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"TierSpec.{key} must be a policy name or None, got {value!r}")
        for key in ("eviction_options", "admission_options", "options"):
            value = getattr(self, key)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ConfigError(f"TierSpec.{key} must be a dict of keyword settings, got "
                                  f"{value!r}")
            # kept as the manifest keeps them (a copy: the caller's dict may change after),
            # so a store reopens with settings equal to those it was made with
            object.__setattr__(self, key, json_copy(value, f"TierSpec.{key}",
                                                    numpy_scalars=True))
        if self.eviction is None and cap is not None:
            object.__setattr__(self, "eviction", "clock")

    def capacity_rows(self, row_bytes: int) -> int | None:
        """Capacity in rows for rows of `row_bytes` bytes (None: unbounded)."""
        if self.capacity is None:
            return None
        if isinstance(self.capacity, int):
            return self.capacity
        rows = parse_bytes(self.capacity) // row_bytes
        if rows < 1:
            raise ConfigError(
                f"tier capacity {self.capacity!r} holds no row of {row_bytes} bytes; raise it"
            )
        return rows

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form for the manifest."""
        return {"backend": self.backend, "capacity": self.capacity, "eviction": self.eviction,
                "admission": self.admission, "eviction_options": dict(self.eviction_options),
                "admission_options": dict(self.admission_options), "options": dict(self.options)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TierSpec:
        """Inverse of `to_json`.

        Raises:
            ConfigError: `data` is not a tier's JSON form.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"a tier must be a JSON object, got {data!r}")
        try:
            return cls(**data)
        except TypeError as exc:  # a key TierSpec does not have, or none for backend
            raise ConfigError(f"{data!r} is not a tier: {exc}; give the keys of "
                              "TierSpec.to_json") from exc


@dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    Args:
        name: table name (letters, digits, `_ . -`; used in file names).
        dim: embedding dimension (weights per row).
        dtype: dtype of weights and optimizer state (a float dtype).
        init: initializer giving the value of never-written ids.
        optimizer: fused optimizer applied by `apply_gradients`.
        num_embeddings: if set, ids must lie in [0, num_embeddings).
        allow_nonfinite: accept NaN and infinity in rows and gradients.
        tiers: this table's chain, overriding the store's default.
        precision: how weights are stored in every tier: "fp32" (the dtype itself), or
            "fp16" / "bf16" (half the bytes; float32 dtype required: updates are computed in
            float32 and rounded back, stochastically for optimizer steps; state stays
            float32). See embstore._precision.
    """

    name: str
    dim: int
    dtype: Any = np.float32
    init: init_mod.Initializer = field(default_factory=init_mod.Zeros)
    optimizer: optim_mod.Optimizer = field(default_factory=optim_mod.SGD)
    num_embeddings: int | None = None
    allow_nonfinite: bool = False
    tiers: tuple[TierSpec, ...] | None = None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if not is_table_name(self.name):
            raise ConfigError(f"table name {self.name!r} must be {TABLE_NAME_RULE}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)) \
                or self.dim < 1:
            raise ConfigError(f"table {self.name!r}: dim must be a positive int, got {self.dim!r}")
        object.__setattr__(self, "dim", int(self.dim))
        try:
            if self.dtype is None:  # np.dtype(None) is float64: a default no one wrote
                raise TypeError
            dtype = np.dtype(self.dtype)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"table {self.name!r}: {self.dtype!r} is not a dtype") from exc
        if dtype.kind != "f":
            raise ConfigError(f"table {self.name!r}: dtype must be a float dtype, got {dtype}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.init, init_mod.Initializer):
            raise ConfigError(f"table {self.name!r}: init must be an embstore.init initializer")
        if not isinstance(self.optimizer, optim_mod.Optimizer):
            raise ConfigError(
                f"table {self.name!r}: optimizer must be an embstore.optim optimizer")
        n = self.num_embeddings
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer))
                              or not 1 <= n <= _INT64_MAX):
            raise ConfigError(f"table {self.name!r}: num_embeddings must be None or 1 to "
                              f"2**63 - 1 (ids are int64), got {n!r}")
        if n is not None:
            object.__setattr__(self, "num_embeddings", int(n))
        if not isinstance(self.allow_nonfinite, (bool, np.bool_)):
            raise ConfigError(f"table {self.name!r}: allow_nonfinite must be True or False, "
                              f"got {self.allow_nonfinite!r}")
        object.__setattr__(self, "allow_nonfinite", bool(self.allow_nonfinite))
        if not isinstance(self.precision, str) or self.precision not in ("fp32", "fp16", "bf16"):
            raise ConfigError(f"table {self.name!r}: precision must be 'fp32', 'fp16' or "
                              f"'bf16', got {self.precision!r}")
        object.__setattr__(self, "precision", str(self.precision))
        if self.precision != "fp32" and dtype != np.float32:
            raise ConfigError(f"table {self.name!r}: precision {self.precision!r} stores "
                              f"weights in 16 bits and computes in float32; leave dtype at "
                              f"float32 (got {dtype})")
        row_bytes = self.storage_width * self.storage_dtype.itemsize
        if row_bytes > MAX_ROW_BYTES:
            raise ConfigError(
                f"table {self.name!r}: a row of dim {self.dim} with its optimizer state takes "
                f"{row_bytes} bytes, more than the {MAX_ROW_BYTES} a row may take (RocksDB and "
                "LMDB store a row as one value, under 4 GiB); give a smaller dim")
        if self.tiers is not None:
            try:
                tiers = () if isinstance(self.tiers, TierSpec) else tuple(self.tiers)
            except TypeError:  # not iterable
                tiers = ()
            if not tiers or not all(isinstance(t, TierSpec) for t in tiers):
                raise ConfigError(
                    f"table {self.name!r}: tiers must be a non-empty list of TierSpec")
            object.__setattr__(self, "tiers", tiers)
        for part, what in ((self.init, "init"), (self.optimizer, "optimizer")):
            # NaN too: a constant NaN init is a setting of a table that allows it
            json_copy(part.config(), f"table {self.name!r}: its {what}'s config()",
                      allow_nan=True)

    def check_initial_values(self) -> None:
        """Refuse an init that can give a value not finite where the table forbids it.

        A row never written reads as its initial value, so NaN there would be served from
        a table that refuses NaN everywhere else. The init's `value_range` is checked where
        it has one (every id's row then lies within it), else the row of id 0. Checked when
        a table is created, not when a stored one is read back: a store made before the
        check must still open.

        Raises:
            ConfigError: the init gives NaN or infinity (in float16 too, for fp16 weights)
                in a table that forbids them, or fails on one row.
        """
        if self.allow_nonfinite:
            return
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                bounds = self.init.value_range()
                first = (self.init(np.zeros(1, np.int64), self.dim, self.dtype)
                         if bounds is None else np.array([bounds]).astype(self.dtype))
                if self.precision != "fp32":  # as stored: rounded to 16 bits
                    from ._precision import RowCodec

                    first = RowCodec(self.name, self.precision, first.shape[1], 0).quantize(
                        first.astype(np.float32))
            finite = bool(np.isfinite(first).all())
        except Exception as exc:  # a user's initializer: its error, named
            raise ConfigError(f"table {self.name!r}: its init {self.init!r} failed on one row "
                              f"({type(exc).__name__}: {exc})") from exc
        if not finite:
            bad = first.ravel()[~np.isfinite(first.ravel())][0]
            raise ConfigError(
                f"table {self.name!r}: its init {self.init!r} can give {bad} in "
                f"{_STORED_AS.get(self.precision, self.dtype)}, and the table "
                "forbids NaN and infinity; give a finite value or allow_nonfinite=True")

    @property
    def row_width(self) -> int:
        """Stored elements per row: weights plus optimizer state."""
        return self.dim + self.optimizer.state_width(self.dim)

    @property
    def storage_width(self) -> int:
        """Elements of `storage_dtype` per stored row, in every tier."""
        if self.precision == "fp32":
            return self.row_width
        return 2 * self.dim + 4 * (self.row_width - self.dim)

    @property
    def storage_dtype(self) -> np.dtype:
        """Dtype of the stored rows: the table's dtype, or bytes for 16-bit weights."""
        return self.dtype if self.precision == "fp32" else np.dtype(np.uint8)

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form for the manifest."""
        return {
            "name": self.name, "dim": self.dim, "dtype": self.dtype.str,
            "precision": self.precision,
            "init": {"name": self.init.name, "config": self.init.config()},
            "optimizer": {"name": self.optimizer.name, "config": self.optimizer.config()},
            "num_embeddings": self.num_embeddings, "allow_nonfinite": self.allow_nonfinite,
            "tiers": None if self.tiers is None else [t.to_json() for t in self.tiers],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TableSpec:
        """Inverse of `to_json`.

        Raises:
            ConfigError: `data` is not a table's JSON form.
        """
        try:
            return cls._from_json(data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"not a table's JSON form ({type(exc).__name__}: {exc}); give "
                              "what TableSpec.to_json returns") from exc

    @classmethod
    def _from_json(cls, data: dict[str, Any]) -> TableSpec:
        return cls(
            name=data["name"], dim=data["dim"], dtype=np.dtype(data["dtype"]),
            init=init_mod.from_config(data["init"]["name"], data["init"]["config"]),
            optimizer=optim_mod.from_config(data["optimizer"]["name"],
                                            data["optimizer"]["config"]),
            num_embeddings=data["num_embeddings"], allow_nonfinite=data["allow_nonfinite"],
            tiers=None if data["tiers"] is None
            else tuple(TierSpec.from_json(t) for t in data["tiers"]),
            precision=data.get("precision", "fp32"),  # stores made before it existed
        )
