"""The tier hierarchy: hit-path cost, and training through a table 10x larger than its DRAM tier.

Part 1 (hit path): every id of a batch is in the DRAM tier of a DRAM-over-rocksdb chain; its
lookups are timed against the same lookups on a DRAM-only store, per eviction policy.

Part 2 (end to end): the calibrated synthetic trace (embstore.traces, profile 2021) is looked
up and trained (row-wise Adagrad) batch after batch through a DRAM tier holding a tenth of the
distinct ids, over a rocksdb and over a pmem bottom tier. Its throughput is compared with
(a) the same work on a DRAM-only store, and (b) the limit that the raw speeds of the two tiers
allow for the hits and misses observed: DRAM-only time for the same work plus the time the raw
bottom-tier backend takes to replay exactly the batched reads and writes that reached it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import embstore
from embstore import TableSpec, TierSpec, registry
from embstore.traces import synthesize
from embstore.workload import ZipfIds

from ._benchutil import interleaved_medians, print_table

OPT = embstore.optim.RowWiseAdagrad(lr=0.01)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench hierarchy`."""
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows for the hit path")
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batches", type=int, default=48, help="trace batches, end to end")
    parser.add_argument("--eviction", default="clock", help="DRAM tier eviction, end to end")
    parser.add_argument("--admission", default="always", help="DRAM tier admission")
    parser.add_argument("--bottoms", default="rocksdb,pmem", help="bottom tiers to try")
    parser.add_argument("--parts", default="hit,e2e", help="which parts to run (hit,e2e)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")


def hit_path(args: argparse.Namespace, root: Path) -> None:
    """Lookups that all hit the DRAM tier, against a DRAM-only store."""
    n, dim = args.rows, 64
    zipf = ZipfIds(n, seed=0)
    dense = np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32)
    stores = {"dram-only": embstore.open(None, tables=[TableSpec("t", dim=dim)])}
    for ev in ("lru", "clock", "s3fifo", "lfu", "fifo"):
        stores[f"dram({ev})-over-rocksdb"] = embstore.open(
            root / f"hit-{ev}", tables=[TableSpec("t", dim=dim)],
            tiers=[TierSpec("dram", capacity=n, eviction=ev), TierSpec("rocksdb")])
    for store in stores.values():
        for start in range(0, n, 1 << 18):
            store.update("t", zipf.ids[start:start + (1 << 18)], dense[start:start + (1 << 18)])
    batches = [zipf.ids[zipf.ranks(args.batch)] for _ in range(args.repeats)]
    med = interleaved_medians(
        {name: (lambda i, s=s: s.lookup("t", batches[i])) for name, s in stores.items()},
        args.repeats)
    for name, store in stores.items():
        if name != "dram-only":
            top = store.tier_statistics("t")[0]
            assert top.misses == 0, f"{name}: the hit-path batches missed the DRAM tier"
        store.close()
    base = med["dram-only"]
    print_table(f"hit path: {args.batch:,} Zipf ids, all in the DRAM tier ({n:,} x {dim})",
                [(f"{name}{' [baseline]' if name == 'dram-only' else ''}",
                  args.batch / t, base / t) for name, t in med.items()])


