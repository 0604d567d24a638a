"""A table larger than RAM: bulk load into RocksDB, train behind a small DRAM tier, reopen.

The table (`--rows` x `--dim` float32 with row-wise Adagrad, 100M x 64 is about 26 GB with its
state) is bulk-loaded into a rocksdb bottom tier with `store.bulk_load` (SST file ingestion),
chunk by chunk, so memory stays bounded whatever the table size. It is then trained behind a
DRAM tier of `--dram` bytes with Zipf ids (through `embstore.torch` and its pipeline where
torch is installed, else with the store's own calls), closed, reopened and spot-checked.
Reported: load time and rows/s, peak RSS of each phase against the DRAM tier's size, training
ids/s, the DRAM tier's hit ratio, bytes on disk per row against the payload.

Loaded rows are drawn chunk by chunk from a generator seeded by the chunk's number, so the
spot check regenerates the chunks it samples instead of keeping a copy; their generation is
timed apart from the store's load.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import threading
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

import embstore
from embstore.errors import ConfigError
from embstore.spec import parse_bytes

from ._args import bench_size, quick_sizes
from ._bench_cold import cold_read_thread_count
from ._benchutil import bench_store_path, zipf_exponent

__all__ = ["add_arguments", "run"]

_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: rank -> id is a bijection on 64-bit words


def _count(text: str) -> int:
    """A whole count of at least 1, with an optional k, M or G: `1M`, `100M`, `2.5k`."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a count (e.g. 1M, 100M)")
    value = Fraction(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[
        m.group(2).lower()]  # exact: a float gave 10**30 as 1,000,000,000,000,000,019,884,...
    if value.denominator != 1 or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole count of at least 1")
    if value > 2**31 - 1:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {2**31 - 1:,}: no table holds "
                                         "more rows")
    return int(value)


def _size(text: str) -> str:
    """A size in bytes as TierSpec takes it (`1GiB`), checked before the table is loaded."""
    try:
        n = parse_bytes(text)
    except (ConfigError, ValueError):
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size (e.g. 512MiB, 1GiB)")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench scale`."""
    parser.add_argument("--rows", type=_count, default=_count("100M"),
                        help="table rows (100M); 1M for a quick check")
    parser.add_argument("--dim", type=bench_size, default=64, help="embedding dim (64)")
    parser.add_argument("--dram", type=_size, default="1GiB", help="DRAM tier size (1GiB)")
    parser.add_argument("--chunk", type=_count, default=_count("1M"),
                        help="rows per bulk-load call (1M)")
    parser.add_argument("--steps", type=bench_size, default=200, help="training steps (200)")
    parser.add_argument("--bags", type=bench_size, default=4096, help="bags per step (4096)")
    parser.add_argument("--bag", type=bench_size, default=20, help="ids per bag (20)")
    parser.add_argument("--zipf", type=zipf_exponent, default=1.05,
                        help="Zipf exponent of ids, above 0 (1.05)")
    parser.add_argument("--cold-read-threads", type=cold_read_thread_count, default=None,
                        help="the rocksdb tier's cold_read_threads (its default: 16; 1 reads "
                             "every miss on the training thread)")
    parser.add_argument("--path", help="store directory (default: a temporary one, removed)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1M rows behind 64MiB of DRAM, 20 steps")
    quick_sizes(parser, rows=1_000_000, dram="64MiB", steps=20)


