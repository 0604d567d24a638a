"""Training steps through embstore.torch vs torch.nn.EmbeddingBag, FBGEMM and an all-DRAM model.

Two parts, each ratio measured in the same run with interleaved repeats:

- `step`: one training step (forward, backward, fused row-wise Adagrad update) of
  `embstore.torch.EmbeddingBag` over an all-DRAM table, against torch.nn.EmbeddingBag
  (sparse=True) stepped by torch.optim.Adagrad, and against FBGEMM's CPU table-batched
  embedding bag with its fused EXACT_ROWWISE_ADAGRAD (where fbgemm_gpu is installed). All hold
  the same weights, loaded before timing, and see the same bags (uniform or Zipf ids) and the
  same output gradients. embstore and FBGEMM apply the same rule, so their tables are compared
  after the timed steps.
- `demo`: training steps of the `embstore demo` DLRM with its tables on RocksDB behind a DRAM
  tier of a tenth of their rows, pipelined and in line, against the same model with every
  row in DRAM (pipelined and in line; the faster is the baseline), and the dense compute alone
  (the same model on embeddings that are plain tensors). Each runs on its own store; every
  row of every table is loaded before timing, so the tiered tables hold 10x their DRAM tier,
  and untimed steps run until every DRAM tier is full, so each timed miss reads a row from
  the bottom tier and writes an evicted one back, as in a long run. The four stores must
  end identical.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

import embstore
from embstore._parallel import available_cores

from ._args import bench_size, non_negative_int, quick_sizes, some_of, thread_count
from ._benchutil import interleaved_medians, print_table, zipf_exponent

LR, EPS = 0.01, 1e-8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench torch`."""
    parser.add_argument("--rows", type=bench_size, default=10_000_000,
                        help="rows of the step part's table (10,000,000)")
    parser.add_argument("--dim", type=bench_size, default=64, help="embedding dim (64)")
    parser.add_argument("--bag", type=bench_size, default=20, help="ids per bag (20)")
    parser.add_argument("--batch", type=bench_size, default=4096, help="bags per step (4096)")
    parser.add_argument("--dist", default="uniform,zipf",
                        type=some_of(("uniform", "zipf"), "distribution"),
                        help="id distributions of the step part: uniform, zipf (both)")
    parser.add_argument("--zipf", type=zipf_exponent, default=1.05,
                        help="Zipf exponent, above 0 (1.05)")
    parser.add_argument("--parts", default="step,demo", type=some_of(("step", "demo"), "part"),
                        help="parts to run: step, demo (both)")
    parser.add_argument("--repeats", type=bench_size, default=15,
                        help="timed steps per contender (15)")
    parser.add_argument("--demo-rows", type=bench_size, default=1_000_000,
                        help="ids per feature of the demo model's 8 tables (1,000,000)")
    parser.add_argument("--demo-batch", type=bench_size, default=2048,
                        help="samples per step of the demo model (2048)")
    parser.add_argument("--demo-chunk", type=bench_size, default=10,
                        help="demo steps per timed repeat (10)")
    parser.add_argument("--threads", type=thread_count, default=1,
                        help="torch threads of every contender (1); embstore's own DRAM "
                             "kernels run on embstore.get_num_threads() (EMBSTORE_NUM_THREADS)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    quick_sizes(parser, rows=20_000, batch=256, repeats=3, demo_rows=5_000, demo_batch=256,
                demo_chunk=3)


def run(args: argparse.Namespace) -> int:
    """Run the chosen parts; exit 1 if a check of the results fails."""
    # The contenders take turns in one process. OpenMP's workers (FBGEMM's, torch's) spin
    # for a while after each parallel region by default, on the core the next contender's
    # threads need: passive waits (unless the caller chose) give each its cores back.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch
    except ImportError as exc:
        print(f"embstore bench torch: error: needs torch ({exc}); install the [torch] extra")
        return 2
    parts, dists = args.parts.split(","), args.dist.split(",")
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {args.threads} (every contender); OpenMP waits: "
          f"{os.environ['OMP_WAIT_POLICY'].lower()}; embstore threads: "
          f"{embstore.get_num_threads()}")
    try:
        rc = 0
        if "step" in parts:
            rc = max(rc, _step_part(args, dists, torch))
        if "demo" in parts:
            rc = max(rc, _demo_part(args, torch))
        return rc
    finally:
        torch.set_num_threads(previous)


