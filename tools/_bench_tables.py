"""Many tables in one store: create, reopen, train a batch touching all of them, flush, reopen.

The store holds `--tables` tables (500) on the `--tiers` chain (a DRAM cache of 4096 rows per
table over RocksDB). Their shapes come from Meta's production statistics (dlrm_datasets
``locality_stats.txt``, `--stats`): a batch of `--samples` samples makes ``lookups per sample
per table`` (8.35 in 2021) lookups in every table, spread over tables of sizes from a few rows
to ~10**5 and drawn with the reuse the statistics show, as `embstore.tools.traces` calibrated
them (`synthesize`). The statistics give no dims: each table draws one from a fixed seed
(32, 64, 128 or 256; as `embstore.tools._shard_plan` does). Every table trains with row-wise
Adagrad.

Reported, in one run: the time to create the store and to reopen it empty, the resident memory
per empty table (the process's growth while creating the store, over its tables: the store's
fixed costs included), the time of a training batch (one `lookup_many` of every table's
distinct ids, then one `apply_gradients_many`) against the same batch made table by table with
`lookup` and `apply_gradients` (the baseline), the flush, the close and the reopen after
training, and a spot check of trained rows after that reopen.

The share outside the tables' own work: a batch's time minus the time spent inside the
tables' tier chains (`TableChain`: backends, policies, promotions, evictions, write-backs),
the fused optimizer's steps and the initial values of new rows, over the batch's time,
measured on separate batches of the same run with those parts timed. What remains is the
store's per-call work: checking inputs, grouping ids, locking, the written-id bookkeeping,
dispatch. Each contender gets its own batches, in turn, after a first (cold) batch.
"""

from __future__ import annotations

import argparse
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import embstore
from embstore import _fused
from embstore.index import IdGroups

from ._args import (
    bench_size,
    existing_file,
    non_negative_int,
    quick_sizes,
    tier_chain,
)
from ._benchutil import TABLES, bench_store_path, rss_bytes
from .traces import PROFILES, load_locality_stats, synthesize

__all__ = ["add_arguments", "run"]

