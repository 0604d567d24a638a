"""The sharding planner on a many-table configuration shaped like Meta's production statistics.

``python -m embstore.tools._shard_plan [--stats FILE] [--world 8 16] [--budget B] [--json]``
prints, per world size, the planner's imbalance (max over mean of per-rank cost) against
round-robin table placement, and the kinds it chose: first with one memory budget per rank
(all rows in DRAM; cost: bytes looked up per step), then with per-rank tier budgets
(`--budget`, default ``dram=10%,pmem=40%,rocksdb=unbounded``: percentages of the tables'
bytes over the ranks; cost: predicted seconds per step through the chains each rank gives its
shards, with the tier model of `--tiers` or the default one, `embstore._tier_cost`).
Round robin with tier budgets gives each rank's tables the chains that make that rank
fastest within its budgets.

The configuration: the tables, batch size, mean lookups per sample per table and the share of
distinct ids (unique / lookups) are read from a dlrm_datasets ``locality_stats.txt`` (mean of
its blocks; 2021: 856 tables, 65,536 samples, 8.78 lookups per sample per table (8.35 in the
16 numbered blocks, 15.8 in the first, whole-trace one), 13 % distinct ids). The published
statistics do not give per-table figures, so each table draws, from a fixed seed, a pooling
factor (log-normal, sigma 1, scaled to that mean), a row count (log-uniform, 10**3 to 10**8)
and a dim (32, 64, 128 or 256); every rank may store 1.25 times its even share of the rows.
With tier budgets each table also gets a miss-ratio curve: ids drawn from a Zipf law over its
rows whose exponent gives the table the statistics' share of distinct ids per batch, cached
by popularity (`zipf_curve`); the statistics say nothing of reuse across batches, so this is
a stationary assumption, not a measurement.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from embstore.distributed.planner import (
    MissCurve,
    TableProfile,
    parse_tier_budgets,
    plan_tables,
    round_robin,
)
from embstore.errors import EmbstoreError
from embstore.tools._args import Parser, positive_int

DEFAULT_STATS = Path("/work/shared/traces/dlrm_datasets/2021/locality_stats.txt")


def read_shape(path: Path) -> dict[str, float]:
    """Tables, batch size, lookups per sample per table and distinct share, over all blocks."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise EmbstoreError(f"{path}: not a text file of locality statistics ({exc})") from None
    blocks = [b for b in re.split(r"\n\s*\n", text) if "Avg # of indices" in b]
    if not blocks:
        raise EmbstoreError(f"{path}: no locality statistics found")
    tables, batch, ratio, unique = [], [], [], []
    for k, b in enumerate(blocks):
        m = re.search(r"_t(\d+)_bs(\d+)", b)
        found_n = re.search(r"Avg # of indices: (\d+)", b)
        found_u = re.search(r"Avg # of unique cols: (\d+)", b)
        if m is None or found_n is None or found_u is None:
            raise EmbstoreError(f"{path}: statistics block {k + 1} lacks its trace name "
                                "(..._t<tables>_bs<batch>...), 'Avg # of indices: N' or "
                                "'Avg # of unique cols: N'")
        n, u = float(found_n.group(1)), float(found_u.group(1))
        t, bs = int(m.group(1)), int(m.group(2))
        if not (t > 0 and bs > 0 and 0 < u <= n):
            raise EmbstoreError(f"{path}: statistics block {k + 1} gives {t} tables, batch "
                                f"{bs}, {n:g} indices and {u:g} unique ones; each must be "
                                "positive, with no more unique indices than indices")
        tables.append(t)
        batch.append(bs)
        ratio.append(n / (t * bs))
        unique.append(u / n)
    return {"tables": int(np.median(tables)), "batch_size": int(np.median(batch)),
            "lookups_per_sample": float(np.mean(ratio)), "unique_ratio": float(np.mean(unique))}


