"""The store side of one training step (lookup + apply_gradients of a batch's distinct ids).

A step of a model with a pooled embedding bag: the batch is `--bags` bags of `--bag-size` ids;
the trainer looks up the batch's distinct ids once (`store.lookup(table, unique)`), pools,
and after backward hands the store one summed gradient per distinct id
(`store.apply_gradients(table, unique, summed)`). Both of these calls are timed here, on a
pre-loaded all-DRAM table with row-wise Adagrad; grouping the batch and summing its gradients
are the trainer's work and are done before the clock starts.

The baseline, measured in the same run on the same batches, is numpy on a plain weight array
and accumulator vector: `np.take` of the distinct rows, the row-wise Adagrad rule, and a
scatter of weights and accumulators back. Rates count the batch's ids with duplicates (the
rows a pooled lookup reads), as embedding-bag benchmarks quote them.

`--record-accesses 1,0.1` then times the same step on a store that records an access log
(`embstore.open(..., record_accesses=, record_sample=)`) at each rate, against the step
without, interleaved; and the recorder's own calls alone, as a share of the step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import embstore
from embstore.index import IdGroups
from embstore.optim import RowWiseAdagrad

from ._args import bench_size, non_negative_int, quick_sizes
from ._benchutil import build_table, interleaved_medians, on_threads, print_table, zipf_exponent

LR, EPS = 0.01, 1e-8

# FBGEMM's CPU table-batched embedding with fused row-wise Adagrad (forward + backward with
# the fused update), 10M x 64 float32, bags of 20, on this project's reference machine.
# Reference measured elsewhere, not in this run: a fixed figure to read ours against.
FBGEMM_REFERENCE = {"uniform": 1.2e6, "zipf": 2.7e6}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench step`."""
    parser.add_argument("--rows", type=bench_size, default=10_000_000,
                        help="table rows (10M)")
    parser.add_argument("--dim", type=bench_size, default=64, help="embedding dim (64)")
    parser.add_argument("--bags", type=bench_size, default=4096, help="bags per batch (4096)")
    parser.add_argument("--bag-size", type=bench_size, default=20, help="ids per bag (20)")
    parser.add_argument("--dist", choices=("uniform", "zipf"), default="uniform",
                        help="id distribution (uniform)")
    parser.add_argument("--zipf", type=zipf_exponent, default=1.05,
                        help="Zipf exponent, above 0 (1.05)")
    parser.add_argument("--repeats", type=bench_size, default=15,
                        help="timed steps per contender")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--profile", action="store_true",
                        help="profile the store's step and print the top calls")
    parser.add_argument("--record-accesses", default=None, metavar="RATES",
                        type=_rates, help="also time the step while it records an access "
                                          "log at these sampling rates, e.g. 1,0.1,0.01")
    quick_sizes(parser, rows=20_000, bags=256, repeats=5)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of rates, e.g. 1,0.1") from None
    if not rates or not all(2.0 ** -24 <= r <= 1 for r in rates):
        # as a store's record_sample takes them: ids are kept by a 24-bit hash
        raise argparse.ArgumentTypeError(f"{text!r}: rates must lie in [2**-24, 1]")
    if len(set(rates)) != len(rates):  # each rate records to a log of its own name
        raise argparse.ArgumentTypeError(f"{text!r} gives a rate twice")
    return rates


def numpy_step(weights: np.ndarray, acc: np.ndarray, positions: np.ndarray,
               grads: np.ndarray) -> np.ndarray:
    """The baseline: rows of distinct `positions`, then one row-wise Adagrad step on them."""
    out = np.take(weights, positions, axis=0)  # the forward's rows
    w = out.copy()  # the forward's rows belong to the trainer; update a copy
    a = acc[positions] + (grads * grads).sum(axis=1) / np.float32(grads.shape[1])
    multiplier = np.float32(LR) / (np.sqrt(a) + np.float32(EPS))
    w -= grads * multiplier[:, None]
    weights[positions] = w
    acc[positions] = a
    return out


