"""A sharding planner: kinds, owners and tier chains of every table, balancing per-rank cost.

Cost model (per training step). With one memory budget per rank (`memory_per_rank`), every
row lives in DRAM and a table's cost is the bytes of the rows it serves,
``batch_size * lookups_per_sample * unique_ratio * dim * itemsize``; its memory is
``rows * row_bytes`` (weights plus optimizer state). With per-rank tier budgets
(`tier_budgets`, e.g. dram=8GiB,pmem=64GiB,rocksdb=unbounded) a shard's cost is the
predicted seconds of its lookups and updates through the tier chain it gets on its rank
(`embstore._tier_cost`, the model `embstore plan` uses, with a tier model from `embstore
bench tiers` or `DEFAULT_TIER_MODEL`): rows served from a cache cost DRAM time, misses cost
the slower tier's, at the hit ratio of the table's miss-ratio curve (`TableProfile.curve`,
from `tables_from_profile`) at the cache size the rank gives the shard. A row-wise shard of
k ranks costs 1/k of the lookups and holds 1/k of the rows, and a cache of C/k rows on it
misses as one of C rows on the table (hashing spreads ids evenly, in expectation); a column
shard of c columns costs c/dim of the bytes, with every id.

Algorithm (longest-processing-time first, with splitting):

0. With tier budgets: every table gets a chain and cache sizes as if the ranks' budgets were
   one pool (a share of it, so that the shards pack: `embstore plan`'s greedy knapsack).
1. A table is split when its cost exceeds `split_above` times the mean per-rank cost, or its
   memory (in any budgeted tier) exceeds half a rank's budget: into k = ceil(cost /
   (split_above * mean)) parts (at least enough for memory), column-wise when its dim gives
   each part >= `min_columns` columns and its memory fits half a rank, row-wise by hash
   otherwise.
2. Shards are placed largest cost first on the least-loaded rank with room in every tier
   (the parts of one table on distinct ranks); with tier budgets, a shard that fits no rank
   takes, among its options that fit one, the one that leaves that rank least loaded.
3. Table-wise shards then move, or swap in pairs, from the most loaded rank while that lowers
   the maximum.
4. With tier budgets: the most loaded rank spends what is left of its own budgets on its
   shards (larger caches, faster chains: the move saving the most seconds per budget share)
   while it can; the step's time is the slowest rank's, so only that rank's savings count.

With tier budgets, 0-4 run on 95% and on 90% of the pool and the plan whose slowest rank is
faster wins; if neither packs, they run on smaller shares in turn.

The figure of merit is the imbalance, max over mean of per-rank cost (1.0 is perfect); round
robin placement of whole tables (`round_robin`) is the baseline.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._tier_cost import DEFAULT_TIER_MODEL
from ..errors import CapacityError, ConfigError
from ..placement import load_document
from ..spec import TierSpec
from ._table_profile import MissCurve, TableProfile, parse_tier_budgets, tables_from_profile
from ._tiering import (
    TIER_ORDER,
    Knapsack,
    Options,
    ShardShape,
    capacity_grid,
    chain_specs,
    fmt_bytes,
    options,
)
from .plan import Placement, Plan, even_columns

__all__ = ["MissCurve", "PlanReport", "TableProfile", "imbalance", "parse_tier_budgets",
           "plan_tables", "round_robin", "tables_from_profile"]

_SLACKS = (0.95, 0.9, 0.75, 0.5, 0.0)
"""Shares of the pooled budgets step 0 may fill: the first two are both tried (the faster
step wins; how well shards pack varies), the others in turn only if neither packs."""


@dataclass
class PlanReport:
    """The plan and its per-rank figures."""

    plan: Plan
    cost: np.ndarray
    """float64[world]: per-rank cost, in `unit`."""
    memory: np.ndarray
    """float64[world]: bytes stored on each rank (all tiers)."""
    unit: str = "bytes"
    """"bytes" looked up per step (one memory budget) or predicted "seconds" per step."""
    tier_memory: dict[str, np.ndarray] = field(default_factory=dict)
    """Per budgeted tier, float64[world] bytes it holds on each rank."""
    budgets: dict[str, float] = field(default_factory=dict)
    """Bytes per rank of each budgeted tier (inf: unbounded)."""
    lookup_bytes: np.ndarray | None = None
    """float64[world]: bytes of rows looked up per step on each rank, whatever the tiers."""

    @property
    def imbalance(self) -> float:
        """Max over mean of per-rank cost."""
        return imbalance(self.cost)

    def kinds(self) -> dict[str, int]:
        """How many tables got each kind of sharding."""
        out = {"table": 0, "row": 0, "column": 0}
        for p in self.plan.tables.values():
            out[p.kind] += 1
        return out

    def over_budget(self) -> float:
        """Largest use over budget of any bounded tier on any rank (> 1: over)."""
        ratios = [float(self.tier_memory[t].max() / b) for t, b in self.budgets.items()
                  if math.isfinite(b) and t in self.tier_memory]
        return max(ratios, default=0.0)


def imbalance(cost: np.ndarray) -> float:
    """Max over mean of per-rank cost (1.0: perfectly balanced)."""
    return float(np.max(cost) / np.mean(cost)) if np.mean(cost) > 0 else 1.0


def round_robin(tables: list[TableProfile], world: int, batch_size: int, *,
                tier_budgets: Mapping[str, float] | None = None,
                tier_model: str | os.PathLike[str] | dict[str, Any] | None = None
                ) -> PlanReport:
    """Whole tables on ranks 0, 1, ..., world-1, 0, ... in the order given (the baseline).

    With `tier_budgets`, each rank gives its tables the chains and caches that make its own
    step fastest within its budgets; a rank whose tables cannot fit them keeps each table's
    smallest chain, and `PlanReport.over_budget` says by how much it overflows.
    """
    placements = {t.name: Placement("table", (i % world,)) for i, t in enumerate(tables)}
    lookup = np.zeros(world)
    for i, t in enumerate(tables):
        lookup[i % world] += t.cost(batch_size)
    if tier_budgets is None:
        memory = np.zeros(world)
        for i, t in enumerate(tables):
            memory[i % world] += t.memory
        return PlanReport(Plan(world, placements), lookup.copy(), memory, lookup_bytes=lookup)
    tiers, cap, model = _tier_setup(tier_budgets, tier_model)
    cost, use = np.zeros(world), np.zeros((world, len(tiers)))
    chains: dict[int, dict[str, tuple[TierSpec, ...]]] = {}
    for r in range(world):
        mine = [t for i, t in enumerate(tables) if i % world == r]
        opts = [_options(t, batch_size, 1, tiers, model, "table") for t in mine]
        ks = Knapsack([x.seconds for x in opts], [x.use for x in opts], cap)
        if ks.fits():
            ks.run()
        cost[r] = ks.seconds()
        use[r] = ks.used
        chains[r] = {t.name: chain_specs(x.choice(c)) for t, x, c in zip(mine, opts, ks.cur,
                                                                         strict=True)}
    return _report(Plan(world, placements, chains), cost, use, tiers, cap, lookup)


def plan_tables(tables: list[TableProfile], world: int, batch_size: int,
                memory_per_rank: float | None = None, *,
                tier_budgets: Mapping[str, float] | None = None,
                tier_model: str | os.PathLike[str] | dict[str, Any] | None = None,
                split_above: float = 0.5, min_columns: int = 8) -> PlanReport:
    """Choose each table's sharding kind and owners (see the module docstring).

    Args:
        tables: the tables' profiles (`tables_from_profile` reads them from a profile).
        world: number of ranks.
        batch_size: samples per step (global).
        memory_per_rank: bytes each rank may store, all in DRAM (None: unbounded).
        tier_budgets: bytes per rank of each tier the shards may use (inf: unbounded; see
            `parse_tier_budgets`); the plan then gives every shard its chain and cache sizes
            (`Plan.tiers`) and the cost is in predicted seconds.
        tier_model: tier model document or path (`embstore bench tiers`); default
            `embstore._tier_cost.DEFAULT_TIER_MODEL`. Only with `tier_budgets`.
        split_above: split tables costing more than this times the mean per-rank cost.
        min_columns: fewest columns per column-wise shard.

    Raises:
        CapacityError: the tables do not fit the ranks' memory (the message names the table
            or tier and the budget).
        ConfigError: bad arguments, or a tier budget the tier model does not describe.
    """
    if world < 1 or batch_size < 1 or not tables:
        raise ConfigError("plan_tables needs tables, world >= 1 and batch_size >= 1")
    if tier_budgets is not None:
        if memory_per_rank is not None:
            raise ConfigError("give memory_per_rank or tier_budgets, not both")
        return _plan_tiered(tables, world, batch_size, tier_budgets, tier_model, split_above,
                            min_columns)
    if tier_model is not None:
        raise ConfigError("tier_model needs tier_budgets (the tiers the shards may use)")
    budget = math.inf if memory_per_rank is None else float(memory_per_rank)
    total_mem = sum(t.memory for t in tables)
    if total_mem > budget * world:
        raise CapacityError(f"the tables need {total_mem:.3g} bytes, {world} ranks hold "
                            f"{budget * world:.3g}", "add ranks or memory, or lower tiers")
    cost = [t.cost(batch_size) for t in tables]
    use = [np.array([float(t.memory)]) for t in tables]
    cap = np.array([budget])
    kinds, shards = _split(tables, world, cost, use, cap, split_above, min_columns)
    owners, rank_cost, rank_use, _ = _place(tables, shards, world, cap, ("memory",))
    return PlanReport(_placements(tables, world, kinds, owners), rank_cost, rank_use[:, 0],
                      lookup_bytes=rank_cost.copy())


# --- tier budgets -----------------------------------------------------------------------


def _tier_setup(budgets: Mapping[str, float], model: Any
                ) -> tuple[tuple[str, ...], np.ndarray, dict[str, Any]]:
    doc = DEFAULT_TIER_MODEL if model is None else load_document(model, "tiers")
    unknown = sorted(set(budgets) - set(TIER_ORDER))
    if unknown or not budgets:
        raise ConfigError(f"tier budgets name {unknown or 'no tier'}; use {list(TIER_ORDER)}")
    missing = sorted(t for t in budgets if t not in doc["tiers"])
    if missing:
        raise ConfigError(f"the tier budgets give {missing} but the tier model has no such "
                          "tier; measure it (embstore bench tiers) or drop the budget")
    tiers = tuple(t for t in TIER_ORDER if t in budgets)
    cap = np.array([float(budgets[t]) for t in tiers])
    if (cap <= 0).any():
        raise ConfigError(f"tier budgets must be positive, got {dict(budgets)}")
    return tiers, cap, doc


def _options(t: TableProfile, batch_size: int, parts: int, tiers: tuple[str, ...],
             model: dict[str, Any], kind: str, share: float = 1.0) -> Options:
    """The options of one shard (`share` of the columns for a column shard)."""
    distinct = t.distinct(batch_size)
    grid = capacity_grid(distinct, t.rows, t.curve.capacities if t.curve else ())
    if kind == "row":
        shape = ShardShape(t.rows / parts, distinct / parts, t.row_bytes, 1.0 / parts)
    else:
        shape = ShardShape(t.rows, distinct, t.row_bytes * share, 1.0)
    return options(shape, grid, t.miss_at, t.policy_at, tiers, model)


def _plan_tiered(tables: list[TableProfile], world: int, batch_size: int,
                 budgets: Mapping[str, float], model_src: Any, split_above: float,
                 min_columns: int) -> PlanReport:
    tiers, cap, model = _tier_setup(budgets, model_src)
    whole = [_options(t, batch_size, 1, tiers, model, "table") for t in tables]
    secs = [x.seconds for x in whole]
    use = [x.use for x in whole]
    pool = Knapsack(secs, use, cap * world)
    if not pool.fits():
        raise _pool_error(tables, pool, use, tiers, cap, world)
    error: CapacityError | None = None
    best: PlanReport | None = None
    for slack in _SLACKS:
        if best is not None and slack < _SLACKS[1]:
            break  # a plan from the fuller shares exists: the smaller ones only pad it
        ks = Knapsack(secs, use, cap * world * slack) if slack else pool
        if not ks.fits():
            continue  # this share of the pool cannot hold the tables at all
        if slack:
            ks.run()
        try:
            report = _place_tiered(tables, world, batch_size, tiers, cap, model, whole, ks.cur,
                                   split_above, min_columns)
        except CapacityError as exc:
            error = exc
            continue
        if best is None or report.cost.max() < best.cost.max():
            best = report
    if best is not None:
        return best
    assert error is not None
    raise error


def _pool_error(tables: list[TableProfile], pool: Knapsack, use: list[np.ndarray],
                tiers: tuple[str, ...], cap: np.ndarray, world: int) -> CapacityError:
    b = int(np.argmax(pool.used / cap))
    held = [float(u[c, b]) for u, c in zip(use, pool.cur, strict=True)]
    big = int(np.argmax(held))
    return CapacityError(
        f"the tables do not fit {world} rank{'s' if world > 1 else ''} with "
        f"{_describe_use(cap, tiers)} each: even "
        f"at their smallest they need {fmt_bytes(pool.used[b])} of {tiers[b]} (table "
        f"{tables[big].name!r} {fmt_bytes(held[big])}), where the ranks hold "
        f"{fmt_bytes(cap[b] * world)}",
        "raise the budgets, add ranks, or add an unbounded tier (rocksdb=unbounded)")


def _place_tiered(tables: list[TableProfile], world: int, batch_size: int,
                  tiers: tuple[str, ...], cap: np.ndarray, model: dict[str, Any],
                  whole: list[Options], picked: list[int], split_above: float,
                  min_columns: int) -> PlanReport:
    whole_cost = [float(x.seconds[p]) for x, p in zip(whole, picked, strict=True)]
    whole_use = [x.use[p] for x, p in zip(whole, picked, strict=True)]
    kinds, shards = _split(tables, world, whole_cost, whole_use, cap, split_above, min_columns)
    # each shard's options, and its step-0 pick in them (the same chain and table caches)
    shard_opts: dict[tuple[int, int], Options] = {}
    placed = []
    for i, part, k, _c, _u, share in shards:
        opts = _options(tables[i], batch_size, k, tiers, model, kinds[tables[i].name], share)
        shard_opts[(i, part)] = opts
        placed.append((i, part, k, float(opts.seconds[picked[i]]), opts.use[picked[i]], share))
    owners, cost, used, changed = _place(tables, placed, world, cap, tiers, shard_opts)
    # 4. the most loaded rank spends its leftover budgets while it can
    on_rank: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for i, ranks in owners.items():
        for part, r in enumerate(ranks):
            on_rank[r].append((i, part))
    sacks = []
    for r in range(world):
        keys = on_rank[r]
        ks = Knapsack([shard_opts[key].seconds for key in keys],
                      [shard_opts[key].use for key in keys], cap,
                      start=[changed.get(key, picked[key[0]]) for key in keys])
        sacks.append(ks)
        cost[r], used[r] = ks.seconds(), ks.used
    while True:
        top = int(np.argmax(cost))
        if sacks[top].step() is None:
            break
        cost[top], used[top] = sacks[top].seconds(), sacks[top].used
    share_of = {(s[0], s[1]): s[5] for s in shards}
    chains: dict[int, dict[str, tuple[TierSpec, ...]]] = {}
    lookup = np.zeros(world)
    for r in range(world):
        chains[r] = {}
        for (i, part), c in zip(on_rank[r], sacks[r].cur, strict=True):
            chains[r][tables[i].name] = chain_specs(shard_opts[(i, part)].choice(c))
            lookup[r] += share_of[(i, part)] * tables[i].cost(batch_size)
    plan = _placements(tables, world, kinds, owners)
    return _report(Plan(world, plan.tables, chains), cost, used, tiers, cap, lookup)


def _report(plan: Plan, cost: np.ndarray, use: np.ndarray, tiers: tuple[str, ...],
            cap: np.ndarray, lookup: np.ndarray) -> PlanReport:
    return PlanReport(plan, cost, use.sum(axis=1), "seconds",
                      {t: use[:, b].copy() for b, t in enumerate(tiers)},
                      {t: float(cap[b]) for b, t in enumerate(tiers)}, lookup)


# --- shared by both: splitting, placing, refining ---------------------------------------

_Shard = tuple[int, int, int, float, np.ndarray, float]
"""(table index, part, parts, cost, bytes per tier, share of the table)."""


def _split(tables: list[TableProfile], world: int, cost: list[float], use: list[np.ndarray],
           cap: np.ndarray, split_above: float, min_columns: int
           ) -> tuple[dict[str, str], list[_Shard]]:
    """1. Each table's kind and its shards."""
    mean = sum(cost) / world
    half = cap / 2
    shards: list[_Shard] = []
    kinds: dict[str, str] = {}
    for i, t in enumerate(tables):
        c, m = cost[i], use[i]
        k = 1
        if mean > 0 and c > split_above * mean:
            k = math.ceil(c / (split_above * mean))
        bounded = np.isfinite(half)
        if (m[bounded] > half[bounded]).any():
            k = max(k, max(math.ceil(x) for x in m[bounded] / half[bounded]))
        k = min(k, world)
        kind = "table"
        if k > 1:
            fits_half = not (m[bounded] > half[bounded]).any()
            kind = ("column" if t.column_split and t.dim // k >= min_columns and fits_half
                    else "row")
        kinds[t.name] = kind
        cols = even_columns(t.dim, tuple(range(k))) if kind == "column" else None
        for part in range(k):
            share: float = (cols[part + 1] - cols[part]) / t.dim if cols else 1.0 / k
            shards.append((i, part, k, c * share, m * share, share))
    return kinds, shards


