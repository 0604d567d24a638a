"""Sharding plans: where each table's rows (or columns) live across the ranks of a group.

A `Placement` says how one table is split:

- ``"table"``: the whole table on one rank (``ranks=(r,)``);
- ``"row"``: rows spread over ``ranks``, by a hash of the id (``split="hash"``) or by id ranges
  (``split="range"``, ``bounds[k]`` is the first id of ``ranks[k+1]``);
- ``"column"``: every row cut into column ranges, ``columns[k]:columns[k+1]`` on ``ranks[k]``.

A rank holds at most one shard of a table (its local table keeps the table's name). A `Plan`
maps every table to its placement and serialises to JSON, so a sharded store's directory and
checkpoints record how they were cut. A plan may also give, per rank, the tier chain of that
rank's shard of a table (`Plan.tiers`, what the sharding planner chooses within per-tier
budgets): `embstore.distributed.open` builds each rank's local table with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..init import _mix64
from ..policy import whole_setting
from ..spec import TableSpec, TierSpec

__all__ = ["KINDS", "Placement", "Plan", "default_plan"]

KINDS = ("table", "row", "column")
_MAX_RANK = 2**31 - 2
"""Largest rank (and column offset) a placement names: torch.distributed counts ranks in an
int32 world size."""
_HASH_SEED = np.uint64(0x5EED5EED12345678)


@dataclass(frozen=True)
class Placement:
    """How one table is sharded. See the module docstring for the meaning of each field."""

    kind: str
    ranks: tuple[int, ...]
    split: str = "hash"
    bounds: tuple[int, ...] = ()
    columns: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ConfigError(f"sharding kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "ranks", _whole_numbers("ranks", self.ranks, 0, _MAX_RANK))
        object.__setattr__(self, "bounds", _whole_numbers("bounds", self.bounds, -2**63,
                                                          2**63 - 1))
        object.__setattr__(self, "columns", _whole_numbers("columns", self.columns, 0,
                                                           _MAX_RANK))
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"placement ranks must be distinct and non-empty, got {self.ranks}")
        if not isinstance(self.split, str) or self.split not in ("hash", "range"):
            raise ConfigError(f"placement split must be 'hash' or 'range', got {self.split!r}")
        # fields another kind would use are refused, not carried into the store's record
        if self.bounds and (self.kind, self.split) != ("row", "range"):
            raise ConfigError(f"bounds belong to a row-wise range split, not to a {self.kind}"
                              f"-wise placement split by {self.split}; got {self.bounds}")
        if self.columns and self.kind != "column":
            raise ConfigError(f"columns belong to a column-wise placement, not a {self.kind}-"
                              f"wise one; got {self.columns}")
        if self.split == "range" and self.kind != "row":
            raise ConfigError(f"only a row-wise placement is split by range, not a "
                              f"{self.kind}-wise one")
        if self.kind == "table" and len(self.ranks) != 1:
            raise ConfigError(f"a table-wise placement has one rank, got {self.ranks}")
        if self.split == "range" and (len(self.bounds) != len(self.ranks) - 1
                                      or list(self.bounds) != sorted(set(self.bounds))):
            raise ConfigError(f"range split over {len(self.ranks)} ranks needs "
                              f"{len(self.ranks) - 1} increasing bounds, got {self.bounds}")
        if self.kind == "column":
            c = self.columns
            if len(c) != len(self.ranks) + 1 or c[0] != 0 or any(np.diff(c) <= 0):
                raise ConfigError(f"column-wise placement over {len(self.ranks)} ranks needs "
                                  f"{len(self.ranks) + 1} increasing offsets from 0, got {c}")

    # --- routing -------------------------------------------------------------------------

    def owner_index(self, ids: np.ndarray) -> np.ndarray:
        """Index into `ranks` of the owner of each id (int64[N]); row/table-wise only."""
        n = len(self.ranks)
        if n == 1:
            return np.zeros(len(ids), dtype=np.int64)
        if self.split == "range":
            return np.searchsorted(np.asarray(self.bounds, dtype=np.int64), ids, side="right")
        h = _mix64(ids.astype(np.int64).view(np.uint64) ^ _HASH_SEED)
        return (h % np.uint64(n)).astype(np.int64)

    def column_range(self, rank: int) -> tuple[int, int]:
        """Columns [start, stop) of `rank`'s shard of a column-wise table."""
        k = self.ranks.index(rank)
        return self.columns[k], self.columns[k + 1]

    def counting_rank(self) -> int:
        """The one rank whose shard counts rows for the whole table (first column shard)."""
        return self.ranks[0]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {"kind": self.kind, "ranks": list(self.ranks), "split": self.split,
                "bounds": list(self.bounds), "columns": list(self.columns)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Placement:
        """Inverse of `to_json`."""
        return cls(data["kind"], tuple(data["ranks"]), data.get("split", "hash"),
                   tuple(data.get("bounds", ())), tuple(data.get("columns", ())))


@dataclass(frozen=True)
class Plan:
    """Placement of every table over `world_size` ranks, and optionally the shards' tiers."""

    world_size: int
    tables: Mapping[str, Placement] = field(default_factory=dict)
    tiers: Mapping[int, Mapping[str, tuple[TierSpec, ...]]] = field(default_factory=dict)
    """Per rank, the tier chain (top first) of its shard of each table named there; a shard
    not named takes its table's own chain, else the store's default."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "world_size", whole_setting("Plan", "world_size",
                                                             self.world_size, 1, _MAX_RANK + 1))
        if not isinstance(self.tables, Mapping) or not all(
                isinstance(t, str) and isinstance(p, Placement) for t, p in self.tables.items()):
            raise ConfigError("Plan.tables maps table names to Placement, got "
                              f"{self.tables!r}")
        # its own copy: a caller's dict changed later must not reach the store's record
        object.__setattr__(self, "tables", dict(self.tables))
        if not isinstance(self.tiers, Mapping):
            raise ConfigError("Plan.tiers maps ranks to {table: [TierSpec, ...]}, got "
                              f"{self.tiers!r}")
        try:
            tiers = {int(r): {str(t): tuple(chain) for t, chain in per.items()}
                     for r, per in self.tiers.items()}
        except (TypeError, ValueError, AttributeError):
            raise ConfigError("Plan.tiers maps ranks to {table: [TierSpec, ...]}, got "
                              f"{self.tiers!r}") from None
        for r, per in tiers.items():
            for t, chain in per.items():
                if not chain or not all(isinstance(x, TierSpec) for x in chain):
                    raise ConfigError(f"Plan.tiers[{r}][{t!r}] must be a non-empty list of "
                                      f"TierSpec, got {chain!r}")
        object.__setattr__(self, "tiers", {r: per for r, per in sorted(tiers.items()) if per})

    def chain(self, rank: int, table: str) -> tuple[TierSpec, ...] | None:
        """The tier chain of `rank`'s shard of `table`, or None where the plan gives none."""
        return self.tiers.get(rank, {}).get(table)

    def check(self, specs: list[TableSpec]) -> None:
        """Raise ConfigError unless the plan places exactly `specs` within the world."""
        names = {s.name for s in specs}
        if set(self.tables) != names:
            raise ConfigError(f"the plan places {sorted(self.tables)} but the tables are "
                              f"{sorted(names)}; give one placement per table")
        by_name = {s.name: s for s in specs}
        for spec in specs:
            p = self.tables[spec.name]
            if max(p.ranks) >= self.world_size or min(p.ranks) < 0:
                raise ConfigError(f"table {spec.name!r} placed on ranks {p.ranks}, outside a "
                                  f"world of {self.world_size}")
            if p.kind == "column" and spec.precision != "fp32":
                # stochastic rounding draws its bits by (id, column): a shard's local columns
                # would round otherwise than the whole row, unlike one process
                raise ConfigError(f"table {spec.name!r} stores {spec.precision} weights, which "
                                  "cannot be sharded column-wise; shard it table-wise or "
                                  "row-wise")
            if p.kind == "column" and p.columns[-1] != spec.dim:
                raise ConfigError(f"table {spec.name!r}: column offsets {p.columns} must end "
                                  f"at its dim {spec.dim}")
        for rank, per in self.tiers.items():
            for name, chain in per.items():
                if name not in by_name or rank not in self.tables[name].ranks:
                    raise ConfigError(f"the plan gives rank {rank} tiers for table {name!r}, "
                                      f"which holds no shard of it there; give tiers only "
                                      f"for a table's owners")
                own = by_name[name].tiers
                if own is not None and own != chain:
                    raise ConfigError(f"table {name!r} sets its own tiers and the plan others "
                                      f"on rank {rank}; drop one of them")

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        out: dict[str, Any] = {"world_size": self.world_size,
                               "tables": {t: p.to_json() for t, p in self.tables.items()}}
        if self.tiers:
            out["tiers"] = {str(r): {t: [x.to_json() for x in chain]
                                     for t, chain in per.items()}
                            for r, per in self.tiers.items()}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """Inverse of `to_json`."""
        tiers = {int(r): {t: tuple(TierSpec.from_json(x) for x in chain)
                          for t, chain in per.items()}
                 for r, per in data.get("tiers", {}).items()}
        return cls(int(data["world_size"]),
                   {t: Placement.from_json(p) for t, p in data["tables"].items()}, tiers)


def _whole_numbers(field_name: str, values: Any, least: int, most: int) -> tuple[int, ...]:
    """`values` (a tuple or list) as a tuple of ints in [least, most]; ConfigError else."""
    if not isinstance(values, (tuple, list)):
        raise ConfigError(f"placement {field_name} must be a tuple of whole numbers, got "
                          f"{values!r}")
    return tuple(whole_setting("placement", field_name, v, least, most) for v in values)


def even_columns(dim: int, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Column offsets cutting `dim` into len(ranks) near-equal parts (each at least 1)."""
    n = min(len(ranks), dim)
    return tuple(int(x) for x in np.linspace(0, dim, n + 1).round().astype(int))


def default_plan(specs: list[TableSpec], world_size: int) -> Plan:
    """Every table row-wise by hash over all ranks (balanced for any id distribution)."""
    ranks = tuple(range(world_size))
    return Plan(world_size, {s.name: Placement("row", ranks) for s in specs})
