"""Batched overwrites of Zipf ids in a DRAM table against numpy overwriting a plain array."""

from __future__ import annotations

import argparse

import numpy as np

import embstore

from ._bench_lookup import report_memory
from ._benchutil import add_size_arguments, build_table, interleaved_medians, print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench update`."""
    add_size_arguments(parser, rows=10_000_000)


def run(args: argparse.Namespace) -> int:
    """Time store.update against `dense[positions] = rows` on the same batches."""
    store, dense, zipf = build_table(args, embstore.TableSpec("t", dim=args.dim))
    report_memory(store, args)
    rng = np.random.default_rng(args.seed + 1)
    ranks = [zipf.ranks(args.batch) for _ in range(args.repeats)]
    ids = [zipf.ids[r] for r in ranks]
    values = [rng.standard_normal((args.batch, args.dim), dtype=np.float32)
              for _ in range(min(args.repeats, 4))]

    def numpy_put(i: int) -> None:
        dense[ranks[i]] = values[i % len(values)]

    def store_update(i: int) -> None:
        store.update("t", ids[i], values[i % len(values)])

    med = interleaved_medians({"numpy": numpy_put, "store": store_update}, args.repeats)
    # both sides applied the same writes in the same order: the tables must agree
    sample = ranks[-1][:1000]
    if not np.array_equal(store.lookup("t", zipf.ids[sample]), dense[sample]):
        print("error: store and plain array disagree after the same updates")
        return 1
    print_table(
        f"update: {args.batch:,} Zipf({args.zipf}) ids into {args.rows:,} x {args.dim} float32",
        [("numpy dense[positions] = rows [baseline]", args.batch / med["numpy"], 1.0),
         ("embstore update, DRAM tier", args.batch / med["store"], med["numpy"] / med["store"])])
    store.close()
    return 0