def _place(tables: list[TableProfile], shards: list[_Shard], world: int, cap: np.ndarray,
           tiers: tuple[str, ...], alternatives: dict[tuple[int, int], Options] | None = None
           ) -> tuple[dict[int, list[int]], np.ndarray, np.ndarray, dict[tuple[int, int], int]]:
    """2 and 3: shards largest first on the least-loaded rank with room, then refined.

    A shard with `alternatives` (its options) that fits no rank as it is takes the option and
    rank that leave that rank least loaded among those that fit.

    Returns each table's ranks in part order (part j of a column-wise table holds the j-th
    range of `even_columns`), the per-rank cost and bytes per tier, and the option taken
    instead by each shard that had to change.
    """
    cost, used = np.zeros(world), np.zeros((world, len(cap)))
    owners: dict[int, list[int]] = {}
    changed: dict[tuple[int, int], int] = {}
    placed: dict[int, tuple[float, np.ndarray]] = {}
    for i, part, k, shard_cost, shard_use, _share in sorted(shards,
                                                           key=lambda s: (-s[3], s[0], s[1])):
        taken = owners.setdefault(i, [-1] * k)  # the rank of each part, in part order
        order = np.lexsort((np.arange(world), cost))
        free = [int(r) for r in order if int(r) not in taken]
        fits = [r for r in free if (used[r] + shard_use <= cap).all()]
        if fits:
            r = fits[0]
        elif alternatives is not None and (i, part) in alternatives:
            opts = alternatives[(i, part)]
            best = None
            for q in free:
                ok = (used[q] + opts.use <= cap).all(axis=1)
                if ok.any():
                    j = int(np.argmin(np.where(ok, opts.seconds, np.inf)))
                    if best is None or cost[q] + opts.seconds[j] < best[0]:
                        best = (cost[q] + opts.seconds[j], q, j)
            if best is None:
                raise _no_room(tables[i].name, shard_use, cap, tiers, world)
            _, r, j = best
            changed[(i, part)] = j
            shard_cost, shard_use = float(opts.seconds[j]), opts.use[j]
        else:
            raise _no_room(tables[i].name, shard_use, cap, tiers, world)
        taken[part] = r
        cost[r] += shard_cost
        used[r] += shard_use
        if k == 1:
            placed[i] = (shard_cost, shard_use)
    single = {i: owners[i][0] for i in owners if len(owners[i]) == 1}
    _refine(placed, single, cost, used, cap)
    for i, r in single.items():
        owners[i] = [r]
    return owners, cost, used, changed


