"""The tier hierarchy: hit-path cost, and training through a table 10x larger than its DRAM tier.

Part 1 (hit path): every id of a batch is in the DRAM tier of a DRAM-over-rocksdb chain; its
lookups are timed against the same lookups on a DRAM-only store, per eviction policy.

Part 2 (end to end): the calibrated synthetic trace (embstore.tools.traces, profile 2021) is looked
up and trained (row-wise Adagrad) batch after batch through a DRAM tier holding a tenth of the
distinct ids, over a rocksdb and over a pmem bottom tier. Its throughput is compared with
(a) the same work on a DRAM-only store, and (b) the limit that the raw speeds of the two tiers
allow for the hits and misses observed, from the time the raw bottom-tier backend takes to
replay exactly the batched reads and writes that reached it, in two forms:

- serial: DRAM-only time + the replay's reads + its writes, the limit of a chain that does
  everything on one thread;
- overlapped: max(DRAM-only time + reads, writes). Write-backs into the bottom run on a second
  thread beside the main one, so the serial sum is no longer a bound: a chain can beat it.
  The reads stay on the main thread (a lookup waits for its misses). This is the limit with
  perfect overlap on two cores, the figure to compare against.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import embstore
from embstore import TableSpec, TierSpec, registry
from embstore.tools.traces import synthesize
from embstore.tools.workload import ZipfIds

from ._args import bench_size, one_of, quick_sizes, some_of
from ._benchutil import interleaved_medians, print_table

OPT = embstore.optim.RowWiseAdagrad(lr=0.01)
DIM = 64


PARTS = ("hit", "e2e")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench hierarchy`."""
    parser.add_argument("--rows", type=bench_size, default=1_000_000,
                        help="rows for the hit path")
    parser.add_argument("--batch", type=bench_size, default=65536)
    parser.add_argument("--repeats", type=bench_size, default=20)
    parser.add_argument("--batches", type=bench_size, default=48,
                        help="trace batches, end to end")
    parser.add_argument("--eviction", type=_policy("eviction"), default="clock",
                        help="DRAM tier eviction, end to end")
    parser.add_argument("--admission", type=_policy("admission"), default="always",
                        help="DRAM tier admission")
    parser.add_argument("--bottoms", default="rocksdb,pmem", type=_bottoms,
                        help="bottom tiers to try")
    parser.add_argument("--parts", default="hit,e2e", type=_parts,
                        help="which parts to run (hit,e2e)")
    parser.add_argument("--e2e-repeats", type=bench_size, default=3,
                        help="end-to-end runs per contender, best kept")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    quick_sizes(parser, rows=20_000, batch=4096, repeats=3, batches=8, e2e_repeats=1)


# a backend registered but not installed here is fine: the run says it skipped that one
_parts, _bottoms = some_of(PARTS, "part"), some_of(registry.backend_names, "backend")


def _policy(kind: str) -> Callable[[str], str]:
    """A type that takes the name of a registered `kind` policy, checked before any run."""
    return one_of(lambda: registry.policy_names(kind), f"{kind} policy")


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


def _quiesce() -> None:
    """Write out the page cache before a timed run, so no earlier writeback runs during it."""
    os.sync()


def _record_bottom(store: embstore.EmbeddingStore) -> list[tuple[str, np.ndarray]]:
    """Log every batched read and write the store sends to its bottom tier, in order."""
    backend = store._tables["t"].chain.tiers[-1].backend
    backend = getattr(backend, "wrapped", backend)  # the medium itself, whichever thread writes
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


