"""Timing helpers shared by the benchmarks: interleaved repeats, medians, a printed table."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import embstore
from embstore.errors import ConfigError
from embstore.tools.workload import ZipfIds

from ._args import bench_size, non_negative_int, positive_float, quick_sizes

MAX_ZIPF = 20.0
"""Steepest Zipf exponent taken: already at 20 nearly every draw is the hottest id, while much
steeper ones overflow float64 in the weights 1/rank**a (past 44 at 10M rows) and numpy warns."""


def zipf_exponent(text: str) -> float:
    """A Zipf exponent: finite, above 0 (0 would be uniform) and at most MAX_ZIPF.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = positive_float(text)
    if value > MAX_ZIPF:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most {MAX_ZIPF:g} (there nearly "
                                         "every draw is the hottest id already)")
    return value


def add_size_arguments(parser: argparse.ArgumentParser, *, rows: int, dim: int = 64,
                       batch: int = 65536, repeats: int = 30) -> None:
    """The options every table benchmark takes."""
    parser.add_argument("--rows", type=bench_size, default=rows,
                        help=f"table rows (default {rows})")
    parser.add_argument("--dim", type=bench_size, default=dim,
                        help=f"embedding dim (default {dim})")
    parser.add_argument("--batch", type=bench_size, default=batch,
                        help=f"ids per batch ({batch})")
    parser.add_argument("--repeats", type=bench_size, default=repeats,
                        help="timed batches per contender")
    parser.add_argument("--zipf", type=zipf_exponent, default=1.05,
                        help="Zipf exponent, above 0 (1.05)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    add_ids_argument(parser)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    quick_sizes(parser, rows=20_000, batch=4096, repeats=5)


def add_ids_argument(parser: argparse.ArgumentParser) -> None:
    """`--ids`: how the table's ids are spelled (see `build_table`)."""
    parser.add_argument("--ids", choices=("scattered", "dense", "hashed"), default="scattered",
                        help="table ids: scattered over int64 by a random odd multiplier "
                             "(default), dense 0..rows-1, or hashed dense ids id*7919+13; "
                             "hotness is independent of the id in every case")


def rss_bytes() -> int:
    """Return the resident set size of this process, from /proc (0 where there is none).

    Measured after handing freed heap memory back to the system (glibc's malloc_trim), so
    that what the allocator keeps of freed temporaries does not count.
    """
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def interleaved_medians(contenders: dict[str, Callable[[int], None]], repeats: int,
                        warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each contender, run in turn so machine noise hits all alike.

    Each callable receives the repeat index (to pick its batch).
    """
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(-warmup, repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn(i % max(repeats, 1))
            if i >= 0:
                times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def on_threads(count: int, fn: Callable[[int], None]) -> Callable[[int], None]:
    """`fn` run with the store's DRAM kernels on `count` threads (embstore.set_num_threads)."""
    def run(i: int) -> None:
        before = embstore.get_num_threads()
        embstore.set_num_threads(count)
        try:
            fn(i)
        finally:
            embstore.set_num_threads(before)
    return run


TABLES: list[dict[str, object]] = []
"""Every table printed by `print_table` in this process, for `embstore bench ... --json`."""


def print_table(title: str, rows: list[tuple[str, float, float]]) -> None:
    """Print (name, items/s, ratio to baseline) rows under a title."""
    TABLES.append({"title": title, "rows": [{"contender": n, "rows_per_s": r, "ratio": x}
                                            for n, r, x in rows]})
    print(title)
    print(f"  {'contender':<44}{'rows/s':>14}{'ratio':>9}")
    for name, rate, ratio in rows:
        print(f"  {name:<44}{rate:>14,.0f}{ratio:>8.2f}x")


def bench_store_path(given: str | None, prefix: str) -> tuple[str | None, Path]:
    """Where a benchmark's store goes, and the temporary directory made for it, if any.

    `given`, or `store` in a new temporary directory named `prefix`... under $TMPDIR, which
    the caller removes.
    """
    if given is not None:
        return None, Path(given)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("TMPDIR"))
    return tmp, Path(tmp) / "store"


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (/proc/meminfo), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def build_table(args: argparse.Namespace, spec: embstore.TableSpec
                ) -> tuple[embstore.EmbeddingStore, np.ndarray, ZipfIds]:
    """An in-memory store with table `spec` ("t") and a plain array of the same weights.

    Row i of the array is at the id of Zipf rank i.
    """
    # the table twice (the store's and the plain array) and the ids: refused before the OS
    # kills the process for it (allocations succeed on credit and fail only when touched)
    need = args.rows * (2 * spec.row_width * 4 + 24)
    free = available_memory()
    if free is not None and need > free:
        raise ConfigError(f"--rows {args.rows:,} x --dim {args.dim} needs about "
                          f"{need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB this "
                          "machine has available; give smaller sizes")
    zipf = ZipfIds(args.rows, args.zipf, seed=args.seed)
    kind = getattr(args, "ids", "scattered")
    if kind != "scattered":
        # dense ids in an order unrelated to hotness; hashed: the same ids spread by id*7919+13
        dense_ids = np.random.default_rng(args.seed + 7).permutation(args.rows).astype(np.int64)
        zipf.ids = dense_ids * 7919 + 13 if kind == "hashed" else dense_ids
    dense = np.random.default_rng(args.seed).standard_normal((args.rows, args.dim),
                                                              dtype=np.float32)
    rss0 = rss_bytes()
    store = embstore.open(None, tables=[spec])
    step = 1 << 20
    t0 = time.perf_counter()
    for start in range(0, args.rows, step):
        store.update("t", zipf.ids[start:start + step], dense[start:start + step])
    args.store_rss_bytes = rss_bytes() - rss0  # the store's resident growth while loading
    state = spec.row_width - spec.dim
    print(f"loaded {args.rows:,} rows x {args.dim}" + (f" (+{state} state)" if state else "")
          + f" ({kind} ids) in {time.perf_counter() - t0:.1f} s")
    return store, dense, zipf