def _no_room(name: str, use: np.ndarray, cap: np.ndarray, tiers: tuple[str, ...],
             world: int) -> CapacityError:
    return CapacityError(
        f"table {name!r}: no rank has room for a shard of {_describe_use(use, tiers)} "
        f"(per-rank budget {_describe_use(cap, tiers)}, {world} ranks)",
        "add ranks or memory per rank" if tiers == ("memory",) else
        "raise the budgets, add ranks, or add an unbounded tier (rocksdb=unbounded)")


def _describe_use(use: np.ndarray, tiers: tuple[str, ...]) -> str:
    if tiers == ("memory",):
        return f"{use[0]:.3g} bytes"
    return ",".join(f"{t}={fmt_bytes(u)}" for t, u in zip(tiers, use, strict=True))


def _placements(tables: list[TableProfile], world: int, kinds: dict[str, str],
                owners: dict[int, list[int]]) -> Plan:
    placements = {}
    for i, t in enumerate(tables):
        ranks = tuple(owners[i])
        if kinds[t.name] == "column":
            placements[t.name] = Placement("column", ranks, columns=even_columns(t.dim, ranks))
        else:
            placements[t.name] = Placement(kinds[t.name], ranks)
    return Plan(world, placements)


def _refine(one: dict[int, tuple[float, np.ndarray]], single: dict[int, int], cost: np.ndarray,
            used: np.ndarray, cap: np.ndarray, rounds: int = 2000) -> None:
    """Local search on table-wise shards: moves, then pairwise swaps, off the top rank."""
    for _ in range(rounds):
        top = int(np.argmax(cost))
        low = int(np.argmin(cost))
        on_top = [i for i, r in single.items() if r == top]
        gap = cost[top] - cost[low]
        best: tuple[float, int, int | None] | None = None
        for i in on_top:  # move: the table that best evens top and low
            c, m = one[i]
            if c < gap and (used[low] + m <= cap).all():
                score = abs(gap - 2 * c)
                if best is None or score < best[0]:
                    best = (score, i, None)
        if best is None:  # swap a table on top with a smaller one on low
            on_low = [j for j, r in single.items() if r == low]
            low_costs = np.array([one[j][0] for j in on_low])
            for i in on_top:
                c = one[i][0]
                if not len(low_costs):
                    break
                delta = c - low_costs
                ok = (delta > 0) & (delta < gap)
                if ok.any():
                    j_pos = int(np.argmin(np.where(ok, np.abs(gap - 2 * delta), np.inf)))
                    j = on_low[j_pos]
                    mem_ok = ((used[low] - one[j][1] + one[i][1] <= cap).all() and
                              (used[top] - one[i][1] + one[j][1] <= cap).all())
                    score = abs(gap - 2 * delta[j_pos])
                    if mem_ok and (best is None or score < best[0]):
                        best = (score, i, j)
        if best is None:
            return
        _, moved, swapped = best
        for idx, src, dst in (((moved, top, low),)
                              + (((swapped, low, top),) if swapped is not None else ())):
            c, m = one[idx]
            cost[src] -= c
            cost[dst] += c
            used[src] -= m
            used[dst] += m
            single[idx] = dst
