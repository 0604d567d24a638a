"""Half-precision tables: bytes per row, lookups, updates and optimizer steps per precision.

One DRAM table per precision (fp32, fp16, bf16) holds the same rows; the same Zipf batches are
looked up, overwritten and stepped (row-wise Adagrad) in turn, and each precision's rate is
quoted against fp32's measured in the same run, with the bytes each table holds per row.
"""

from __future__ import annotations

import argparse

import numpy as np

import embstore
from embstore.tools.workload import ZipfIds

from ._benchutil import add_size_arguments, interleaved_medians, print_table

PRECISIONS = ("fp32", "fp16", "bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench precision`."""
    add_size_arguments(parser, rows=2_000_000, repeats=15)


def run(args: argparse.Namespace) -> int:
    """Time lookups, updates and steps per precision; print rates, ratios and bytes/row."""
    zipf = ZipfIds(args.rows, args.zipf, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    stores = {}
    for precision in PRECISIONS:
        spec = embstore.TableSpec("t", dim=args.dim, precision=precision,
                                  optimizer=embstore.optim.RowWiseAdagrad(lr=0.01))
        stores[precision] = embstore.open(None, tables=[spec])
    step = 1 << 18
    for start in range(0, args.rows, step):
        rows = rng.standard_normal((min(step, args.rows - start), args.dim), dtype=np.float32)
        for store in stores.values():
            store.bulk_load("t", zipf.ids[start:start + step], rows)
    batches = [zipf.ids[zipf.ranks(args.batch)] for _ in range(args.repeats)]
    values = rng.standard_normal((args.batch, args.dim), dtype=np.float32)
    grads = values * np.float32(0.01)
    ops = {"lookup": lambda s, ids: s.lookup("t", ids),
           "update": lambda s, ids: s.update("t", ids, values),
           "apply_gradients": lambda s, ids: s.apply_gradients("t", ids, grads)}
    for op, fn in ops.items():
        med = interleaved_medians(
            {p: (lambda i, s=s, fn=fn: fn(s, batches[i])) for p, s in stores.items()},
            args.repeats)
        base = med["fp32"]
        print_table(f"{op}: {args.batch:,} Zipf({args.zipf}) ids, {args.rows:,} x {args.dim}",
                    [(f"{p}{' [baseline]' if p == 'fp32' else ''}", args.batch / t, base / t)
                     for p, t in med.items()])
    print("bytes per row held by the DRAM tier (payload + index):")
    for p, store in stores.items():
        tier = store.tier_statistics("t")[0]
        spec = store.table_spec("t")
        payload = spec.storage_width * spec.storage_dtype.itemsize
        print(f"  {p:<5} {tier.bytes / tier.rows:8.1f}  (stored row {payload} bytes: "
              f"{args.dim} weights + {spec.row_width - spec.dim} state)")
        store.close()
    return 0