def _in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a new interpreter.

    On two cores, what one contender leaves behind (a grown heap, RocksDB's threads and caches)
    slowed the next by up to 15%; every timed run starts from the same clean state instead.
    """
    # a namespace from the command line holds its subcommand's function, which the new
    # interpreter cannot unpickle: it gets the settings alone
    args = tuple(argparse.Namespace(**{k: v for k, v in vars(a).items() if not callable(v)})
                 if isinstance(a, argparse.Namespace) else a for a in args)
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _trace(args: argparse.Namespace) -> tuple[list[np.ndarray], int]:
    """The trace batches and the distinct ids they touch, the same in every process."""
    lookups = 1 << 18 if args.quick else 1 << 20
    trace = [b for big in synthesize(args.batches * args.batch // lookups + 1, seed=7,
                                     lookups=lookups)
             for b in np.array_split(big, max(1, len(big) // args.batch))][: args.batches]
    return trace, len(np.unique(np.concatenate(trace)))


def _spec() -> TableSpec:
    return TableSpec("t", dim=DIM, init=embstore.init.Uniform(seed=1), optimizer=OPT)


def _train(args: argparse.Namespace, path: Path | None,
           bottom: str | None) -> tuple[float, list[Any]]:
    """Seconds to train the trace on a DRAM-only store or through a DRAM tier over `bottom`.

    DRAM-only when `bottom` is None; with a bottom, its batched reads and writes are saved
    beside `path`.
    """
    trace, distinct = _trace(args)
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal((len(b), DIM)).astype(np.float32) * 0.01 for b in trace]
    cache_rows = max(1, distinct // 10)
    tiers = None if bottom is None else [
        TierSpec("dram", capacity=cache_rows, eviction=args.eviction, admission=args.admission),
        TierSpec(bottom)]
    with embstore.open(path, tables=[_spec()], tiers=tiers) as store:
        log = _record_bottom(store) if bottom is not None else []
        _quiesce()
        t0 = time.perf_counter()
        for ids, g in zip(trace, grads, strict=True):
            store.lookup("t", ids)
            store.apply_gradients("t", ids, g)
        seconds = time.perf_counter() - t0
        stats = store.tier_statistics("t")
    if path is not None:
        np.savez(path.with_suffix(".log.npz"), ops=np.array([op == "put" for op, _ in log]),
                 **{f"ids{i}": ids for i, (_, ids) in enumerate(log)})
    return seconds, stats


def _replay_seconds(backend: str, path: Path, log_file: Path,
                    width: int) -> tuple[float, float]:
    """Time the raw backend replaying exactly the reads and writes of a saved log, from empty.

    Returns the seconds spent in reads and in writes: the bottom tier's share of the limit,
    with its access pattern and background work.
    """
    from embstore.backend import BackendSpec

    saved = np.load(log_file)
    ops = saved["ops"]
    log = [saved[f"ids{i}"] for i in range(len(ops))]
    cls = registry.load_backend(backend)
    rows = np.random.default_rng(1).standard_normal(
        (max((len(ids) for ids in log), default=0), width)).astype(np.float32)
    spent = [0.0, 0.0]  # reads, writes
    with cls.open(BackendSpec(path=path, dim=width, table="t")) as b:
        _quiesce()
        for is_put, ids in zip(ops, log, strict=True):
            t0 = time.perf_counter()
            if is_put:
                b.put(ids, rows[: len(ids)])
            else:
                b.get(ids)
            spent[bool(is_put)] += time.perf_counter() - t0
    return spent[0], spent[1]


def end_to_end(args: argparse.Namespace, root: Path) -> None:
    """Train the calibrated trace through a 10x-oversubscribed DRAM tier."""
    trace, distinct = _trace(args)
    cache_rows = max(1, distinct // 10)
    n_ids = sum(len(b) for b in trace)
    bottoms = [b for b in args.bottoms.split(",") if b in registry.available_backend_names()]
    best: dict[str, float] = {}  # seconds of training, per contender
    best_replay: dict[str, tuple[float, float]] = {}  # raw replay (reads, writes), per bottom
    stats: dict[str, list[Any]] = {}
    for r in range(args.e2e_repeats):  # contenders in turn, so noise hits all alike
        for name in ["dram-only", *bottoms]:
            path = None if name == "dram-only" else root / f"e2e-{name}-{r}"
            t, stats[name] = _in_fresh_process(_train, args, path,
                                               None if path is None else name)
            best[name] = min(t, best.get(name, t))
            if path is not None:
                replay = _in_fresh_process(_replay_seconds, name, root / f"replay-{name}-{r}",
                                           path.with_suffix(".log.npz"), _spec().row_width)
                best_replay[name] = min(replay, best_replay.get(name, replay), key=sum)
    print(f"end to end: {len(trace)} batches of {args.batch:,} ids from the calibrated trace "
          f"(profile 2021), {distinct:,} distinct ids x {DIM}; DRAM tier {cache_rows:,} rows "
          f"({args.eviction}, admission {args.admission}); lookup + row-wise Adagrad step per "
          f"batch; each run in a fresh process, best of {args.e2e_repeats}")
    t_dram = best["dram-only"]
    rows = [("all in DRAM (dram-only store) [baseline]", n_ids / t_dram, 1.0, float("nan"),
             float("nan"))]
    for bottom in args.bottoms.split(","):
        if bottom not in bottoms:
            print(f"  ({bottom}: unavailable, skipped)")
            continue
        top, low = stats[bottom]
        t_reads, t_writes = best_replay[bottom]
        print(f"  {bottom}: DRAM tier hit ratio {top.hits / top.lookups:.1%} "
              f"({top.misses:,} misses, {low.lookups:,} distinct reads below, "
              f"{top.writebacks:,} write-backs); the raw {bottom} backend replays those "
              f"batched reads in {t_reads:.2f} s and writes in {t_writes:.2f} s")
        t = best[bottom]
        serial = t_dram + t_reads + t_writes
        overlapped = max(t_dram + t_reads, t_writes)
        rows.append((f"dram cache over {bottom}", n_ids / t, t_dram / t, serial / t,
                     overlapped / t))
    print(f"  {'contender':<44}{'ids/s':>12}{'vs DRAM':>9}{'vs serial limit':>17}"
          f"{'vs overlapped limit':>21}")
    for name, rate, vs_dram, vs_serial, vs_overlap in rows:
        lims = "" if np.isnan(vs_serial) else f"{vs_serial:>16.2f}x{vs_overlap:>20.2f}x"
        print(f"  {name:<44}{rate:>12,.0f}{vs_dram:>8.2f}x{lims}")


def run(args: argparse.Namespace) -> int:
    """Run both parts and print their tables."""
    with tempfile.TemporaryDirectory(prefix="embstore-bench-") as tmp:
        parts = args.parts.split(",")
        if "hit" in parts:
            hit_path(args, Path(tmp))
        if "e2e" in parts:
            end_to_end(args, Path(tmp))
    return 0