# --- part 1: one EmbeddingBag training step --------------------------------------------------


def _fbgemm(rows: int, dim: int) -> tuple[Any, str]:
    """FBGEMM's CPU TBE with fused exact row-wise Adagrad, or (None, why not)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fbgemm_gpu.split_embedding_configs import EmbOptimType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
                EmbeddingLocation,
                PoolingMode,
            )
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
                ComputeDevice,
                SplitTableBatchedEmbeddingBagsCodegen,
            )

            tbe = SplitTableBatchedEmbeddingBagsCodegen(
                [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS,
                pooling_mode=PoolingMode.SUM, device="cpu")
    except Exception as exc:  # not installed, or built for another torch
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
    return tbe, ""


def _step_part(args: argparse.Namespace, dists: list[str], torch: Any) -> int:
    import embstore
    import embstore.torch as et
    from embstore.optim import RowWiseAdagrad

    rows, dim, bag, batch = args.rows, args.dim, args.bag, args.batch
    n_ids = batch * bag
    rng = np.random.default_rng(args.seed)
    # id of row i in the store: scattered over the id space as hashed ids are
    mult = np.uint64(int(rng.integers(1, 2**62)) * 2 + 1)

    def store_ids(pos: np.ndarray) -> np.ndarray:
        return (pos.astype(np.uint64) * mult).view(np.int64)

    t0 = time.perf_counter()
    weights = torch.empty(rows, dim)
    chunk = 1 << 20
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        weights[start:stop] = torch.from_numpy(
            rng.uniform(-0.05, 0.05, size=(stop - start, dim)).astype(np.float32))
    store = embstore.open(None, tables=[embstore.TableSpec(
        "t", dim=dim, optimizer=RowWiseAdagrad(LR, eps=EPS))])
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        store.bulk_load("t", store_ids(np.arange(start, stop)), weights[start:stop].numpy())
    ours = et.EmbeddingBag(store, "t", mode="sum")
    tbe, why = _fbgemm(rows, dim)
    if tbe is not None:
        with torch.no_grad():
            tbe.split_embedding_weights()[0].copy_(weights)
    # torch's module takes the loaded tensor itself (the others hold copies)
    ref = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, _weight=weights)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=LR, eps=EPS)
    del weights
    print(f"step: loaded {rows:,} x {dim} float32 into embstore (DRAM tier), "
          f"torch.nn.EmbeddingBag{'' if tbe is None else ' and FBGEMM'} "
          f"in {time.perf_counter() - t0:.1f} s")
    if tbe is None:
        print(f"step: FBGEMM skipped: fbgemm_gpu not usable here ({why}); "
              "pip install fbgemm-gpu-cpu matching the installed torch")

    offsets = torch.arange(0, n_ids, bag, dtype=torch.int64)
    tbe_offsets = torch.arange(0, n_ids + 1, bag, dtype=torch.int64)
    grad_rng = torch.Generator().manual_seed(args.seed)
    grads = [torch.randn(batch, dim, generator=grad_rng) * 0.1 for _ in range(4)]
    rc = 0
    for dist in dists:
        if dist == "uniform":
            positions = [torch.from_numpy(rng.integers(0, rows, n_ids)) for _ in
                         range(args.repeats)]
        else:
            from ._benchutil import ZipfIds

            zipf = ZipfIds(rows, args.zipf, seed=args.seed + 1)
            # Zipf ranks map to row positions through a permutation, so hot rows are scattered
            perm = np.random.default_rng(args.seed + 2).permutation(rows)
            positions = [torch.from_numpy(perm[zipf.ranks(n_ids)]) for _ in range(args.repeats)]
        ids = [torch.from_numpy(store_ids(p.numpy())) for p in positions]
        distinct = float(np.mean([len(np.unique(p.numpy())) for p in positions]))

        def step_embstore(i: int, ids: list = ids) -> None:
            ours(ids[i], offsets).backward(grads[i % 4])

        def step_torch(i: int, positions: list = positions) -> None:
            ref_opt.zero_grad(set_to_none=True)
            ref(positions[i], offsets).backward(grads[i % 4])
            ref_opt.step()

        def step_fbgemm(i: int, positions: list = positions) -> None:
            tbe(positions[i], tbe_offsets).backward(grads[i % 4])

        contenders = {"torch": step_torch, "embstore": step_embstore}
        if tbe is not None:
            contenders["fbgemm"] = step_fbgemm
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            med = interleaved_medians(contenders, args.repeats)
        table = [("torch.nn.EmbeddingBag(sparse) + optim.Adagrad", n_ids / med["torch"],
                  med["torch"] / med["torch"])]
        if tbe is not None:
            table.append(("FBGEMM CPU TBE, fused row-wise Adagrad", n_ids / med["fbgemm"],
                          med["torch"] / med["fbgemm"]))
        threads = embstore.get_num_threads()
        table.append((f"embstore.torch.EmbeddingBag, row-wise Adagrad, {threads} thread"
                      f"{'s' if threads > 1 else ''}", n_ids / med["embstore"],
                      med["torch"] / med["embstore"]))
        print_table(f"step ({dist}): {batch:,} bags x {bag} ids ({distinct:,.0f} distinct rows) "
                    f"from {rows:,} x {dim}; ratios to torch", table)
        print(f"ratio embstore/torch ({dist}): {med['torch'] / med['embstore']:.2f}")
        if tbe is not None:
            ratio = med["fbgemm"] / med["embstore"]
            print(f"ratio embstore/fbgemm ({dist}): {ratio:.2f} (target >= 1.0)")
            # the same rule applied to the same steps in the same order: the tables agree
            # to float32 rounding (each sums duplicate ids in its own order)
            sample = np.unique(positions[-1].numpy())[:2000]
            mine = store.lookup("t", store_ids(sample))
            theirs = tbe.split_embedding_weights()[0][torch.from_numpy(sample)].numpy()
            if not np.allclose(mine, theirs, rtol=1e-3, atol=1e-5):
                print(f"error ({dist}): embstore and FBGEMM tables disagree after the same "
                      "row-wise Adagrad steps")
                rc = 1
        else:
            print(f"ratio embstore/fbgemm ({dist}): skipped (FBGEMM not installed)")
    store.close()
    return rc


# --- part 2: the demo's DLRM through a tiered store --------------------------------------------


class _Contender:
    """One copy of the demo model on its own store, trained chunk by chunk."""

    def __init__(self, cfg: Any, store: Any, *, pipeline: bool, torch: Any) -> None:
        import embstore.torch as et

        from ._dlrm import build_model

        self.store, self.pipeline, self.torch, self.et = store, pipeline, torch, et
        torch.manual_seed(cfg.seed)
        self.ebc = et.EmbeddingBagCollection(
            store, cfg.feature_tables(), mode="sum")
        self.model = build_model(cfg, self.ebc)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.dense_lr)
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def train(self, batches: list[Any]) -> None:
        if self.pipeline:
            with self.et.TrainPipeline(batches, inputs=lambda b: {self.ebc: b.sparse},
                                       depth=2) as pipe:
                for b in pipe:
                    self._step(b)
        else:
            for b in batches:
                self._step(b)

    def _step(self, b: Any) -> None:
        loss = self.loss_fn(self.model(b), b.labels)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


_WARM_STEPS_MAX = 2_000
"""Most untimed steps before the timed ones (the DRAM tiers full by then or not)."""


def _top_tiers(store: Any) -> list[Any]:
    """The statistics of the top (DRAM) tier of each of `store`'s tables."""
    return [info["tiers"][0] for info in store.stats().values()]


