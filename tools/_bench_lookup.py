"""Batched lookups of Zipf ids from a DRAM table against numpy's fastest gather."""

from __future__ import annotations

import argparse

import numpy as np

import embstore

from ._benchutil import (
    add_size_arguments,
    build_table,
    interleaved_medians,
    on_threads,
    print_table,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench lookup`."""
    add_size_arguments(parser, rows=10_000_000)


def report_memory(store: embstore.EmbeddingStore, args: argparse.Namespace) -> None:
    """Print the DRAM tier's bytes per row beyond the payload.

    As the tier counts them, and as the process's resident set grew while the table loaded.
    """
    tier = store.tier_statistics("t")[0]
    payload = args.dim * 4
    per_row = tier.bytes / tier.rows
    print(f"memory: {per_row:,.1f} bytes/row held for a {payload}-byte payload: "
          f"{per_row - payload:.1f} bytes/row overhead (index + unfilled slab rows)")
    rss = getattr(args, "store_rss_bytes", 0)
    if rss > 0:
        print(f"memory by RSS: {rss / tier.rows:,.1f} bytes/row resident: "
              f"{rss / tier.rows - payload:.1f} bytes/row over the payload (target <= 16)")


def run(args: argparse.Namespace) -> int:
    """Time store.lookup against np.take on the same Zipf batches; print the ratio."""
    store, dense, zipf = build_table(args, embstore.TableSpec("t", dim=args.dim))
    report_memory(store, args)
    ranks = [zipf.ranks(args.batch) for _ in range(args.repeats)]
    ids = [zipf.ids[r] for r in ranks]
    out = np.empty((args.batch, args.dim), dtype=np.float32)
    check = store.lookup("t", ids[0])
    if not np.array_equal(check, dense[ranks[0]]):
        print("error: the store returned rows that differ from the plain array")
        return 1

    def numpy_take(i: int) -> None:
        np.take(dense, ranks[i], axis=0, out=out, mode="clip")

    def numpy_fancy(i: int) -> None:
        dense[ranks[i]]

    def store_lookup(i: int) -> None:
        store.lookup("t", ids[i])

    threads = embstore.get_num_threads()
    contenders = {"take": numpy_take, "fancy": numpy_fancy,
                  "store": on_threads(1, store_lookup)}
    if threads > 1:
        contenders["threads"] = store_lookup
    med = interleaved_medians(contenders, args.repeats)
    base = args.batch / med["take"]
    rows = [("numpy np.take(out=, mode='clip') [baseline]", base, 1.0),
            ("numpy fancy indexing", args.batch / med["fancy"], med["take"] / med["fancy"]),
            ("embstore lookup, DRAM tier, 1 thread", args.batch / med["store"],
             med["take"] / med["store"])]
    if threads > 1:
        rows.append((f"embstore lookup, DRAM tier, {threads} threads",
                     args.batch / med["threads"], med["take"] / med["threads"]))
    print_table(
        f"lookup: {args.batch:,} Zipf({args.zipf}) ids from {args.rows:,} x {args.dim} float32",
        rows)
    store.close()
    return 0