def run(args: argparse.Namespace) -> int:
    """Time lookup + apply_gradients against the numpy step; print ids/s and the ratio."""
    args.batch = args.bags * args.bag_size
    spec = embstore.TableSpec("t", dim=args.dim, optimizer=RowWiseAdagrad(LR, eps=EPS))
    store, weights, zipf = build_table(args, spec)
    args.batch = args.bags * args.bag_size  # `--quick` resets it in build_table
    acc = np.zeros(args.rows, dtype=np.float32)
    rng = np.random.default_rng(args.seed + 1)
    if args.dist == "zipf":
        ranks = [zipf.ranks(args.batch) for _ in range(args.repeats)]
    else:
        ranks = [rng.integers(0, args.rows, args.batch) for _ in range(args.repeats)]
    # the trainer's work, outside the clock: distinct ids in first-occurrence order and the
    # per-id sum of the per-position gradients
    positions = [IdGroups(r) for r in ranks]
    unique_pos = [g.unique for g in positions]
    unique_ids = [np.ascontiguousarray(zipf.ids[u]) for u in unique_pos]
    grads = []
    for g in positions[: min(args.repeats, 4)]:
        per_position = rng.standard_normal((args.batch, args.dim), dtype=np.float32)
        grads.append(g.sum_rows(per_position * np.float32(0.1)))
    distinct = np.mean([len(u) for u in unique_pos])

    def grad(i: int) -> np.ndarray:
        g = grads[i % len(grads)]
        n = len(unique_pos[i])
        if len(g) >= n:
            return g[:n]
        return np.resize(g, (n, args.dim))

    batch_grads = [np.ascontiguousarray(grad(i)) for i in range(args.repeats)]

    def numpy_update(i: int) -> None:
        numpy_step(weights, acc, unique_pos[i], batch_grads[i])

    def store_update(i: int) -> None:
        store.lookup("t", unique_ids[i])
        store.apply_gradients("t", unique_ids[i], batch_grads[i])

    med = interleaved_medians({"numpy": numpy_update, "store": on_threads(1, store_update)},
                              args.repeats)
    # both applied the same steps in the same order: the tables agree to float32 rounding
    sample = unique_pos[-1][:2000]
    state = store.lookup_state("t", zipf.ids[sample])[:, 0]
    if not (np.allclose(store.lookup("t", zipf.ids[sample]), weights[sample], rtol=1e-4,
                        atol=1e-5) and np.allclose(state, acc[sample], rtol=1e-4)):
        print("error: store and numpy disagree after the same row-wise Adagrad steps")
        return 1
    ratio = med["numpy"] / med["store"]
    rate = args.batch / med["store"]
    what = "uniform" if args.dist == "uniform" else f"Zipf({args.zipf})"
    print_table(
        f"step: {args.bags:,} bags x {args.bag_size} {what} ids ({args.batch:,} ids, "
        f"{distinct:,.0f} distinct) of {args.rows:,} x {args.dim} float32, row-wise Adagrad",
        [("numpy take+rule+scatter [baseline]", args.batch / med["numpy"], 1.0),
         ("embstore lookup+apply_gradients, DRAM", rate, ratio)])
    print(f"ratio store/numpy: {ratio:.2f}")
    threads = embstore.get_num_threads()
    if threads > 1:  # after the check: these steps apply the batches again
        again = interleaved_medians({"one": on_threads(1, store_update),
                                     "many": store_update}, args.repeats)
        print(f"store step on {threads} threads: {args.batch / again['many'] / 1e6:.2f}M ids/s, "
              f"{again['one'] / again['many']:.2f}x the store on 1 thread in the same run")
    print(f"store step: {rate / 1e6:.2f}M ids/s ({distinct / med['store'] / 1e6:.2f}M distinct "
          f"ids/s); {med['store'] * 1e3:.1f} ms per step")
    ref = FBGEMM_REFERENCE[args.dist]
    print(f"reference measured elsewhere (not in this run): FBGEMM CPU TBE with fused "
          f"row-wise Adagrad, 10M x 64, bags of 20, {args.dist} ids: {ref / 1e6:.1f}M ids/s")
    if args.record_accesses:
        _time_recording(args, store, store_update, unique_ids, med["store"])
    if args.profile:
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        for i in range(args.repeats):
            store_update(i)
        profiler.disable()
        print(f"profiled {args.repeats} steps in {time.perf_counter() - t0:.2f} s")
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        print("profile of the store's step (by own time):")
        print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))
    store.close()
    return 0


def _time_recording(args: argparse.Namespace, store: embstore.EmbeddingStore,
                    step: Callable[[int], None], unique_ids: list[np.ndarray],
                    plain: float) -> None:
    """Time the step while it records an access log at each of `args.record_accesses`."""
    from embstore._access_log import AccessRecorder

    with tempfile.TemporaryDirectory(prefix="embstore-bench-log-") as tmp:
        recorders = {rate: AccessRecorder(Path(tmp) / f"log-{rate:g}", ["t"], rate)
                     for rate in args.record_accesses}

        def recording(rec: AccessRecorder | None) -> Callable[[int], None]:
            def run(i: int) -> None:
                store._attach_recorder(rec)
                try:
                    step(i)
                finally:
                    store._attach_recorder(None)
            return run

        contenders = {"store": recording(None)}
        contenders.update({f"store, recording at {r:g}": recording(rec)
                           for r, rec in recorders.items()})
        med = interleaved_medians(contenders, args.repeats)
        # the recorder's own calls alone, on the same batches (what the step pays for it)
        alone = {}
        for rate, rec in recorders.items():
            def calls(i: int, rec: AccessRecorder = rec) -> None:
                rec.lookup("t", unique_ids[i])
                rec.write("t", unique_ids[i])
            alone[rate] = interleaved_medians({"log": calls}, args.repeats)["log"]
        sizes = {}
        for rate, rec in recorders.items():
            rec.close()
            sizes[rate] = sum(f.stat().st_size for f in (Path(tmp) / f"log-{rate:g}").iterdir())
    steps = (args.repeats + 2) * 2  # warm-up and timed calls of both timings
    print_table(f"step while recording an access log ({args.bags * args.bag_size:,} ids a step)",
                [(name, args.bags * args.bag_size / t, med["store"] / t)
                 for name, t in med.items()])
    for rate in args.record_accesses:
        share = alone[rate] / plain
        print(f"recording at {rate:g}: {alone[rate] * 1e3:.3f} ms of the recorder a step = "
              f"{100 * share:.2f}% of the {plain * 1e3:.1f} ms step; step with it "
              f"{100 * (med[f'store, recording at {rate:g}'] / med['store'] - 1):+.1f}% "
              f"(interleaved medians); log {sizes[rate] / steps / 1024:.1f} KiB a step")