class _PeakRSS:
    """The process's peak resident set size while a phase runs, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            with open("/proc/self/statm") as fh:
                self.peak = max(self.peak, int(fh.read().split()[1]) * page)
            self._stop.wait(0.02)

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _zipf_ids(rng: np.random.Generator, n_rows: int, a: float, size: int) -> np.ndarray:
    """Draw ids whose ranks follow a bounded Zipf(a) law, scattered like hashed ids.

    A continuous inverse CDF: no per-row table, so it costs nothing at 100M rows.
    """
    u = rng.random(size)
    if abs(a - 1.0) < 1e-9:
        ranks = np.exp(u * np.log(n_rows + 1.0)) - 1.0
    else:
        top = (n_rows + 1.0) ** (1.0 - a)
        ranks = (u * (top - 1.0) + 1.0) ** (1.0 / (1.0 - a)) - 1.0
    ranks = np.minimum(ranks.astype(np.int64), n_rows - 1)
    return _id_of(ranks)


def _id_of(ranks: np.ndarray) -> np.ndarray:
    return (ranks.astype(np.uint64) * _MULT).view(np.int64)


def _chunk_rows(index: int, n: int, dim: int) -> np.ndarray:
    """The loaded rows of chunk `index` (n rows): a pure function of (index, n, dim)."""
    rng = np.random.default_rng([42, index])
    rows = rng.random((n, dim), dtype=np.float32)
    rows -= np.float32(0.5)
    rows *= np.float32(0.1)
    return rows


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _train(store: embstore.EmbeddingStore, args: argparse.Namespace) -> tuple[float, str]:
    """Train `args.steps` steps; returns (seconds, how)."""
    rng = np.random.default_rng(1)
    n_ids = args.bags * args.bag
    batches = [_zipf_ids(rng, args.rows, args.zipf, n_ids) for _ in range(args.steps)]
    try:
        import torch

        import embstore.torch as et
    except ImportError:
        grads = np.full((n_ids, args.dim), 1e-3, np.float32)
        t0 = time.perf_counter()
        for ids in batches:
            store.lookup("t", ids)
            store.apply_gradients("t", ids, grads)
        return time.perf_counter() - t0, "store calls, no pipeline (torch not installed)"
    bag = et.EmbeddingBag(store, "t", mode="sum")
    inputs = [torch.from_numpy(ids.reshape(args.bags, args.bag)) for ids in batches]
    t0 = time.perf_counter()
    with et.TrainPipeline(inputs, inputs=lambda x: {bag: (x, None, None)}, depth=2) as pipe:
        for x in pipe:
            out = bag(x)
            (out * out).sum().backward()
    return time.perf_counter() - t0, "embstore.torch.EmbeddingBag + TrainPipeline(depth=2)"


def run(args: argparse.Namespace) -> int:
    """Load, train, reopen and check; print the figures. Exit 1 if the check fails."""
    dram_bytes = parse_bytes(args.dram)
    # the specs first: one refused leaves no temporary directory behind
    spec = embstore.TableSpec("t", dim=args.dim,
                              optimizer=embstore.optim.RowWiseAdagrad(lr=0.01))
    row_bytes = spec.row_width * 4
    rocksdb_options = ({} if args.cold_read_threads is None
                       else {"cold_read_threads": args.cold_read_threads})
    tiers = [embstore.TierSpec("dram", capacity=args.dram),
             embstore.TierSpec("rocksdb", options=rocksdb_options)]
    tmp, path = bench_store_path(args.path, "embstore-scale-")
    print(f"table: {args.rows:,} x {args.dim} float32 + row-wise Adagrad state = "
          f"{args.rows * row_bytes / 2**30:,.1f} GiB; DRAM tier {args.dram} "
          f"({dram_bytes // row_bytes:,} rows); store at {path}")
    try:
        with embstore.open(path, tables=[spec], tiers=tiers) as store:
            load_s = make_s = 0.0
            with _PeakRSS() as rss:
                for index, start in enumerate(range(0, args.rows, args.chunk)):
                    t0 = time.perf_counter()
                    ranks = np.arange(start, min(start + args.chunk, args.rows))
                    rows = _chunk_rows(index, len(ranks), args.dim)
                    t1 = time.perf_counter()
                    store.bulk_load("t", _id_of(ranks), rows)
                    make_s += t1 - t0
                    load_s += time.perf_counter() - t1
            print(f"bulk load: {load_s:,.1f} s in store.bulk_load, {args.rows / load_s:,.0f} "
                  f"rows/s (SST ingestion; generating the rows took {make_s:,.1f} s more), "
                  f"peak RSS {rss.peak / 2**30:.2f} GiB")
            with _PeakRSS() as rss:
                train_s, how = _train(store, args)
            tier = store.tier_statistics("t")[0]
            ids_done = args.steps * args.bags * args.bag
            hit = tier.hits / max(tier.lookups, 1)
            print(f"training: {args.steps} steps x {args.bags * args.bag:,} Zipf({args.zipf}) "
                  f"ids in {train_s:,.1f} s: {ids_done / train_s:,.0f} ids/s ({how}); DRAM "
                  f"tier hit ratio {hit:.1%}; peak RSS {rss.peak / 2**30:.2f} GiB "
                  f"(DRAM tier {dram_bytes / 2**30:.2f} GiB + 2 GiB = target "
                  f"{(dram_bytes + 2 * 2**30) / 2**30:.2f} GiB)")
            trained = _zipf_ids(np.random.default_rng(1), args.rows, args.zipf, 1000)
            trained_rows = store.lookup("t", trained).copy()
            store.flush()
        disk = _disk_bytes(path)
        amplification = disk / args.rows / row_bytes
        print(f"on disk: {disk / 2**30:,.2f} GiB, {disk / args.rows:,.1f} bytes per row for "
              f"{row_bytes} bytes of payload: space amplification {amplification:.2f}x")
        rng = np.random.default_rng(7)
        t0 = time.perf_counter()
        with embstore.open(path) as store:
            reopen_s = time.perf_counter() - t0
            ok = np.array_equal(store.lookup("t", trained), trained_rows)
            n_chunks = -(-args.rows // args.chunk)
            checked = changed = 0
            for index in rng.choice(n_chunks, size=min(4, n_chunks), replace=False):
                start = int(index) * args.chunk
                n = min(args.chunk, args.rows - start)
                pick = rng.choice(n, size=min(250, n), replace=False)
                got = store.lookup("t", _id_of(start + pick))
                loaded = _chunk_rows(int(index), n, args.dim)[pick]
                changed += int((~np.all(got == loaded, axis=1)).sum())  # trained since
                checked += len(pick)
            ok = ok and store.num_rows("t") == args.rows and changed < checked // 2
        print(f"reopen: {reopen_s:.2f} s; spot check of 1,000 trained rows and {checked:,} "
              f"random loaded rows ({changed} of them trained since): "
              f"{'ok' if ok else 'FAILED'}")
        return 0 if ok else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
