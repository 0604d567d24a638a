"""`embstore demo`: the store on a synthetic recommendation workload, reporting what happened.

Two tables, as a DLRM would have them: a small hot table held entirely in DRAM and a large
one on RocksDB behind a small DRAM cache. Batches of Zipf-distributed ids are looked up and
trained with fused row-wise Adagrad; the store is flushed, reopened from its path alone, and
checked against rows saved before closing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import embstore
from embstore import TableSpec, TierSpec
from embstore.tools.workload import ZipfIds

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand."""
    p = sub.add_parser("demo", help="run the store on a synthetic workload and report")
    p.add_argument("--path", help="store directory (default: a temporary one)")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--rows", type=int, default=1_000_000, help="distinct ids of the big table")
    p.add_argument("--cache-rows", type=int, default=50_000, help="DRAM cache of the big table")
    p.set_defaults(func=run)


def _report_tiers(store: embstore.EmbeddingStore) -> None:
    for name, info in store.stats().items():
        for tier in info["tiers"]:
            ratio = tier.hits / tier.lookups if tier.lookups else 0.0
            cap = "unbounded" if tier.capacity_rows is None else f"cap {tier.capacity_rows:,}"
            print(f"  {name:<6} tier {tier.level} {tier.backend:<8} {cap:<14} "
                  f"lookups {tier.lookups:>10,}  hit ratio {ratio:6.1%}  rows {tier.rows:>9,}  "
                  f"promoted {tier.promotions:>8,}  evicted {tier.evictions:>8,}  "
                  f"written back {tier.writebacks:>8,}")


def run(args: argparse.Namespace) -> int:
    """Run the demonstration; exit 1 if the reopened store disagrees with what was saved."""
    tmp = None
    if args.path is None:
        tmp = tempfile.TemporaryDirectory(prefix="embstore-demo-")
        path = Path(tmp.name) / "store"
    else:
        path = Path(args.path)
    optimizer = embstore.optim.RowWiseAdagrad(lr=0.05)
    tables = [
        TableSpec("hot", dim=16, init=embstore.init.Uniform(-0.05, 0.05, seed=1),
                  optimizer=optimizer),
        TableSpec("big", dim=64, init=embstore.init.Uniform(-0.05, 0.05, seed=2),
                  optimizer=optimizer,
                  tiers=(TierSpec("dram", capacity=args.cache_rows, eviction="clock"),
                         TierSpec("rocksdb"))),
    ]
    hot_ids, big_ids = ZipfIds(10_000, 1.2, seed=1), ZipfIds(args.rows, 1.05, seed=2)
    rng = np.random.default_rng(0)
    print(f"store at {path}: table 'hot' 10,000 ids x 16 all in DRAM; table 'big' "
          f"{args.rows:,} ids x 64 on rocksdb behind a {args.cache_rows:,}-row DRAM cache")
    t0 = time.perf_counter()
    looked_up = 0
    with embstore.open(path, tables=tables) as store:
        for _ in range(args.batches):
            for name, zipf in (("hot", hot_ids), ("big", big_ids)):
                ids = zipf.ids[zipf.ranks(args.batch_size)]
                rows = store.lookup(name, ids)
                # a stand-in for the model's backward pass: pull rows towards a fixed target
                grads = (rows - 0.01 * np.sign(rows + 1e-9)).astype(np.float32)
                grads += rng.standard_normal(grads.shape, dtype=np.float32) * 0.01
                store.apply_gradients(name, ids, grads)
                looked_up += len(ids)
        elapsed = time.perf_counter() - t0
        print(f"trained {args.batches} batches x {args.batch_size:,} ids x 2 tables "
              f"({looked_up:,} lookups + as many gradient rows) in {elapsed:.1f} s: "
              f"{2 * looked_up / elapsed:,.0f} rows/s")
        _report_tiers(store)
        probe = big_ids.ids[:1000]
        saved_rows = store.lookup("big", probe)
        saved_state = store.lookup_state("big", probe)
        t1 = time.perf_counter()
        store.flush()
        print(f"flush: every dirty cache row written down to rocksdb and synced in "
              f"{time.perf_counter() - t1:.2f} s")
        counts = {name: store.num_rows(name) for name in store.tables}
    with embstore.open(path) as store:
        ok = (np.array_equal(store.lookup("big", probe), saved_rows)
              and np.array_equal(store.lookup_state("big", probe), saved_state)
              and all(store.num_rows(n) == c for n, c in counts.items()))
        print(f"reopened from the path alone: {counts['hot']:,} + {counts['big']:,} rows; "
              f"the 1,000 hottest 'big' rows and their Adagrad state "
              f"{'match' if ok else 'DO NOT match'} what was saved")
        info = store.describe()
    disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"on disk: {disk / 2**20:,.1f} MiB in {path}; "
          f"big table {info['tables']['big']['rows']:,} rows")
    if tmp is not None:
        tmp.cleanup()
    return 0 if ok else 1
