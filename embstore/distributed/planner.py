"""A sharding planner: kinds and owners of every table, balancing bytes looked up per rank.

Cost model (per training step): a table's lookup cost is the bytes of the rows it serves,
``batch_size * lookups_per_sample * unique_ratio * dim * itemsize``; its memory is
``rows * row_bytes`` (weights plus optimizer state). A shard of a row-wise table over k ranks
costs 1/k of both (hashing spreads hot rows; in expectation); a column shard of c columns
costs c/dim of both, exactly, but every column owner receives every id.

Algorithm (longest-processing-time first, with splitting):

1. A table is split when its cost exceeds `split_above` times the mean per-rank cost, or its
   memory exceeds half a rank's budget: into k = ceil(cost / (split_above * mean)) parts (at
   least enough for memory), column-wise when its dim gives each part >= `min_columns`
   columns and its memory fits half a rank, row-wise by hash otherwise.
2. Shards are placed largest cost first on the least-loaded rank with memory to spare (the
   parts of one table on distinct ranks).
3. Table-wise shards then move, or swap in pairs, from the most loaded rank while that lowers
   the maximum.

The figure of merit is the imbalance, max over mean of per-rank cost (1.0 is perfect); round
robin placement of whole tables (`round_robin`) is the baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import CapacityError, ConfigError
from .plan import Placement, Plan, even_columns

__all__ = ["PlanReport", "TableProfile", "imbalance", "plan_tables", "round_robin"]


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
    """

    name: str
    rows: int
    dim: int
    lookups_per_sample: float
    itemsize: int = 4
    state_width: int = 1
    unique_ratio: float = 1.0

    def cost(self, batch_size: int) -> float:
        """Bytes of rows looked up per step."""
        return batch_size * self.lookups_per_sample * self.unique_ratio * self.dim * self.itemsize

    @property
    def memory(self) -> int:
        """Bytes of stored rows."""
        return self.rows * (self.dim + self.state_width) * self.itemsize


@dataclass
class PlanReport:
    """The plan and its per-rank figures."""

    plan: Plan
    cost: np.ndarray
    """float64[world]: bytes looked up per step on each rank."""
    memory: np.ndarray
    """float64[world]: bytes stored on each rank."""

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


def imbalance(cost: np.ndarray) -> float:
    """Max over mean of per-rank cost (1.0: perfectly balanced)."""
    return float(np.max(cost) / np.mean(cost)) if np.mean(cost) > 0 else 1.0


def round_robin(tables: list[TableProfile], world: int, batch_size: int) -> PlanReport:
    """Whole tables on ranks 0, 1, ..., world-1, 0, ... in the order given (the baseline)."""
    cost, memory = np.zeros(world), np.zeros(world)
    placements = {}
    for i, t in enumerate(tables):
        cost[i % world] += t.cost(batch_size)
        memory[i % world] += t.memory
        placements[t.name] = Placement("table", (i % world,))
    return PlanReport(Plan(world, placements), cost, memory)


