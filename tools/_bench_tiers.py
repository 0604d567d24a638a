"""Measure this machine's tiers for batched reads and writes and write a tier model (JSON).

For each tier (dram, pmem or its mmap fallback, rocksdb, lmdb) a store whose one table lives
on that tier alone is loaded with `--rows` rows of `--row-bytes` bytes, then batches of
distinct random ids are looked up (`lookup`) and overwritten (`update`, no flush: write-backs
between checkpoints are not synced) at a small and a large batch size, interleaved, median of
`--repeats`: the store's own work per call (validation, index, checksums) is in the figures,
as it is in every tier access of a training step. A line through the two medians,
time = latency + rows x row_bytes / bytes_per_s, gives each operation's per-batch latency
and throughput, the tier model `embstore plan` reads (schema in `embstore.placement`).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import embstore
from embstore import registry
from embstore.backend import BackendSpec
from embstore.errors import BackendUnavailableError, ConfigError
from embstore.placement import KNOWN_TIERS, save_document

from ._args import bench_size, non_negative_int, positive_int, quick_sizes, some_of, work_dir

__all__ = ["add_arguments", "measure_tiers", "run"]

_LOAD = 65536


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench tiers`."""
    # a str, not a Path: Path("") is "." and an empty -o must be told apart from a folder
    parser.add_argument("-o", "--output", default="tiers.json",
                        help="tier model to write (default tiers.json)")
    parser.add_argument("--rows", type=bench_size, default=400_000,
                        help="rows loaded per tier")
    parser.add_argument("--row-bytes", type=_row_bytes, default=260,
                        help="bytes per row, a multiple of 4 (default 260)")
    parser.add_argument("--small", type=bench_size, default=64,
                        help="rows in a small batch (64)")
    parser.add_argument("--large", type=bench_size, default=8192,
                        help="rows in a large batch (8192)")
    parser.add_argument("--repeats", type=bench_size, default=15,
                        help="timed batches per size")
    parser.add_argument("--tiers", type=_tier_names, default=",".join(KNOWN_TIERS),
                        help="tiers to measure, comma-separated (default: all)")
    parser.add_argument("--dir", type=work_dir, default=None,
                        help="where to build the tables, made if missing (default: a "
                             "temporary directory)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    quick_sizes(parser, rows=20_000, large=2048, repeats=3)


def _row_bytes(text: str) -> int:
    value = positive_int(text)
    if value % 4:  # rows are float32 weights
        raise argparse.ArgumentTypeError(f"{text!r} is not a multiple of 4")
    return value


_tier_names = some_of(KNOWN_TIERS, "tier")


def _fit(small: int, t_small: float, large: int, t_large: float,
         row_bytes: int) -> dict[str, float]:
    per_row = max((t_large - t_small) / (large - small), 1e-12)
    return {"bytes_per_s": row_bytes / per_row,
            "batch_latency_s": max(t_small - small * per_row, 0.0)}


def _measure(store: embstore.EmbeddingStore, rows: int, row_bytes: int, small: int,
             large: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    dim = row_bytes // 4
    for start in range(0, rows, _LOAD):
        n = min(_LOAD, rows - start)
        store.update("t", np.arange(start, start + n, dtype=np.int64),
                     rng.standard_normal((n, dim), dtype=np.float32))
    times: dict[tuple[str, int], list[float]] = {}
    for i in range(repeats + 2):  # two warm-up rounds
        for size in (small, large):
            ids = rng.choice(rows, size=size, replace=False).astype(np.int64)
            payload = rng.standard_normal((size, dim), dtype=np.float32)
            t0 = time.perf_counter()
            store.lookup("t", ids)
            t1 = time.perf_counter()
            store.update("t", ids, payload)
            t2 = time.perf_counter()
            if i >= 2:
                times.setdefault(("read", size), []).append(t1 - t0)
                times.setdefault(("write", size), []).append(t2 - t1)
    med = {k: float(np.median(v)) for k, v in times.items()}
    out: dict[str, Any] = {op: _fit(small, med[(op, small)], large, med[(op, large)], row_bytes)
                           for op in ("read", "write")}
    stats = store.tier_statistics("t")[0]
    out["overhead_bytes_per_row"] = max(0.0, stats.bytes / rows - row_bytes)
    return out


def measure_tiers(tiers: list[str], *, rows: int, row_bytes: int, small: int, large: int,
                  repeats: int, directory: Path, seed: int = 0) -> dict[str, Any]:
    """The tier model document of the given tiers, measured under `directory`.

    Tiers whose library is missing are left out with a note in ``"skipped"``.

    Raises:
        ConfigError: a bad size, an unknown tier, no tier named, or none measurable.
    """
    if row_bytes < 4 or row_bytes % 4 or not 1 <= small < large <= rows or repeats < 1:
        raise ConfigError("bench tiers: need --row-bytes a multiple of 4, 1 <= --small < "
                          f"--large <= --rows and --repeats >= 1, got {row_bytes}, {small}, "
                          f"{large}, {rows}, {repeats}")
    unknown = sorted(set(tiers) - set(KNOWN_TIERS))
    if unknown:
        raise ConfigError(f"unknown tiers {unknown}; known: {list(KNOWN_TIERS)}")
    if not tiers:  # a model of no tier is one `embstore plan` refuses
        raise ConfigError(f"bench tiers: --tiers names no tier; give some of "
                          f"{','.join(KNOWN_TIERS)}")
    tiers = list(dict.fromkeys(tiers))  # each measured once
    doc: dict[str, Any] = {"format": "embstore.tiers", "version": 1,
                           "host": f"{platform.node()} ({platform.machine()}, measured)",
                           "row_bytes": row_bytes, "tiers": {}, "skipped": {}}
    rng = np.random.default_rng(seed)
    for name in tiers:
        try:
            cls = registry.load_backend(name)
        except BackendUnavailableError as exc:
            doc["skipped"][name] = str(exc)
            continue
        spec = embstore.TableSpec("t", dim=row_bytes // 4, tiers=(embstore.TierSpec(name),))
        with embstore.open(directory / name, tables=[spec]) as store:
            entry = _measure(store, rows, row_bytes, small, large, repeats, rng)
        if name == "pmem":
            probe = cls.open(BackendSpec(path=directory / "probe", dim=1, table="probe"))
            try:
                stats = probe.statistics()
            finally:
                probe.close()
            entry["note"] = ("libpmem on persistent memory" if stats.get("is_pmem")
                             else "file mapping on ordinary storage (libpmem "
                                  f"{'loaded' if stats.get('libpmem') else 'absent'}, "
                                  "not persistent memory): the fallback")
        doc["tiers"][name] = entry
    if not doc["tiers"]:
        why = "; ".join(f"{n}: {w}" for n, w in doc["skipped"].items())
        raise ConfigError(f"bench tiers: no tier could be measured ({why}); install the "
                          "library of one, or measure dram")
    return doc


def run(args: argparse.Namespace) -> int:
    """Measure, write the model, print it."""
    from ._args import check_output

    check_output(args.output, "-o")  # before minutes of measuring, not after
    tiers = [t for t in args.tiers.split(",") if t]
    own = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="embstore-tiers-")) if own else args.dir
    directory.mkdir(parents=True, exist_ok=True)
    try:
        doc = measure_tiers(tiers, rows=args.rows, row_bytes=args.row_bytes, small=args.small,
                            large=args.large, repeats=args.repeats, directory=directory,
                            seed=args.seed)
    finally:
        if own:
            shutil.rmtree(directory, ignore_errors=True)
    save_document(args.output, doc)
    print(f"{'tier':<9} {'read MB/s':>10} {'read lat us':>12} {'write MB/s':>11} "
          f"{'write lat us':>13}")
    for name, t in doc["tiers"].items():
        print(f"{name:<9} {t['read']['bytes_per_s'] / 1e6:>10.1f} "
              f"{t['read']['batch_latency_s'] * 1e6:>12.1f} "
              f"{t['write']['bytes_per_s'] / 1e6:>11.1f} "
              f"{t['write']['batch_latency_s'] * 1e6:>13.1f}  {t.get('note', '')}")
    for name, why in doc["skipped"].items():
        print(f"{name:<9} skipped: {why}")
    print(f"wrote {args.output}")
    return 0
