"""Tier chains of shards within per-rank tier budgets: the options and how they are chosen.

A shard's options are the chains `embstore plan` considers, over the budgeted tiers only:
the whole shard on one tier; a cache (DRAM, or pmem over an SSD tier) over a slower tier;
DRAM over a pmem cache over an SSD tier. Cache sizes come from the table's capacity grid
(its miss-ratio curve's capacities, or a log grid), never below two steps' distinct ids (a
smaller cache evicts rows between their lookup and their update). Each option has the
predicted seconds per step of the shard's accesses (`embstore._tier_cost.step_seconds`) and
its bytes in every budgeted tier (rows x (row bytes + the tier's overhead per row)).

`Knapsack` picks one option per item under a budget vector: start from the least memory,
then take, one at a time, the move that saves the most seconds per budget share spent (free
moves first), as `embstore plan` does, with a lazy heap so that thousands of tables plan in
well under a second.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._tier_cost import step_seconds
from ..spec import TierSpec

__all__ = ["TIER_ORDER", "Choice", "Knapsack", "ShardShape", "capacity_grid", "chain_specs",
           "fmt_bytes", "options"]

TIER_ORDER = ("dram", "pmem", "rocksdb", "lmdb")
"""Tiers fastest first: the order of a chain and of the budget vectors."""
_CACHES = ("dram", "pmem")
_GRID_POINTS = 12


@dataclass(frozen=True)
class ShardShape:
    """What the options of one shard depend on."""

    rows: float
    """Rows the shard holds."""
    distinct: float
    """Distinct ids looked up per step on the shard."""
    row_bytes: float
    """Stored bytes per row of the shard (its columns of weights and state)."""
    cap_scale: float
    """Shard cache rows per table cache rows (1/k for a row-wise shard of k, else 1)."""


@dataclass
class Choice:
    """One chain for one shard, with its figures."""

    backends: tuple[str, ...]
    caps: tuple[int, ...]
    """Rows of each cache tier (all but the bottom)."""
    policies: tuple[str | None, ...]
    """Eviction policy spec of each cache tier (None: the tier's default)."""
    misses: tuple[float, ...]
    """Share of the lookups each cache misses (cumulative, top first)."""
    seconds: float
    use: np.ndarray
    """float64[len(tiers)]: bytes in each budgeted tier."""


def options(shape: ShardShape, grid: np.ndarray, miss: Any, policy: Any,
            tiers: tuple[str, ...], model: dict[str, Any]) -> list[Choice]:
    """Every option of one shard, in an order that depends only on `grid` and `tiers`.

    Args:
        shape: the shard.
        grid: float64[G], increasing table-level cache capacities (rows) to consider.
        miss: table-level capacity array -> miss ratio array.
        policy: table-level capacity -> eviction policy spec or None.
        tiers: the budgeted tiers, fastest first.
        model: the tier model.
    """
    over = {t: shape.row_bytes + float(model["tiers"][t].get("overhead_bytes_per_row", 0.0))
            for t in tiers}
    where = {t: i for i, t in enumerate(tiers)}
    caps_s = np.maximum(1, np.round(grid * shape.cap_scale)).astype(np.int64)
    miss_g = np.asarray(miss(grid), dtype=np.float64)
    pol = [policy(c) for c in grid]
    out: list[Choice] = []

    def add(backends: tuple[str, ...], idx: tuple[int, ...], secs: float) -> None:
        use = np.zeros(len(tiers))
        for level, b in enumerate(backends):
            held = caps_s[idx[level]] if level < len(idx) else shape.rows
            use[where[b]] += held * over[b]
        caps = tuple(int(caps_s[i]) for i in idx)
        out.append(Choice(backends, caps, tuple(pol[i] for i in idx),
                          tuple(float(miss_g[i]) for i in idx), float(secs), use))

    for t in tiers:
        add((t,), (), step_seconds(model, (t,), shape.distinct, shape.row_bytes, ()))
    g = np.arange(len(grid))
    for top in (t for t in tiers if t in _CACHES):
        for bottom in tiers[tiers.index(top) + 1:]:
            secs = step_seconds(model, (top, bottom), shape.distinct, shape.row_bytes, [miss_g])
            for i in g:
                add((top, bottom), (int(i),), secs[i])
    if "dram" in tiers and "pmem" in tiers:
        # misses below the pmem cache at the two caches' sum, as `embstore plan` counts them
        i1, i2 = np.triu_indices(len(grid), k=1)
        m2 = np.asarray(miss(grid[i1] + grid[i2]), dtype=np.float64)
        for ssd in tiers[tiers.index("pmem") + 1:]:
            secs = step_seconds(model, ("dram", "pmem", ssd), shape.distinct, shape.row_bytes,
                                [miss_g[i1], m2])
            for a, b, s in zip(i1, i2, secs, strict=True):
                add(("dram", "pmem", ssd), (int(a), int(b)), s)
    return out


def chain_specs(choice: Choice) -> tuple[TierSpec, ...]:
    """The TierSpecs of a chosen chain, top first (caches bounded, the bottom unbounded)."""
    out = []
    for level, b in enumerate(choice.backends):
        if level == len(choice.caps):
            out.append(TierSpec(b))
            continue
        name, opts = _eviction(choice.policies[level])
        out.append(TierSpec(b, capacity=choice.caps[level], eviction=name,
                            eviction_options=opts))
    return tuple(out)


def _eviction(spec: str | None) -> tuple[str | None, dict[str, Any]]:
    """Name and settings of an eviction spec "name:key=value:..." as profiles write them."""
    if spec is None:
        return None, {}
    name, *items = spec.split(":")
    opts: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key == "seed":
            continue
        try:
            opts[key] = int(value)
        except ValueError:
            try:
                opts[key] = float(value)
            except ValueError:
                opts[key] = value
    return name, opts


class Knapsack:
    """One option per item within `cap` (bytes per tier), fewest seconds by greedy moves.

    Args:
        secs: per item, float64[n_i] seconds of each option.
        use: per item, float64[n_i, T] bytes of each option in each tier.
        cap: float64[T] budget per tier (inf: unbounded).
        start: per item, the option to start from (default: least budget share, then fastest).
    """

    def __init__(self, secs: list[np.ndarray], use: list[np.ndarray], cap: np.ndarray,
                 start: list[int] | None = None) -> None:
        self.secs, self.use, self.cap = secs, use, np.asarray(cap, dtype=np.float64)
        self.scale = np.where(np.isfinite(self.cap) & (self.cap > 0),
                              1.0 / np.maximum(self.cap, 1.0), 0.0)
        if start is None:
            start = [int(np.lexsort((s, u @ self.scale))[0]) for s, u in zip(secs, use,
                                                                              strict=True)]
        self.cur = list(start)
        self.used = (np.sum([u[c] for u, c in zip(use, self.cur, strict=True)], axis=0)
                     if use else np.zeros(len(self.cap)))
        self.heap: list[tuple[int, float, int, int, int]] = []
        self._full_pass = True

    def fits(self) -> bool:
        """Whether the current options are within the budgets."""
        return bool((self.used <= self.cap * (1 + 1e-9) + 1e-6).all())

    def seconds(self) -> float:
        """Seconds of the current options, all items."""
        return float(sum(s[c] for s, c in zip(self.secs, self.cur, strict=True)))

    def _best(self, i: int) -> tuple[int, float, int] | None:
        s, u, c = self.secs[i], self.use[i], self.cur[i]
        d_time = s[c] - s
        d_use = u - u[c]
        ok = ((self.used + d_use <= self.cap * (1 + 1e-9) + 1e-6).all(axis=1)
              & (d_time > 1e-15))
        if not ok.any():
            return None
        spend = d_use @ self.scale
        free = ok & (spend <= 0)
        if free.any():  # faster for no more budget: the largest saving first
            j = int(np.argmax(np.where(free, d_time, -1.0)))
            return 0, -float(d_time[j]), j
        ratio = np.where(ok, d_time / np.maximum(spend, 1e-300), -1.0)
        j = int(np.argmax(ratio))
        return 1, -float(ratio[j]), j

    def _push(self, i: int) -> None:
        best = self._best(i)
        if best is not None:
            heapq.heappush(self.heap, (best[0], best[1], i, best[2], self.cur[i]))

    def step(self) -> tuple[int, int, int] | None:
        """Take the best move that fits: (item, old option, new option), or None if none."""
        while True:
            if not self.heap:
                if not self._full_pass:
                    return None
                self._full_pass = False
                for i in range(len(self.secs)):
                    self._push(i)
                if not self.heap:
                    return None
            _, _, i, j, was = heapq.heappop(self.heap)
            if self.cur[i] != was:
                continue  # stale: the item moved since (a fresh entry was pushed)
            d_use = self.use[i][j] - self.use[i][was]
            if not (self.used + d_use <= self.cap * (1 + 1e-9) + 1e-6).all():
                self._push(i)  # another move took the room: its next best
                continue
            self.cur[i] = j
            self.used = self.used + d_use
            if (d_use < 0).any():
                self._full_pass = True  # room freed: moves refused before may fit now
            self._push(i)
            return i, was, j

    def run(self) -> None:
        """Take moves until none fits."""
        while self.step() is not None:
            pass


def capacity_grid(distinct: float, rows: float, curve_caps: tuple[float, ...]) -> np.ndarray:
    """Table-level cache sizes to consider: >= two steps' distinct ids and < the table."""
    lo = max(2.0 * distinct, 1.0)
    if curve_caps:
        caps = np.asarray(curve_caps, dtype=np.float64)
    elif rows > lo:
        caps = np.geomspace(lo, rows, _GRID_POINTS + 1)[:-1]
    else:
        caps = np.zeros(0)
    caps = caps[(caps >= lo) & (caps < rows)]
    return np.unique(np.round(caps)) if len(caps) else caps


def fmt_bytes(n: float) -> str:
    """`n` bytes in binary units, for messages."""
    if math.isinf(n):
        return "unbounded"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{int(n)}B"