def _record_bottom(store: embstore.EmbeddingStore) -> list[tuple[str, np.ndarray]]:
    """Log every batched read and write the store sends to its bottom tier, in order."""
    backend = store._tables["t"].chain.tiers[-1].backend
    log: list[tuple[str, np.ndarray]] = []
    get, put = backend.get, backend.put

    def logged_get(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        log.append(("get", ids.copy()))
        return get(ids)

    def logged_put(ids: np.ndarray, rows: np.ndarray) -> None:
        log.append(("put", ids.copy()))
        put(ids, rows)

    backend.get, backend.put = logged_get, logged_put  # instance attributes: this store only
    return log


def _replay_seconds(backend: str, root: Path, log: list[tuple[str, np.ndarray]],
                    width: int) -> float:
    """Seconds the raw backend takes for exactly the reads and writes of `log`, from empty:
    the bottom tier's share of the limit, with its access pattern and background work."""
    from embstore.backend import BackendSpec

    cls = registry.load_backend(backend)
    rows = np.random.default_rng(1).standard_normal(
        (max((len(ids) for _, ids in log), default=0), width)).astype(np.float32)
    with cls.open(BackendSpec(path=root / f"replay-{backend}", dim=width, table="t")) as b:
        t0 = time.perf_counter()
        for op, ids in log:
            if op == "get":
                b.get(ids)
            else:
                b.put(ids, rows[: len(ids)])
        return time.perf_counter() - t0


def end_to_end(args: argparse.Namespace, root: Path) -> None:
    """Train the calibrated trace through a 10x-oversubscribed DRAM tier."""
    lookups = 1 << 18 if args.quick else 1 << 20
    trace = [b for big in synthesize(args.batches * args.batch // lookups + 1, seed=7,
                                     lookups=lookups)
             for b in np.array_split(big, max(1, len(big) // args.batch))][: args.batches]
    distinct = np.unique(np.concatenate(trace))
    cache_rows = max(1, len(distinct) // 10)
    dim = 64
    spec = TableSpec("t", dim=dim, init=embstore.init.Uniform(seed=1), optimizer=OPT)
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal((len(b), dim)).astype(np.float32) * 0.01 for b in trace]

    def train(store: embstore.EmbeddingStore) -> float:
        t0 = time.perf_counter()
        for ids, g in zip(trace, grads, strict=True):
            store.lookup("t", ids)
            store.apply_gradients("t", ids, g)
        return time.perf_counter() - t0

    with embstore.open(None, tables=[spec]) as dram_only:
        t_dram = train(dram_only)
    n_ids = sum(len(b) for b in trace)
    print(f"end to end: {len(trace)} batches of {args.batch:,} ids from the calibrated trace "
          f"(profile 2021), {len(distinct):,} distinct ids x {dim}; DRAM tier "
          f"{cache_rows:,} rows ({args.eviction}, admission {args.admission}); "
          f"lookup + row-wise Adagrad step per batch")
    rows = [("all in DRAM (dram-only store) [baseline]", n_ids / t_dram, 1.0, float("nan"))]
    for bottom in args.bottoms.split(","):
        if bottom not in registry.available_backend_names():
            print(f"  ({bottom}: unavailable, skipped)")
            continue
        tiers = [TierSpec("dram", capacity=cache_rows, eviction=args.eviction,
                          admission=args.admission), TierSpec(bottom)]
        with embstore.open(root / f"e2e-{bottom}", tables=[spec], tiers=tiers) as store:
            log = _record_bottom(store)
            t = train(store)
            top, low = store.tier_statistics("t")
        t_bottom = _replay_seconds(bottom, root, log, spec.row_width)
        limit = t_dram + t_bottom
        moved = sum(len(ids) for _, ids in log)
        print(f"  {bottom}: DRAM tier hit ratio {top.hits / top.lookups:.1%} "
              f"({top.misses:,} misses, {low.lookups:,} distinct reads below, "
              f"{top.writebacks:,} write-backs); the raw {bottom} backend replays those "
              f"{moved:,} row reads and writes in {t_bottom:.2f} s")
        rows.append((f"dram cache over {bottom}", n_ids / t, t_dram / t, limit / t))
    print(f"  {'contender':<44}{'ids/s':>12}{'vs DRAM':>9}{'vs limit':>10}")
    for name, rate, vs_dram, vs_limit in rows:
        lim = "" if np.isnan(vs_limit) else f"{vs_limit:>9.2f}x"
        print(f"  {name:<44}{rate:>12,.0f}{vs_dram:>8.2f}x{lim}")


def run(args: argparse.Namespace) -> int:
    """Run both parts and print their tables."""
    if args.quick:
        args.rows, args.batch, args.repeats, args.batches = 20_000, 4096, 3, 8
    with tempfile.TemporaryDirectory(prefix="embstore-bench-") as tmp:
        parts = args.parts.split(",")
        if "hit" in parts:
            hit_path(args, Path(tmp))
        if "e2e" in parts:
            end_to_end(args, Path(tmp))
    return 0
