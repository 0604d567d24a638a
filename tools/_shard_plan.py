"""The sharding planner on a many-table configuration shaped like Meta's production statistics.

``python -m embstore.tools._shard_plan [--stats FILE] [--world 8 16] [--json]`` prints, per
world size, the planner's imbalance (max over mean of per-rank bytes looked up per step)
against round-robin table placement, and the kinds it chose.

The configuration: the tables, batch size, mean lookups per sample per table and the share of
distinct ids (unique / lookups) are read from a dlrm_datasets ``locality_stats.txt`` (mean of
its blocks; 2021: 856 tables, 65,536 samples, 8.35 lookups per sample per table, 13 % distinct
ids). The published statistics do not give per-table figures, so each table draws, from a
fixed seed, a pooling factor (log-normal, sigma 1, scaled to that mean), a row count
(log-uniform, 10**3 to 10**8) and a dim (32, 64, 128 or 256); every rank may store 1.25 times
its even share of the rows.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from embstore.distributed.planner import TableProfile, plan_tables, round_robin

DEFAULT_STATS = Path("/work/shared/traces/dlrm_datasets/2021/locality_stats.txt")


def read_shape(path: Path) -> dict[str, float]:
    """Tables, batch size, lookups per sample per table and distinct share, over all blocks."""
    text = path.read_text()
    blocks = [b for b in re.split(r"\n\s*\n", text) if "Avg # of indices" in b]
    if not blocks:
        raise SystemExit(f"{path}: no locality statistics found")
    tables, batch, ratio, unique = [], [], [], []
    for b in blocks:
        m = re.search(r"_t(\d+)_bs(\d+)", b)
        n = float(re.search(r"Avg # of indices: (\d+)", b).group(1))  # type: ignore[union-attr]
        u = float(re.search(r"Avg # of unique cols: (\d+)", b).group(1))  # type: ignore[union-attr]
        assert m is not None
        t, bs = int(m.group(1)), int(m.group(2))
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


def report(tables: list[TableProfile], world: int, batch_size: int) -> dict[str, object]:
    """Planner against round robin for one world size."""
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


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: print the imbalance figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stats", type=Path, default=DEFAULT_STATS)
    ap.add_argument("--world", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    shape = read_shape(args.stats)
    tables = production_like(shape, args.seed)
    rows = [report(tables, w, int(shape["batch_size"])) for w in args.world]
    if args.json:
        print(json.dumps({"shape": shape, "results": rows}, indent=1))
    else:
        print(f"{shape['tables']} tables, batch {shape['batch_size']}, "
              f"{shape['lookups_per_sample']:.2f} lookups/sample/table, "
              f"{100 * shape['unique_ratio']:.1f}% distinct")
        for r in rows:
            print(f"world {r['world']:>3}: imbalance planner {r['imbalance_planner']:.3f}  "
                  f"round-robin {r['imbalance_round_robin']:.3f}  "
                  f"(memory max/budget {r['memory_max_over_budget_planner']:.2f} vs "
                  f"{r['memory_max_over_budget_round_robin']:.2f})  kinds {r['kinds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
