"""Row-wise Adagrad updates of Zipf ids through a DRAM store against the same update in numpy.

Both contenders apply the same batches in turn: the store through `apply_gradients` (validate,
sum duplicates, gather, fused step, write back), numpy on a plain weight array and accumulator
vector (one stable argsort of the positions, `np.add.reduceat` of the sorted gradients, the
FBGEMM rule, write back). `--profile` prints where the store's time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import numpy as np

import embstore
from embstore.optim import RowWiseAdagrad

from ._benchutil import add_size_arguments, build_table, interleaved_medians, print_table

LR, EPS = 0.01, 1e-8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench optim`."""
    add_size_arguments(parser, rows=1_000_000, repeats=20)
    parser.add_argument("--profile", action="store_true",
                        help="profile the store's apply_gradients and print the top calls")


def numpy_rowwise_adagrad(weights: np.ndarray, acc: np.ndarray, positions: np.ndarray,
                          grads: np.ndarray) -> None:
    """The baseline: one row-wise Adagrad step on `weights` [rows, dim] and `acc` [rows].

    Duplicate positions are summed in a fixed order: a stable sort groups them, then
    `np.add.reduceat` sums each group (deterministic, though not in position order).
    """
    order = np.argsort(positions, kind="stable")
    sorted_pos = positions[order]
    starts = np.flatnonzero(np.r_[True, sorted_pos[1:] != sorted_pos[:-1]])
    rows = sorted_pos[starts]
    g = np.add.reduceat(grads[order], starts, axis=0)
    w = weights[rows]
    a = acc[rows] + (g * g).sum(axis=1) / np.float32(g.shape[1])
    multiplier = np.float32(LR) / (np.sqrt(a) + np.float32(EPS))
    w -= g * multiplier[:, None]
    weights[rows] = w
    acc[rows] = a


def _profile(store: embstore.EmbeddingStore, ids: list[np.ndarray],
             grads: list[np.ndarray]) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for i, batch in enumerate(ids):
        store.apply_gradients("t", batch, grads[i % len(grads)])
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    print("profile of store.apply_gradients (by own time):")
    print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))


def run(args: argparse.Namespace) -> int:
    """Time store.apply_gradients against the numpy baseline; print rows/s and the ratio."""
    spec = embstore.TableSpec("t", dim=args.dim, optimizer=RowWiseAdagrad(LR, eps=EPS))
    store, weights, zipf = build_table(args, spec)
    acc = np.zeros(args.rows, dtype=np.float32)
    rng = np.random.default_rng(args.seed + 1)
    ranks = [zipf.ranks(args.batch) for _ in range(args.repeats)]
    ids = [zipf.ids[r] for r in ranks]
    grads = [rng.standard_normal((args.batch, args.dim), dtype=np.float32)
             for _ in range(min(args.repeats, 4))]
    distinct = np.mean([len(np.unique(r)) for r in ranks])

    def numpy_update(i: int) -> None:
        numpy_rowwise_adagrad(weights, acc, ranks[i], grads[i % len(grads)])

    def store_update(i: int) -> None:
        store.apply_gradients("t", ids[i], grads[i % len(grads)])

    med = interleaved_medians({"numpy": numpy_update, "store": store_update}, args.repeats)
    # Both applied the same batches in the same order. They sum duplicates in different
    # (each fixed) orders, so they agree to float32 rounding, not bit for bit.
    sample = np.unique(ranks[-1])[:2000]
    state = store.lookup_state("t", zipf.ids[sample])[:, 0]
    if not (np.allclose(store.lookup("t", zipf.ids[sample]), weights[sample], rtol=1e-4,
                        atol=1e-5) and np.allclose(state, acc[sample], rtol=1e-4)):
        print("error: store and numpy disagree after the same row-wise Adagrad updates")
        return 1
    ratio = med["numpy"] / med["store"]
    print_table(
        f"optim: row-wise Adagrad, {args.batch:,} Zipf({args.zipf}) ids "
        f"({distinct:,.0f} distinct) into {args.rows:,} x {args.dim} float32",
        [("numpy sort+reduceat+rule+scatter [baseline]", args.batch / med["numpy"], 1.0),
         ("embstore apply_gradients, DRAM tier", args.batch / med["store"], ratio)])
    print(f"ratio store/numpy: {ratio:.2f} (target >= 0.70)")
    if args.profile:
        _profile(store, ids, grads)
    store.close()
    return 0