def _dram_fill(store: Any) -> float:
    """Rows held over rows allowed, summed over the DRAM tiers of `store`'s tables."""
    top = _top_tiers(store)
    return sum(t.rows for t in top) / max(sum(t.capacity_rows or 0 for t in top), 1)


def _metered(fn: Callable[[int], None], name: str, cpu: dict[str, float],
             wall: dict[str, float]) -> Callable[[int], None]:
    """`fn`, adding the process's CPU seconds and the wall seconds of each call to `name`'s."""
    def call(i: int) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        fn(i)
        cpu[name] += time.process_time() - c0
        wall[name] += time.perf_counter() - t0
    return call


def _demo_part(args: argparse.Namespace, torch: Any) -> int:
    from ._dlrm import ClickStream, DemoConfig, build_model, make_store, table_digest

    cfg = DemoConfig(rows=args.demo_rows, seed=args.seed)
    stream = ClickStream(cfg)
    chunk, reps = args.demo_chunk, args.repeats
    tmp = tempfile.TemporaryDirectory(prefix="embstore-bench-torch-")
    t0 = time.perf_counter()
    # one store per contender, each trained on the same steps in the same order (a store
    # shared by two contenders would hand the second one rows the first just brought up)
    layouts = {"tiered, pipelined": (False, True), "tiered, in line": (False, False),
               "all DRAM, pipelined": (True, True), "all DRAM, in line": (True, False)}
    stores, contenders = {}, {}
    for i, (name, (all_dram, pipeline)) in enumerate(layouts.items()):
        stores[name] = make_store(cfg, None if all_dram else f"{tmp.name}/{i}",
                                  all_dram=all_dram)
        contenders[name] = _Contender(cfg, stores[name], pipeline=pipeline, torch=torch)
    # every id of every table stored, as in a trained model: the tiered tables then hold 10x
    # their DRAM tier and the timed steps' misses read RocksDB (the rows loaded are the
    # initial values, so training goes on as from scratch)
    for f, table in enumerate(cfg.table_names()):
        spec = stores["all DRAM, in line"].table_spec(table)
        for start in range(0, cfg.rows, 1 << 20):
            ids = stream.ids(f, np.arange(start, min(cfg.rows, start + (1 << 20))))
            rows = spec.init(ids, spec.dim, spec.dtype)
            for store in stores.values():
                store.bulk_load(table, ids, rows)
    tiered = stores["tiered, pipelined"]
    cache_rows = sum(t.capacity_rows or 0 for t in _top_tiers(tiered))
    stored = sum(tiered.num_rows(n) for n in tiered.tables)
    print(f"demo: loaded every row into 4 stores in {time.perf_counter() - t0:.1f} s: a tiered "
          f"store holds {stored:,} rows, {stored / cache_rows:.0f}x its DRAM tier of "
          f"{cache_rows:,} rows")
    # untimed steps until every table's DRAM tier is full, as in a long run: a tier still
    # filling up evicts nothing, so its misses would cost a read and no write-back. A tier
    # admitting every id holds every distinct id seen until it is full, so the stream alone
    # says when that is (no stats() call, which scans the RocksDB tier, per chunk).
    capacity = cache_rows // cfg.features
    seen = [np.zeros(0, np.int64) for _ in range(cfg.features)]
    step, t0 = 0, time.perf_counter()
    while step < _WARM_STEPS_MAX and min(len(s) for s in seen) < capacity:
        warm = [stream.batch(k, args.demo_batch) for k in range(step, step + chunk)]
        for f, name in enumerate(cfg.feature_names()):
            seen[f] = np.union1d(seen[f], np.concatenate([b.sparse[name][0].numpy()
                                                          for b in warm]))
        for c in contenders.values():
            c.train(warm)
        step += chunk
    fill = _dram_fill(tiered)
    print(f"demo: {step} untimed steps ({time.perf_counter() - t0:.1f} s) filled the DRAM "
          f"tiers to {fill:.0%} of their rows")
    chunks = [[stream.batch(k, args.demo_batch) for k in range(step + c * chunk,
                                                                 step + (c + 1) * chunk)]
              for c in range(reps)]
    dense_model = build_model(cfg, None)
    dense_opt = torch.optim.Adam(dense_model.parameters(), lr=cfg.dense_lr)
    emb_rng = torch.Generator().manual_seed(args.seed)
    embs = [torch.randn(args.demo_batch, cfg.features * cfg.dim, generator=emb_rng) * 0.05
            for _ in range(chunk)]

    def compute_alone(i: int) -> None:
        for b, e in zip(chunks[i], embs, strict=True):
            e = e.detach().requires_grad_()
            logits = dense_model.interact(dense_model.bottom(b.dense), e)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
            dense_opt.zero_grad()
            loss.backward()
            dense_opt.step()

    def tier0(store: Any) -> tuple[int, int]:
        top = _top_tiers(store)
        return sum(t.hits for t in top), sum(t.lookups for t in top)

    before = {name: tier0(stores[name]) for name in ("tiered, pipelined", "tiered, in line")}
    # interleaved_medians runs two warm-up repeats on the last chunks first; every contender
    # still sees the same chunks in the same order
    fns = {name: (lambda i, c=c: c.train(chunks[i])) for name, c in contenders.items()}
    fns["compute alone"] = compute_alone
    # CPU time of every thread of the process (training, pipeline, write-back, RocksDB's own)
    # over wall time: how many cores a contender keeps busy, so a step bound by the cores
    # can be told from one whose threads wait on each other (the GIL, a queue)
    cpu, wall = dict.fromkeys(fns, 0.0), dict.fromkeys(fns, 0.0)
    fns = {name: _metered(fn, name, cpu, wall) for name, fn in fns.items()}
    med = interleaved_medians(fns, reps)
    samples = chunk * args.demo_batch
    base_name = min(("all DRAM, pipelined", "all DRAM, in line"), key=lambda n: med[n])
    base = med[base_name]
    print(f"demo: DLRM training steps ({cfg.features} tables of {cfg.rows:,} x {cfg.dim}, "
          f"{args.demo_batch:,} samples per step, {chunk} steps per repeat); ratios to the "
          "faster all-DRAM run")
    print(f"  {'contender':<44}{'samples/s':>14}{'ratio':>9}{'cores busy':>12}")
    for name in fns:
        label = f"{name}{' [baseline]' if name == base_name else ''}"
        print(f"  {label:<44}{samples / med[name]:>14,.0f}{base / med[name]:>8.2f}x"
              f"{cpu[name] / max(wall[name], 1e-9):>12.2f}")
    print(f"demo: cores busy: CPU time of all the process's threads over wall time, of "
          f"{available_cores()} cores")
    for name, (hits0, lookups0) in before.items():
        hits, lookups = tier0(stores[name])
        print(f"demo: {name}: hit ratio of the DRAM tier over the timed steps "
              f"{(hits - hits0) / max(lookups - lookups0, 1):.1%} of {lookups - lookups0:,} "
              "lookups")
    ratio = base / med["tiered, pipelined"]
    print(f"ratio tiered pipelined / all-DRAM: {ratio:.2f} (target >= 0.8)")
    print(f"ratio tiered in line / all-DRAM: {base / med['tiered, in line']:.2f}")
    print(f"ratio compute alone / all-DRAM: {base / med['compute alone']:.2f}")
    digests = set()
    for store in stores.values():
        store.flush()
        digests.add(table_digest(store))
        store.close()
    tmp.cleanup()
    if len(digests) != 1:
        print("error: the four stores differ after the same training steps")
        return 1
    print("demo: the four stores' tables are identical after the same steps (digest)")
    return 0
