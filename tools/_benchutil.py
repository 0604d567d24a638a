"""Timing helpers shared by the benchmarks: interleaved repeats, medians, a printed table."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

import embstore
from embstore.tools.workload import ZipfIds


def add_size_arguments(parser: argparse.ArgumentParser, *, rows: int, dim: int = 64,
                       batch: int = 65536, repeats: int = 30) -> None:
    """The options every table benchmark takes."""
    parser.add_argument("--rows", type=int, default=rows, help=f"table rows (default {rows})")
    parser.add_argument("--dim", type=int, default=dim, help=f"embedding dim (default {dim})")
    parser.add_argument("--batch", type=int, default=batch, help=f"ids per batch ({batch})")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed batches per contender")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (1.05)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")


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


def build_table(args: argparse.Namespace, spec: embstore.TableSpec
                ) -> tuple[embstore.EmbeddingStore, np.ndarray, ZipfIds]:
    """An in-memory store with table `spec` ("t") and a plain array of the same weights.

    Row i of the array is at the id of Zipf rank i (`--quick` shrinks the sizes first).
    """
    if args.quick:
        args.rows, args.batch, args.repeats = 20_000, 4096, 5
    zipf = ZipfIds(args.rows, args.zipf, seed=args.seed)
    dense = np.random.default_rng(args.seed).standard_normal((args.rows, args.dim),
                                                              dtype=np.float32)
    store = embstore.open(None, tables=[spec])
    step = 1 << 20
    t0 = time.perf_counter()
    for start in range(0, args.rows, step):
        store.update("t", zipf.ids[start:start + step], dense[start:start + step])
    state = spec.row_width - spec.dim
    print(f"loaded {args.rows:,} rows x {args.dim}" + (f" (+{state} state)" if state else "")
          + f" in {time.perf_counter() - t0:.1f} s")
    return store, dense, zipf