DEFAULT_STATS = Path("/work/shared/traces/dlrm_datasets/2021/locality_stats.txt")
LOOKUPS_PER_SAMPLE_2021 = 8.35
"""Lookups per sample per table of the 2021 statistics, used where the file is absent."""
_TABLE_SHIFT = 40  # as in embstore.tools.traces: the table in the bits above, the row below
LR = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench tables`."""
    parser.add_argument("--tables", type=bench_size, default=500, help="tables (500)")
    parser.add_argument("--tiers", type=tier_chain, default=tier_chain("dram:4096:lru,rocksdb"),
                        help="tier chain of every table, top first "
                             "(dram:4096:lru,rocksdb: 4096 rows of DRAM per table)")
    parser.add_argument("--samples", type=bench_size, default=256,
                        help="samples per batch (256): lookups per table per batch are this "
                             "times the statistics' lookups per sample per table")
    parser.add_argument("--batches", type=bench_size, default=5,
                        help="timed batches per contender (5), after one cold batch")
    parser.add_argument("--stats", type=existing_file, default=None,
                        help="a dlrm_datasets locality_stats.txt (default: the 2021 one in "
                             "shared/traces; its built-in figure where absent)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="2021",
                        help="calibrated table profile of embstore.tools.traces (2021)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--path", help="store directory (default: a temporary one, removed)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    quick_sizes(parser, tables=20, samples=16, batches=1)


def lookups_per_sample(path: Path) -> tuple[float, str]:
    """Mean lookups per sample per table of a locality_stats file, and where it came from."""
    if not path.is_file():
        return LOOKUPS_PER_SAMPLE_2021, "built-in 2021 figure (no statistics file)"
    blocks = load_locality_stats(path)
    # the numbered batches, as `traces.mean_histograms` takes them: the 2021 file's unnumbered
    # block describes another, larger trace
    blocks = [b for b in blocks if re.search(r"_\d+\.pt$", b.name)] or blocks
    ratio = float(np.mean([b.indices / (b.tables * b.batch_size) for b in blocks]))
    return ratio, str(path)


def table_shapes(n: int, seed: int) -> tuple[list[embstore.TableSpec], np.ndarray]:
    """Specs of `n` tables (row-wise Adagrad, dims from `seed`) and their names' order."""
    dims = np.random.default_rng(seed).choice([32, 64, 128, 256], n, p=[0.2, 0.4, 0.3, 0.1])
    specs = [embstore.TableSpec(f"t{i:04d}", dim=int(dims[i]),
                                optimizer=embstore.optim.RowWiseAdagrad(lr=LR))
             for i in range(n)]
    return specs, dims


def batches(specs: list[embstore.TableSpec], args: argparse.Namespace, per_sample: float
            ) -> Iterator[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Training batches: per table its distinct ids and one gradient row for each.

    Ids come from the calibrated generator with one table per spec; the gradients are small
    and drawn from `--seed`, so every contender does the same kind of work.
    """
    n = len(specs)
    params = replace(PROFILES[args.profile], tables=n, hot=0,
                     lookups=max(n, round(n * per_sample * args.samples)))
    rng = np.random.default_rng(args.seed + 1)
    for batch in synthesize(3 * args.batches + 1, seed=args.seed, params=params):
        table = batch >> _TABLE_SHIFT
        order = np.argsort(table, kind="stable")
        keys = (batch & ((1 << _TABLE_SHIFT) - 1))[order]
        bounds = np.searchsorted(table[order], np.arange(n + 1))
        out = {}
        for i, spec in enumerate(specs):
            unique = IdGroups(np.ascontiguousarray(keys[bounds[i]:bounds[i + 1]])).unique
            grads = rng.standard_normal((len(unique), spec.dim), dtype=np.float32)
            grads *= np.float32(1e-3)
            out[spec.name] = (unique, grads)
        yield out


def step_batched(store: embstore.EmbeddingStore,
                 batch: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """One training batch with the batched calls."""
    rows = store.lookup_many({name: ids for name, (ids, _) in batch.items()})
    store.apply_gradients_many(batch)
    del rows


def step_per_table(store: embstore.EmbeddingStore,
                   batch: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """The baseline: the same batch, table by table (its rows kept, as a trainer keeps them)."""
    rows = {name: store.lookup(name, ids) for name, (ids, _) in batch.items()}
    for name, (ids, grads) in batch.items():
        store.apply_gradients(name, ids, grads)
    del rows


class _WorkClock:
    """Seconds spent inside the timed callables, the outermost call only (calls nest)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds += time.perf_counter() - t0
        return call


_CHAIN_WORK = ("get", "put", "top_slots", "put_top_slots", "count_top_read", "touch_top",
               "bring_up", "write_back_all", "sync", "delete", "contains")
_KERNELS = ("step_in_place", "gather_step", "step_rows")


@contextmanager
def tables_work(store: embstore.EmbeddingStore) -> Iterator[_WorkClock]:
    """Time the tables' own work (see the module docstring) while the block runs."""
    clock = _WorkClock()
    chains = [t.chain for t in store._tables.values()]
    kernels = {name: getattr(_fused, name) for name in _KERNELS}
    try:
        for chain in chains:
            for name in _CHAIN_WORK:
                setattr(chain, name, clock.timed(getattr(chain, name)))
        for name, fn in kernels.items():
            setattr(_fused, name, clock.timed(fn))
        store._fill_absent = clock.timed(store._fill_absent)  # type: ignore[method-assign]
        yield clock
    finally:
        for chain in chains:
            for name in _CHAIN_WORK:
                chain.__dict__.pop(name, None)
        for name, fn in kernels.items():
            setattr(_fused, name, fn)
        store.__dict__.pop("_fill_absent", None)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _report(rows: list[tuple[str, float, str]], n: int) -> None:
    TABLES.append({"title": f"{n} tables", "rows": [
        {"phase": name, "seconds": sec, "note": note} for name, sec, note in rows]})
    print(f"  {'phase':<40}{'seconds':>10}{'ms/table':>10}  note")
    for name, sec, note in rows:
        print(f"  {name:<40}{sec:>10.3f}{1e3 * sec / n:>10.2f}  {note}")


def run(args: argparse.Namespace) -> int:
    """Create, train, flush and reopen a many-table store; print the figures.

    Exit 1 if the spot check after the reopen fails.
    """
    per_sample, source = lookups_per_sample(args.stats or DEFAULT_STATS)
    specs, dims = table_shapes(args.tables, args.seed)
    n = len(specs)
    tiers = list(args.tiers)
    chain = ",".join(t.backend + (f":{t.capacity}" if t.capacity is not None else "")
                     for t in tiers)
    print(f"{n} tables on {chain}, row-wise Adagrad, dims 32/64/128/256 (mean "
          f"{dims.mean():.0f}); {per_sample:.2f} lookups per sample per table ({source}), "
          f"{args.samples} samples per batch")
    todo = list(batches(specs, args, per_sample))
    lookups = sum(len(ids) for ids, _ in todo[0].values())
    print(f"a batch: {lookups:,} distinct ids over {n} tables "
          f"({min(len(i) for i, _ in todo[0].values())} to "
          f"{max(len(i) for i, _ in todo[0].values()):,} per table)")
    tmp, path = bench_store_path(args.path, "embstore-tables-")
    rows: list[tuple[str, float, str]] = []
    try:
        rss0 = rss_bytes()
        sec, store = _timed(lambda: embstore.open(path, tables=specs, tiers=tiers))
        per_table = (rss_bytes() - rss0) / n
        rows.append(("create", sec, f"{per_table / 1024:,.1f} KiB resident per empty table"))
        rows.append(("close (empty)", _timed(store.close)[0], ""))
        sec, store = _timed(lambda: embstore.open(path))
        rows.append(("reopen (empty)", sec, ""))
        try:
            rows.append(("cold batch, batched calls", _timed(lambda: step_batched(store,
                                                                                  todo[0]))[0],
                         "every id new"))
            batched: list[float] = []
            per_table_s: list[float] = []
            shares: list[float] = []

            def timed_batched(batch: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
                batched.append(_timed(lambda: step_batched(store, batch))[0])

            def timed_per_table(batch: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
                per_table_s.append(_timed(lambda: step_per_table(store, batch))[0])

            def timed_work(batch: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
                with tables_work(store) as clock:
                    total = _timed(lambda: step_batched(store, batch))[0]
                shares.append((total - clock.seconds) / total)

            for k in range(args.batches):
                # in turn, each on batches of its own; the two compared swap places every
                # round, as later batches find more of their rows stored and cost less
                pair = [timed_batched, timed_per_table]
                for j, contender in enumerate(pair if k % 2 == 0 else pair[::-1]):
                    contender(todo[1 + 3 * k + j])
                timed_work(todo[3 + 3 * k])
            b, p = float(np.median(batched)), float(np.median(per_table_s))
            share = float(np.median(shares))
            rows.append(("batch, lookup_many + apply_gradients_many", b,
                         f"{lookups / b:,.0f} ids/s; {share:.1%} outside the tables' work"))
            rows.append(("batch, per-table calls (baseline)", p,
                         f"batched calls {p / b:.2f}x its speed"))
            rows.append(("flush", _timed(store.flush)[0], ""))
            probe = {name: ids[:64] for name, (ids, _) in todo[-1].items()}
            expect = store.lookup_many(probe)
            expect_state = store.lookup_many(probe, state=True)
        finally:
            sec = _timed(store.close)[0]
        rows.append(("close (trained)", sec, ""))
        sec, store = _timed(lambda: embstore.open(path))
        try:
            rows.append(("reopen (trained)", sec, ""))
            got = store.lookup_many(probe)
            got_state = store.lookup_many(probe, state=True)
        finally:
            store.close()
        ok = all(np.array_equal(got[t], expect[t]) and
                 np.array_equal(got_state[t], expect_state[t]) for t in probe)
        _report(rows, n)
        TABLES.append({"title": "figures", "rows": [
            {"tables": n, "rss_per_empty_table_bytes": round(per_table),
             "outside_share": share, "batch_seconds": b, "per_table_calls_seconds": p,
             "distinct_ids_per_batch": lookups, "spot_check": ok}]})
        checked = sum(len(i) for i in probe.values())
        print(f"spot check after reopen: {checked:,} trained rows and their state "
              f"{'equal' if ok else 'DIFFER'}")
        return 0 if ok else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
