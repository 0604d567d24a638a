"""What the sharding planner knows of a table, per-rank tier budgets, and reading profiles.

`tables_from_profile` turns the profile `embstore profile` writes (schema in
`embstore.placement`) and the tables' specs into `TableProfile`s: lookups per sample, the
share of distinct ids, the row bytes (checked against the spec) and the miss-ratio curve,
the lowest of the profiled policies' at each capacity.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..placement import KNOWN_TIERS, load_document
from ..spec import TableSpec, parse_bytes

__all__ = ["MissCurve", "TableProfile", "parse_tier_budgets", "tables_from_profile"]


@dataclass(frozen=True)
class MissCurve:
    """Miss ratio of a cache of a table's rows against its size.

    Args:
        capacities: cache sizes in rows, increasing.
        miss: the share of a step's distinct ids that a cache of each size misses.
        policies: the eviction policy spec that reaches each miss ratio (optional).
    """

    capacities: tuple[float, ...]
    miss: tuple[float, ...]
    policies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        caps = np.asarray(self.capacities, dtype=np.float64)
        miss = np.asarray(self.miss, dtype=np.float64)
        if (caps.ndim != 1 or len(caps) < 1 or miss.shape != caps.shape
                or (caps <= 0).any() or (np.diff(caps) <= 0).any()
                or not ((miss >= 0) & (miss <= 1)).all()
                or (self.policies and len(self.policies) != len(caps))):
            raise ConfigError("a miss-ratio curve needs increasing positive capacities and "
                              "as many miss ratios in [0, 1] (and policies, if given)")
        object.__setattr__(self, "capacities", tuple(float(c) for c in caps))
        object.__setattr__(self, "miss", tuple(float(m) for m in miss))
        object.__setattr__(self, "policies", tuple(self.policies))

    def miss_at(self, capacity: Any) -> np.ndarray:
        """Miss ratio at each capacity (interpolated in log capacity; 1 for no cache)."""
        c = np.asarray(capacity, dtype=np.float64)
        logs = np.log(np.maximum(c, 1e-300))
        out = np.interp(logs, np.log(self.capacities), self.miss)
        return np.where(c > 0, out, 1.0)

    def policy_at(self, capacity: float) -> str | None:
        """The policy profiled nearest `capacity` (in log capacity), or None."""
        if not self.policies:
            return None
        j = int(np.argmin(np.abs(np.log(self.capacities) - math.log(max(capacity, 1e-300)))))
        return self.policies[j]


@dataclass(frozen=True)
class TableProfile:
    """What the planner needs to know of one table.

    Args:
        name: the table's name.
        rows: rows (ids) the table will hold.
        dim: embedding dimension.
        lookups_per_sample: ids looked up per training sample (pooling factor).
        itemsize: bytes per element (4 for float32).
        state_width: optimizer state elements per row (1 for row-wise Adagrad).
        unique_ratio: distinct ids per lookup within a batch (the placement profile's reuse).
        curve: miss ratio of a cache against its size; None: ids drawn uniformly (a cache
            of C rows misses 1 - C/rows, the most any cache misses).
        stored_row_bytes: bytes of a stored row when not (dim + state_width) x itemsize
            (16-bit weights, or as profiled).
        column_split: whether the table may be sharded column-wise; not a table of 16-bit
            weights, whose stochastic rounding is keyed by the column within the row.
    """

    name: str
    rows: int
    dim: int
    lookups_per_sample: float
    itemsize: int = 4
    state_width: int = 1
    unique_ratio: float = 1.0
    curve: MissCurve | None = None
    stored_row_bytes: int | None = None
    column_split: bool = True

    def cost(self, batch_size: int) -> float:
        """Bytes of rows looked up per step."""
        return batch_size * self.lookups_per_sample * self.unique_ratio * self.dim * self.itemsize

    def distinct(self, batch_size: int) -> float:
        """Distinct ids looked up per step."""
        return batch_size * self.lookups_per_sample * self.unique_ratio

    @property
    def row_bytes(self) -> int:
        """Bytes of a stored row (weights and optimizer state)."""
        if self.stored_row_bytes is not None:
            return self.stored_row_bytes
        return (self.dim + self.state_width) * self.itemsize

    @property
    def memory(self) -> int:
        """Bytes of stored rows."""
        return self.rows * self.row_bytes

    def miss_at(self, capacity: Any) -> np.ndarray:
        """Miss ratio of a cache of `capacity` rows of the whole table."""
        if self.curve is not None:
            return self.curve.miss_at(capacity)
        c = np.asarray(capacity, dtype=np.float64)
        return np.clip(1.0 - c / max(self.rows, 1), 0.0, 1.0)

    def policy_at(self, capacity: float) -> str | None:
        """Eviction policy for a cache of `capacity` rows (None: the tier's default)."""
        return None if self.curve is None else self.curve.policy_at(capacity)


def parse_tier_budgets(text: str, *, share_of: float | None = None) -> dict[str, float]:
    """Bytes per rank of each tier from "dram=8GiB,pmem=64GiB,rocksdb=unbounded".

    A size is what `embstore plan --budget` reads (8GiB, 512MiB, bytes), ``unbounded``, or,
    with `share_of` (bytes), a percentage of it ("dram=10%": a tenth of `share_of`). Tiers
    not named are not used.

    Raises:
        ConfigError: bad syntax, an unknown or repeated tier, or a size below one byte.
    """
    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, size = (x.strip() for x in item.partition("="))
        if not eq or not size:
            raise ConfigError(f"tier budget {item!r}: expected tier=size, e.g. "
                              "dram=8GiB,pmem=64GiB,rocksdb=unbounded")
        if name not in KNOWN_TIERS:
            raise ConfigError(f"tier budget names tier {name!r}; known: {list(KNOWN_TIERS)}")
        if name in out:
            raise ConfigError(f"tier budget gives {name!r} twice; give each tier once")
        try:
            if size.lower() == "unbounded":
                value = math.inf
            elif size.endswith("%"):
                if share_of is None:
                    raise ValueError("a percentage needs the tables' bytes per rank")
                value = float(size[:-1]) / 100 * share_of
            else:
                value = float(parse_bytes(size))
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"tier budget {item!r}: {exc}; write a size (8GiB), "
                              "'unbounded'" + (" or a percentage" if share_of else "")) from None
        if not value >= 1:
            raise ConfigError(f"tier budget {item!r} is below one byte; raise it or leave "
                              f"{name} out")
        out[name] = value
    if not out:
        raise ConfigError("the tier budgets name no tier; e.g. dram=8GiB,rocksdb=unbounded")
    return out


def tables_from_profile(profile: str | os.PathLike[str] | Mapping[str, Any],
                        specs: list[TableSpec]) -> list[TableProfile]:
    """The planner's view of `specs` from a profile written by ``embstore profile``.

    Lookups per sample, the share of distinct ids (distinct over all lookups per batch, at
    the profile's batch size) and the miss-ratio curve (per capacity, the lowest of the
    profiled policies', with that policy) come from the profile; the rows are the spec's
    `num_embeddings` if set, else the rows the trace touched.

    Raises:
        ConfigError: the profile is unreadable, lacks a table of `specs`, profiles rows of
            another size than the spec stores, or saw more rows than `num_embeddings`.
    """
    doc = load_document(dict(profile) if isinstance(profile, Mapping) else profile, "profile")
    where = "the profile" if isinstance(profile, Mapping) else f"profile {str(profile)!r}"
    profiled = doc["tables"]
    out = []
    for spec in specs:
        t = profiled.get(spec.name)
        if t is None:
            raise ConfigError(f"table {spec.name!r} is not in {where} (it has "
                              f"{sorted(profiled)}); profile a trace of every table to plan")
        stored = spec.storage_width * spec.storage_dtype.itemsize
        if t["row_bytes"] != stored:
            raise ConfigError(f"table {spec.name!r}: {where} has rows of {t['row_bytes']} "
                              f"bytes but the spec stores {stored} (dim {spec.dim}, "
                              f"{spec.row_width - spec.dim} state, {spec.precision}); profile "
                              f"again with --row-bytes {spec.name}={stored}")
        if spec.num_embeddings is not None and t["rows_touched"] > spec.num_embeddings:
            raise ConfigError(f"table {spec.name!r}: {where} saw {t['rows_touched']} distinct "
                              f"ids, more than its num_embeddings {spec.num_embeddings}; is it "
                              "the profile of this table?")
        mrc = t["mrc"]
        names = [k for k in mrc if k != "capacities"]
        curves = np.array([mrc[k] for k in names], dtype=np.float64)
        best = np.argmin(curves, axis=0)
        per_batch = float(t.get("lookups_per_batch", 0.0)) or float(t["distinct_per_batch"])
        unique = min(1.0, float(t["distinct_per_batch"]) / per_batch) if per_batch else 1.0
        out.append(TableProfile(
            spec.name, int(spec.num_embeddings or t["rows_touched"]), spec.dim,
            float(t["lookups_per_sample"]), spec.dtype.itemsize, spec.row_width - spec.dim,
            unique, MissCurve(tuple(mrc["capacities"]), tuple(curves.min(axis=0)),
                              tuple(names[j] for j in best)), stored,
            column_split=spec.precision == "fp32"))
    return out
