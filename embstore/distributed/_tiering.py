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

__all__ = ["TIER_ORDER", "Choice", "Knapsack", "Options", "ShardShape", "capacity_grid",
           "chain_specs", "fmt_bytes", "options"]

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
    """Share of the lookups that miss each cache and those above it, top first."""
    seconds: float
    use: np.ndarray
    """float64[len(tiers)]: bytes in each budgeted tier."""


@dataclass
class Options:
    """Every option of one shard, as arrays (a `Choice` is built only for the chosen one)."""

    seconds: np.ndarray
    """float64[n]: predicted seconds per step of each option."""
    use: np.ndarray
    """float64[n, len(tiers)]: bytes of each option in each budgeted tier."""
    chains: list[tuple[str, ...]]
    levels: np.ndarray
    """int64[n, 2]: grid index of each cache level's size (-1: no such level)."""
    misses: np.ndarray
    """float64[n, 2]: miss ratio below each cache level."""
    caps: np.ndarray
    """int64[G]: the shard's rows for each grid size."""
    policies: list[str | None]
    """Eviction policy for each grid size."""

    def choice(self, j: int) -> Choice:
        """Option `j` as a `Choice`."""
        backends = self.chains[j]
        idx = [int(i) for i in self.levels[j, :len(backends) - 1]]
        return Choice(backends, tuple(int(self.caps[i]) for i in idx),
                      tuple(self.policies[i] for i in idx),
                      tuple(float(m) for m in self.misses[j, :len(idx)]),
                      float(self.seconds[j]), self.use[j])


def options(shape: ShardShape, grid: np.ndarray, miss: Any, policy: Any,
            tiers: tuple[str, ...], model: dict[str, Any]) -> Options:
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
    groups: list[tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]] = []

    def add(backends: tuple[str, ...], levels: np.ndarray, misses: list[np.ndarray]) -> None:
        n = len(levels)
        secs = np.broadcast_to(step_seconds(model, backends, shape.distinct, shape.row_bytes,
                                            misses), (n,))
        m = np.full((n, 2), np.nan)
        for k, x in enumerate(misses):
            m[:, k] = x
        groups.append((backends, levels, secs, m))

    none = np.full((1, 2), -1, dtype=np.int64)
    for t in tiers:
        add((t,), none, [])
    g = np.arange(len(grid))
    one = np.stack([g, np.full(len(g), -1)], axis=1)
    for top in (t for t in tiers if t in _CACHES):
        for bottom in tiers[tiers.index(top) + 1:]:
            add((top, bottom), one, [miss_g])
    if "dram" in tiers and "pmem" in tiers:
        # misses below the pmem cache at the two caches' sum, as `embstore plan` counts them
        i1, i2 = np.triu_indices(len(grid), k=1)
        m2 = np.asarray(miss(grid[i1] + grid[i2]), dtype=np.float64)
        for ssd in tiers[tiers.index("pmem") + 1:]:
            add(("dram", "pmem", ssd), np.stack([i1, i2], axis=1), [miss_g[i1], m2])
    chains: list[tuple[str, ...]] = []
    uses = []
    for backends, levels, _secs, _m in groups:
        chains += [backends] * len(levels)
        use = np.zeros((len(levels), len(tiers)))
        for level, b in enumerate(backends):
            held = (caps_s[levels[:, level]] if level < len(backends) - 1
                    else np.full(len(levels), shape.rows))
            use[:, where[b]] += held * over[b]
        uses.append(use)
    return Options(np.concatenate([x[2] for x in groups]).astype(np.float64),
                   np.concatenate(uses), chains,
                   np.concatenate([x[1] for x in groups]).astype(np.int64),
                   np.concatenate([x[3] for x in groups]), caps_s,
                   [policy(c) for c in grid])


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
        if not self.fits():
            self._repair()

    def fits(self) -> bool:
        """Whether the current options are within the budgets."""
        return bool((self.used <= self.cap * (1 + 1e-9) + 1e-6).all())

    def _repair(self) -> None:
        """Move items to other tiers while that shrinks the overflow.

        Each item's least budget share, taken alone, can overflow one tier while another
        has room.
        """
        owner = np.concatenate([np.full(len(s), i) for i, s in enumerate(self.secs)])
        flat_use = np.concatenate(self.use)
        flat_secs = np.concatenate(self.secs)
        first = np.concatenate([[0], np.cumsum([len(s) for s in self.secs])])
        bounded = np.isfinite(self.cap)
        while not self.fits():
            cur = first[:-1] + np.asarray(self.cur)
            new_used = self.used + flat_use - flat_use[cur][owner]
            over = (np.maximum(new_used - self.cap, 0.0)[:, bounded]
                    * self.scale[bounded]).sum(axis=1)
            now = float((np.maximum(self.used - self.cap, 0.0)[bounded]
                         * self.scale[bounded]).sum())
            best = int(np.lexsort((flat_secs, over))[0])
            if over[best] >= now - 1e-12:
                return  # no single move helps: the tables do not fit
            i = int(owner[best])
            self.used = new_used[best]
            self.cur[i] = best - int(first[i])

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