def plan_tables(tables: list[TableProfile], world: int, batch_size: int,
                memory_per_rank: float | None = None, *, split_above: float = 0.5,
                min_columns: int = 8) -> PlanReport:
    """Choose each table's sharding kind and owners (see the module docstring).

    Args:
        tables: the tables' profiles.
        world: number of ranks.
        batch_size: samples per step (global).
        memory_per_rank: bytes each rank may store (None: unbounded).
        split_above: split tables costing more than this times the mean per-rank cost.
        min_columns: fewest columns per column-wise shard.

    Raises:
        CapacityError: the tables do not fit the ranks' memory.
        ConfigError: bad arguments.
    """
    if world < 1 or batch_size < 1 or not tables:
        raise ConfigError("plan_tables needs tables, world >= 1 and batch_size >= 1")
    budget = math.inf if memory_per_rank is None else float(memory_per_rank)
    total_mem = sum(t.memory for t in tables)
    if total_mem > budget * world:
        raise CapacityError(f"the tables need {total_mem:.3g} bytes, {world} ranks hold "
                            f"{budget * world:.3g}", "add ranks or memory, or lower tiers")
    mean = sum(t.cost(batch_size) for t in tables) / world
    # 1. shards: (table index, part, parts, cost, memory, kind)
    shards = []
    kinds: dict[str, str] = {}
    for i, t in enumerate(tables):
        c, m = t.cost(batch_size), t.memory
        k = 1
        if c > split_above * mean:
            k = math.ceil(c / (split_above * mean))
        if m > budget / 2:
            k = max(k, math.ceil(m / (budget / 2)))
        k = min(k, world)
        kind = "table"
        if k > 1:
            kind = "column" if t.dim // k >= min_columns and m <= budget / 2 else "row"
        kinds[t.name] = kind
        cols = even_columns(t.dim, tuple(range(k))) if kind == "column" else None
        for part in range(k):
            share: float = (cols[part + 1] - cols[part]) / t.dim if cols else 1.0 / k
            shards.append((i, part, k, c * share, m * share))
    # 2. largest first on the least-loaded rank with room, one part of a table per rank
    cost, memory = np.zeros(world), np.zeros(world)
    owners: dict[int, list[int]] = {}
    for i, _part, _k, shard_cost, shard_mem in sorted(shards,
                                                      key=lambda s: (-s[3], s[0], s[1])):
        taken = owners.setdefault(i, [])
        order = np.lexsort((np.arange(world), cost))
        for r in order:
            if int(r) not in taken and memory[r] + shard_mem <= budget:
                break
        else:
            raise CapacityError(f"table {tables[i].name!r}: no rank has room for a shard of "
                                f"{shard_mem:.3g} bytes", "add ranks or memory per rank")
        taken.append(int(r))
        cost[r] += shard_cost
        memory[r] += shard_mem
    # 3. move or swap whole tables off the most loaded rank while the maximum drops
    single = {i: owners[i][0] for i in owners if len(owners[i]) == 1}
    _refine(tables, single, cost, memory, batch_size, budget)
    for i, r in single.items():
        owners[i] = [r]
    placements = {}
    for i, t in enumerate(tables):
        ranks = tuple(owners[i])
        if kinds[t.name] == "column":
            placements[t.name] = Placement("column", ranks, columns=even_columns(t.dim, ranks))
        elif kinds[t.name] == "row":
            placements[t.name] = Placement("row", ranks)
        else:
            placements[t.name] = Placement("table", ranks)
    return PlanReport(Plan(world, placements), cost, memory)


def _refine(tables: list[TableProfile], single: dict[int, int], cost: np.ndarray,
            memory: np.ndarray, batch_size: int, budget: float, rounds: int = 2000) -> None:
    """Local search on table-wise shards: moves, then pairwise swaps, off the top rank."""
    for _ in range(rounds):
        top = int(np.argmax(cost))
        low = int(np.argmin(cost))
        on_top = [i for i, r in single.items() if r == top]
        gap = cost[top] - cost[low]
        best: tuple[float, int, int | None] | None = None
        for i in on_top:  # move: the table that best evens top and low
            c, m = tables[i].cost(batch_size), tables[i].memory
            if c < gap and memory[low] + m <= budget:
                score = abs(gap - 2 * c)
                if best is None or score < best[0]:
                    best = (score, i, None)
        if best is None:  # swap a table on top with a smaller one on low
            on_low = [j for j, r in single.items() if r == low]
            low_costs = np.array([tables[j].cost(batch_size) for j in on_low])
            for i in on_top:
                c = tables[i].cost(batch_size)
                if not len(low_costs):
                    break
                delta = c - low_costs
                ok = (delta > 0) & (delta < gap)
                if ok.any():
                    j_pos = int(np.argmin(np.where(ok, np.abs(gap - 2 * delta), np.inf)))
                    j = on_low[j_pos]
                    mem_ok = (memory[low] - tables[j].memory + tables[i].memory <= budget and
                              memory[top] - tables[i].memory + tables[j].memory <= budget)
                    score = abs(gap - 2 * delta[j_pos])
                    if mem_ok and (best is None or score < best[0]):
                        best = (score, i, j)
        if best is None:
            return
        _, moved, swapped = best
        for idx, src, dst in (((moved, top, low),)
                              + (((swapped, low, top),) if swapped is not None else ())):
            c, m = tables[idx].cost(batch_size), tables[idx].memory
            cost[src] -= c
            cost[dst] += c
            memory[src] -= m
            memory[dst] += m
            single[idx] = dst
