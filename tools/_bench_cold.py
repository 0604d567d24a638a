"""Cold reads of a RocksDB tier: rows the OS has not cached, read split over threads or not.

A table of `--rows` x `--dim` float32 is bulk-loaded into a rocksdb tier and read in batches
of `--batch` distinct uniform ids, as a DRAM tier's misses are. Before every timed repeat each
file of the table's directory is dropped from the page cache (`posix_fadvise(DONTNEED)`, with
the table closed), so the reads go to the device under `--dir`. Contenders: the backend's
`cold_read_threads` of each of `--threads`; the baseline is 1, one multi-get on the calling
thread (reads before the option existed). The table is then closed and opened again, and the
same batches read from the page cache (RocksDB's own caches start empty): there a read must
stay on the calling thread and run as fast as the baseline's. Every contender must read the
same rows.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from embstore import registry
from embstore._cold_reads import MAX_THREADS
from embstore.backend import BackendSpec

from ._args import bench_size, non_negative_int, positive_int, quick_sizes, work_dir
from ._benchutil import print_table

__all__ = ["add_arguments", "cold_read_thread_count", "drop_cached", "run"]

_LOAD_ROWS = 1 << 18


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench cold`."""
    parser.add_argument("--rows", type=bench_size, default=1_000_000,
                        help="table rows (1,000,000)")
    parser.add_argument("--dim", type=bench_size, default=64, help="embedding dim (64)")
    parser.add_argument("--batch", type=bench_size, default=250,
                        help="distinct ids per read (250: the demo's misses per table and step)")
    parser.add_argument("--reads", type=bench_size, default=20,
                        help="reads per timed repeat (20)")
    parser.add_argument("--repeats", type=bench_size, default=5,
                        help="timed repeats per contender, each on a cold page cache (5)")
    parser.add_argument("--threads", type=_thread_counts, default=[1, 4, 16],
                        help="cold_read_threads of the contenders, comma-separated; the "
                             "first is the baseline (1,4,16)")
    parser.add_argument("--dir", type=work_dir, default=None,
                        help="where to build the table: the device measured (default: a "
                             "temporary directory)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    quick_sizes(parser, rows=50_000, reads=4, repeats=2)


def cold_read_thread_count(text: str) -> int:
    """A `cold_read_threads` value given on the command line: 1 to `MAX_THREADS`.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    threads = positive_int(text)
    if threads > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{text!r}: a read splits over {MAX_THREADS} threads "
                                         "at most")
    return threads


def _thread_counts(text: str) -> list[int]:
    counts = [cold_read_thread_count(part) for part in text.split(",")]
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"{text!r} names a thread count twice")
    return counts


def drop_cached(directory: Path) -> None:
    """Drop every file of `directory` from the page cache (none may be mapped)."""
    for file in directory.rglob("*"):
        if file.is_file() and not file.is_symlink():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print rows/s and ratios, cold and warm."""
    if not hasattr(os, "posix_fadvise"):
        print("error: bench cold drops files from the page cache with posix_fadvise, which "
              "this OS lacks")
        return 2
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="embstore-bench-cold-", dir=args.dir) as tmp:
        return _run(args, Path(tmp))


def _run(args: argparse.Namespace, root: Path) -> int:
    rocksdb = registry.load_backend("rocksdb")
    spec = BackendSpec(path=root / "rocksdb", dim=args.dim, table="bench")
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    backend = rocksdb.open(spec)
    try:
        for start in range(0, args.rows, _LOAD_ROWS):
            ids = np.arange(start, min(args.rows, start + _LOAD_ROWS), dtype=np.int64)
            backend.bulk_load(ids, rng.standard_normal((len(ids), args.dim), dtype=np.float32))
        backend.compact()
    finally:
        backend.close()
    print(f"cold: loaded {args.rows:,} rows of dim {args.dim} into {spec.path} in "
          f"{time.perf_counter() - t0:.1f} s")
    batch = min(args.batch, args.rows)
    batches = [[np.sort(rng.choice(args.rows, batch, replace=False)).astype(np.int64)
                for _ in range(args.reads)] for _ in range(args.repeats)]
    cold = {t: [] for t in args.threads}
    warm = {t: [] for t in args.threads}
    sums: dict[int, float] = {}
    for i in range(args.repeats):
        for threads in args.threads:  # interleaved, so the device's moods hit all alike
            drop_cached(spec.path)  # type: ignore[arg-type]
            for times in (cold, warm):  # the second open finds the rows in the page cache
                backend = rocksdb.open(spec, cold_read_threads=threads)
                try:
                    t = time.perf_counter()
                    total = sum(float(backend.get(ids)[0].sum(dtype=np.float64))
                                for ids in batches[i])
                    times[threads].append(time.perf_counter() - t)
                    sums[threads] = sums.get(threads, 0.0) + total
                finally:
                    backend.close()
    rows_read = args.reads * batch
    base = args.threads[0]
    for title, times in (("cold page cache", cold), ("warm page cache (the same reads, reopened)",
                                                      warm)):
        med = {t: float(np.median(v)) for t, v in times.items()}
        print_table(f"cold: reads of {batch:,} distinct ids of {args.rows:,} rows, "
                    f"{title}; ratios to cold_read_threads={base}",
                    [(f"cold_read_threads={t}{' [baseline]' if t == base else ''}",
                      rows_read / med[t], med[base] / med[t]) for t in args.threads])
    if len(set(sums.values())) != 1:
        print("error: the contenders read different rows")
        return 1
    print("cold: every contender read the same rows")
    return 0