def production_like(shape: dict[str, float], seed: int = 0) -> list[TableProfile]:
    """Per-table profiles drawn to match `shape` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    n = int(shape["tables"])
    pooling = rng.lognormal(0.0, 1.0, n)
    pooling *= shape["lookups_per_sample"] / pooling.mean()
    rows = np.round(10 ** rng.uniform(3, 8, n)).astype(np.int64)
    dims = rng.choice([32, 64, 128, 256], n, p=[0.2, 0.4, 0.3, 0.1])
    return [TableProfile(f"t{i}", int(rows[i]), int(dims[i]), float(pooling[i]),
                         unique_ratio=shape["unique_ratio"]) for i in range(n)]


def zipf_curve(rows: int, accesses: float, distinct_ratio: float,
               points: int = 16) -> MissCurve:
    """Miss ratios of a cache of a table's most popular rows, ids Zipf-distributed.

    The exponent (in [0, 3]) is the one at which `accesses` draws from `rows` rows give
    `distinct_ratio` distinct ids (expected: row i appears with probability 1 - exp(-n q_i));
    a cache of the C most popular rows then misses the share of the distinct ids ranked
    beyond C. Ranks above 1024 are summed over 256 log-spaced bins.
    """
    exact = min(rows, 1024)
    x = np.arange(1, exact + 1, dtype=np.float64)
    width = np.ones(exact)
    upper = x + 0.5
    if rows > exact:
        edges = np.geomspace(exact + 0.5, rows + 0.5, 257)
        x = np.concatenate([x, np.sqrt(edges[:-1] * edges[1:])])
        width = np.concatenate([width, np.diff(edges)])
        upper = np.concatenate([upper, edges[1:]])
    log_x = np.log(x)

    def present(alpha: float) -> np.ndarray:
        q = np.exp(-alpha * log_x)
        q /= (q * width).sum()
        return -np.expm1(-accesses * q) * width

    lo, hi = 0.0, 3.0
    if present(lo).sum() / accesses <= distinct_ratio:
        alpha = lo
    elif present(hi).sum() / accesses >= distinct_ratio:
        alpha = hi
    else:
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if present(mid).sum() / accesses > distinct_ratio else (lo, mid)
        alpha = (lo + hi) / 2
    p = present(alpha)
    hits = np.concatenate([[0.0], np.cumsum(p)]) / p.sum()
    caps = np.geomspace(max(1.0, min(rows / 2, p.sum())), rows, points)
    miss = np.clip(1 - np.interp(caps, np.concatenate([[0.5], upper]), hits), 0.0, 1.0)
    return MissCurve(tuple(caps), tuple(miss))


def with_curves(tables: list[TableProfile], batch_size: int) -> list[TableProfile]:
    """`tables` with the miss-ratio curve of `zipf_curve` each."""
    return [replace(t, curve=zipf_curve(t.rows, batch_size * t.lookups_per_sample,
                                        t.unique_ratio)) for t in tables]


def report(tables: list[TableProfile], world: int, batch_size: int) -> dict[str, object]:
    """Planner against round robin for one world size, one memory budget per rank."""
    total = sum(t.memory for t in tables)
    budget = 1.25 * total / world
    planned = plan_tables(tables, world, batch_size, budget)
    rr = round_robin(tables, world, batch_size)
    return {"world": world, "tables": len(tables),
            "imbalance_planner": round(planned.imbalance, 4),
            "imbalance_round_robin": round(rr.imbalance, 4),
            "memory_max_over_budget_planner": round(float(planned.memory.max() / budget), 3),
            "memory_max_over_budget_round_robin": round(float(rr.memory.max() / budget), 3),
            "kinds": planned.kinds()}


def report_tiers(tables: list[TableProfile], world: int, batch_size: int, budget: str,
                 model: Any = None) -> dict[str, Any]:
    """Planner against round robin for one world size with per-rank tier budgets."""
    share = sum(t.memory for t in tables) / world
    budgets = parse_tier_budgets(budget, share_of=share)
    planned = plan_tables(tables, world, batch_size, tier_budgets=budgets, tier_model=model)
    rr = round_robin(tables, world, batch_size, tier_budgets=budgets, tier_model=model)
    chains: dict[str, int] = {}
    for per in planned.plan.tiers.values():
        for chain in per.values():
            key = ">".join(t.backend for t in chain)
            chains[key] = chains.get(key, 0) + 1
    return {"world": world, "budgets": {t: None if math.isinf(b) else round(b)
                                        for t, b in budgets.items()},
            "imbalance_planner": round(planned.imbalance, 4),
            "imbalance_round_robin": round(rr.imbalance, 4),
            "step_seconds_planner": round(float(planned.cost.max()), 4),
            "step_seconds_round_robin": round(float(rr.cost.max()), 4),
            "lookup_bytes_imbalance_planner": round(float(
                planned.lookup_bytes.max() / planned.lookup_bytes.mean()), 4)
            if planned.lookup_bytes is not None else None,
            "tier_max_over_budget_planner": round(planned.over_budget(), 4),
            "tier_max_over_budget_round_robin": round(rr.over_budget(), 4),
            "kinds": planned.kinds(), "chains": dict(sorted(chains.items()))}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: print the imbalance figures."""
    ap = Parser(prog="python -m embstore.tools._shard_plan",
                description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--stats", type=Path, default=DEFAULT_STATS)
    ap.add_argument("--world", type=positive_int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", default="dram=10%,pmem=40%,rocksdb=unbounded",
                    help="per-rank tier budgets: sizes, 'unbounded', or percentages of the "
                         "tables' bytes per rank ('none': skip the tiered plans)")
    ap.add_argument("--tiers", type=Path, default=None,
                    help="tier model (embstore bench tiers); default: embstore._tier_cost's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        shape = read_shape(args.stats)
        tables = production_like(shape, args.seed)
        batch = int(shape["batch_size"])
        rows = [report(tables, w, batch) for w in args.world]
        tiered = []
        if args.budget != "none":
            curved = with_curves(tables, batch)
            tiered = [report_tiers(curved, w, batch, args.budget, args.tiers)
                      for w in args.world]
    except (EmbstoreError, OSError) as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"shape": shape, "results": rows, "tiered": tiered}, indent=1))
        return 0
    print(f"{shape['tables']} tables, batch {shape['batch_size']}, "
          f"{shape['lookups_per_sample']:.2f} lookups/sample/table, "
          f"{100 * shape['unique_ratio']:.1f}% distinct")
    print("one memory budget per rank (1.25x the even share), cost = bytes looked up:")
    for r in rows:
        print(f"world {r['world']:>3}: imbalance planner {r['imbalance_planner']:.3f}  "
              f"round-robin {r['imbalance_round_robin']:.3f}  "
              f"(memory max/budget {r['memory_max_over_budget_planner']:.2f} vs "
              f"{r['memory_max_over_budget_round_robin']:.2f})  kinds {r['kinds']}")
    if tiered:
        print(f"tier budgets {args.budget} per rank, cost = predicted seconds per step:")
    for r in tiered:
        print(f"world {r['world']:>3}: imbalance planner {r['imbalance_planner']:.3f}  "
              f"round-robin {r['imbalance_round_robin']:.3f}  (step {r['step_seconds_planner']}"
              f" s vs {r['step_seconds_round_robin']} s; tier max/budget "
              f"{r['tier_max_over_budget_planner']:.2f} vs "
              f"{r['tier_max_over_budget_round_robin']:.2f})  kinds {r['kinds']}")
        print(f"           chains {r['chains']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
