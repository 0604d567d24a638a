"""Check the planner against reality: predicted hit ratios and time per batch vs replays.

On the calibrated synthetic trace with `--tables` tables of mixed sizes and skews (the 2021
profile's shape, spread over more tables), this profiles the trace, takes a tier model
(measured here unless `--tiers` names one), plans at DRAM and pmem budgets given as shares of
the total table bytes, and reports:

(a) each cached table's predicted top-tier hit ratio beside the simulator's (same policy,
    same cache size, the same training-step calls, no sampling; and on lookups alone) and a
    real store's replay (open(placement=), lookups of each batch's
    distinct ids, then the optimizer step);
(b) the plan's time per batch, predicted and measured by that replay, beside two naive
    placements at the same budgets: every table's caches in proportion to its size, and the
    hottest tables (bandwidth demand per sample) whole in DRAM first;
(c) the DRAM the plan needs to reach 90% of the all-DRAM throughput (predicted; then measured
    at that budget against an all-DRAM replay), as a share of the total table bytes.

Replays preload every table's rows into its chain, reopen the store (caches start empty) and
time each table's step (lookup and optimizer step) after the warm-up batches; a placement's
measured time per batch is the sum over tables of the median step, robust to bursts of other
work on a shared machine. They include the store's per-call overhead, which the model leaves
out, so measured times are compared with each other and predicted ones with each other.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import embstore
from embstore.errors import ConfigError
from embstore.placement import load_document
from embstore.tools.simulator import Trace
from embstore.tools.traces import PROFILES, synthesize

from ._args import (
    bench_size,
    check_output,
    existing_file,
    non_negative_float,
    non_negative_int,
    quick_sizes,
    work_dir,
)
from ._bench_tiers import measure_tiers
from ._mrc import policy_curve
from ._plan import Option, chain_option, naive_placement, plan, to_placement
from .profile import build_profile, split_tables

__all__ = ["add_arguments", "run"]

_DIM = 64  # with row-wise Adagrad's one state float: 260-byte rows, the profile's default


def _share(text: str) -> float:
    """A share of the table bytes, in [0, 1] (more is no budget: every row fits)."""
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 1: a share of the table "
                                         "bytes is at most all of them")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench placement`."""
    parser.add_argument("--tables", type=bench_size, default=32, help="synthetic tables (32)")
    parser.add_argument("--batches", type=bench_size, default=160, help="batches (160)")
    parser.add_argument("--lookups", type=bench_size, default=8192,
                        help="lookups per batch (8192)")
    parser.add_argument("--dram", type=_share, default=0.05,
                        help="DRAM budget as a share of the total table bytes (0.05)")
    parser.add_argument("--pmem", type=_share, default=0.25,
                        help="pmem budget as a share of the total table bytes (0.25)")
    parser.add_argument("--tiers", type=existing_file, default=None,
                        help="tier model to plan with (default: measure dram, pmem, rocksdb)")
    parser.add_argument("--policies", default="clock,wtinylfu:hold_new=1",
                        help="eviction specs the profile replays, clock among them (the "
                             "proportional reference runs it) (clock,wtinylfu:hold_new=1)")
    parser.add_argument("--warmup", type=_warmup_share, default=0.25,
                        help="share of the batches, in [0, 1), that only warm the caches "
                             "(0.25)")
    parser.add_argument("--no-replay", action="store_true", help="model and simulator only")
    parser.add_argument("--dir", type=work_dir, default=None, help="where replays build stores")
    parser.add_argument("--seed", type=non_negative_int, default=1)
    # a str, not a Path: Path("") is "." and an empty -o must be told apart from a folder
    parser.add_argument("-o", "--output", default=None, help="report JSON")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    quick_sizes(parser, tables=8, batches=24, lookups=2048)


def _warmup_share(text: str) -> float:
    value = non_negative_float(text)
    if value >= 1:  # no batch would be left to measure
        raise argparse.ArgumentTypeError(f"{text!r} must be below 1")
    return value


def _seconds(chosen: dict[str, Option]) -> float:
    return sum(o.seconds for o in chosen.values())


def _simulated_hits(tables: dict[str, list[np.ndarray]], chosen: dict[str, Option],
                    warmup: int, step_calls: int) -> dict[str, tuple[float, float, float]]:
    """(predicted, simulated, simulated on lookups alone) top-tier hit ratio of each cache.

    The simulator replays every batch as the profile did (`step_calls` calls a batch: a
    training step's lookup, then the optimizer's read and write) at the planned cache size,
    with no sampling, so it checks the profile's sampled and interpolated curve; the replay
    of lookups alone (`embstore simulate`) shows what the update calls change.
    """
    out = {}
    for name, o in chosen.items():
        if not o.caps:
            continue
        trace = Trace(tables[name])
        step, lookups = (float(policy_curve(trace, o.policies[0], [o.caps[0]], warmup=warmup,
                                            step_calls=calls)[0])
                         for calls in (step_calls, 1))
        out[name] = (o.hit_ratios[0], 1.0 - step, 1.0 - lookups)
    return out


def replay(tables: dict[str, list[np.ndarray]], chosen: dict[str, Option],
           budget: dict[str, int], directory: Path, warmup: int) -> dict[str, Any]:
    """Train through a real store placed by `chosen`.

    Returns seconds per batch and the top-tier hit ratio (per distinct lookup) of each
    table, over the batches from `warmup` on.
    """
    specs = [embstore.TableSpec(n, dim=_DIM, optimizer=embstore.optim.RowWiseAdagrad(lr=0.01))
             for n in sorted(tables)]
    doc = to_placement(chosen, budget)
    with embstore.open(directory, tables=specs, placement=doc) as store:
        fill = np.zeros((65536, _DIM), np.float32)
        for name, batches in tables.items():
            ids = np.unique(np.concatenate(batches))
            for start in range(0, len(ids), len(fill)):
                part = ids[start:start + len(fill)]
                store.update(name, part, fill[:len(part)])
    grads = np.full((max(len(b) for bs in tables.values() for b in bs), _DIM), 1e-3,
                    np.float32)
    hits = dict.fromkeys(tables, 0)
    asked = dict.fromkeys(tables, 0)
    names = sorted(tables)
    batches = [[np.unique(tables[n][b]) for n in names] for b in range(len(tables[names[0]]))]
    spent: dict[str, list[float]] = {n: [] for n in names}
    with embstore.open(directory) as store:  # caches start empty on open
        # the top tier's counters, read directly: statistics() also counts the rows of every
        # tier, a scan of the whole table on RocksDB
        tops = {n: store._tables[n].chain.tiers[0].counters for n in names}
        for b, step in enumerate(batches):
            for name, ids in zip(names, step, strict=True):
                if not len(ids):
                    continue
                before = tops[name]["hits"], tops[name]["lookups"]
                t0 = time.perf_counter()
                store.lookup(name, ids)
                t1 = time.perf_counter()
                if b >= warmup:
                    hits[name] += tops[name]["hits"] - before[0]
                    asked[name] += tops[name]["lookups"] - before[1]
                store.apply_gradients(name, ids, grads[:len(ids)])
                if b >= warmup:
                    spent[name].append(time.perf_counter() - t0)
                    del t1
    # per table the median step: robust to the bursts of other work on a shared machine
    table_seconds = {n: float(np.median(v)) if v else 0.0 for n, v in spent.items()}
    shutil.rmtree(directory, ignore_errors=True)
    return {"seconds_per_batch": sum(table_seconds.values()), "table_seconds": table_seconds,
            "hit_ratios": {n: hits[n] / asked[n] for n in names if asked[n]}}


def _dram_for_90(profile: dict[str, Any], model: dict[str, Any], total: float,
                 pmem_share: float) -> tuple[float, dict[str, Option], dict[str, int]]:
    """Least DRAM share (of total bytes) whose plan predicts >= 90% of all-DRAM throughput."""
    all_dram = sum(chain_option(t, model, ["dram"], []).seconds
                   for t in profile["tables"].values())
    lo, hi = 1e-4, 1.0
    found = None
    for _ in range(14):  # bisection on the share: predicted time falls as DRAM grows
        mid = (lo * hi) ** 0.5
        budget = {"dram": int(mid * total), "pmem": int(pmem_share * total)}
        chosen = plan(profile, model, budget)
        if all_dram / _seconds(chosen) >= 0.9:
            hi, found = mid, (chosen, budget)
        else:
            lo = mid
    if found is None:
        budget = {"dram": int(total * 1.01), "pmem": int(pmem_share * total)}
        found = (plan(profile, model, budget), budget)
    return hi, found[0], found[1]


def run(args: argparse.Namespace) -> int:
    """Profile, plan, simulate, replay; print and optionally save the report."""
    if args.output is not None:
        check_output(args.output, "-o")  # before minutes of replays, not after
    if args.tables > args.lookups:  # the trace gives every table a lookup a batch
        raise ConfigError(f"--tables {args.tables:,} is more than --lookups {args.lookups:,}: "
                          "each table takes at least one lookup a batch; give fewer tables "
                          "or more lookups")
    policies = [p for p in args.policies.split(",") if p]
    if "clock" not in policies:  # naive_placement's proportional reference runs clock
        raise ConfigError(f"--policies {args.policies!r} has no clock: the proportional "
                          "reference placement caches with clock eviction, so its curve is "
                          "needed; add clock (e.g. clock,wtinylfu:hold_new=1)")
    params = replace(PROFILES["2021"], tables=args.tables, lookups=args.lookups)
    tables = split_tables(list(synthesize(args.batches, seed=args.seed, params=params)))
    profile = build_profile(tables, policies=policies,
                            points=12, warmup=args.warmup, seed=args.seed)
    own = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="embstore-placement-")) if own else args.dir
    directory.mkdir(parents=True, exist_ok=True)
    try:
        if args.tiers is not None:
            model = load_document(args.tiers, "tiers")
        else:
            model = measure_tiers(["dram", "pmem", "rocksdb"], rows=20_000 if args.quick
                                  else 200_000, row_bytes=260, small=64, large=4096,
                                  repeats=3 if args.quick else 9, directory=directory / "tiers")
        report = _evaluate(args, tables, profile, model, directory)
    finally:
        if own:
            shutil.rmtree(directory, ignore_errors=True)
    if args.output is not None:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _evaluate(args: argparse.Namespace, tables: dict[str, list[np.ndarray]],
              profile: dict[str, Any], model: dict[str, Any], directory: Path) -> dict[str, Any]:
    per_row = 260 + float(model["tiers"]["dram"].get("overhead_bytes_per_row", 0.0))
    total = sum(t["rows_touched"] for t in profile["tables"].values()) * per_row
    budget = {"dram": int(args.dram * total), "pmem": int(args.pmem * total)}
    placements = {"plan": plan(profile, model, budget),
                  "proportional": naive_placement(profile, model, budget, "proportional"),
                  "hottest": naive_placement(profile, model, budget, "hottest")}
    report: dict[str, Any] = {"tables": len(tables), "batches": args.batches,
                              "total_bytes": total, "budget": budget, "host": model["host"]}
    warm = profile["warmup_batches"]
    sims = _simulated_hits(tables, placements["plan"], warm, int(profile["step_calls"]))
    print(f"{len(tables)} tables, {args.batches} batches, {total / 2**20:.1f} MiB of rows; "
          f"budget DRAM {args.dram:.1%} + pmem {args.pmem:.1%}")
    measured: dict[str, Any] = {}
    if not args.no_replay:
        for i, (kind, chosen) in enumerate(placements.items()):
            measured[kind] = replay(tables, chosen, budget, directory / f"store{i}", warm)
    print("\n(a) top-tier hit ratio of cached tables: predicted / simulator / store "
          "(simulator on lookups alone)")
    diffs_sim, diffs_store, diffs_lookups = [], [], []
    for name, (pred, sim, sim_lookups) in sims.items():
        real = measured.get("plan", {}).get("hit_ratios", {}).get(name)
        diffs_sim.append(abs(pred - sim))
        diffs_lookups.append(abs(pred - sim_lookups))
        if real is not None:
            diffs_store.append(abs(pred - real))
        print(f"  {name:<6} {pred:.3f} / {sim:.3f} / " + ("-" if real is None else f"{real:.3f}")
              + f"  ({sim_lookups:.3f})")
    report["hit_ratio_error_points"] = {
        "vs_simulator_max": 100 * max(diffs_sim, default=0.0),
        "vs_store_max": 100 * max(diffs_store, default=0.0) if diffs_store else None,
        "vs_lookups_only_simulator_max": 100 * max(diffs_lookups, default=0.0)}
    err = report["hit_ratio_error_points"]
    print(f"  max |predicted - simulator| {err['vs_simulator_max']:.2f} points"
          + (f", |predicted - store| {err['vs_store_max']:.2f} points"
             if diffs_store else "")
          + f"; on lookups alone {err['vs_lookups_only_simulator_max']:.2f} points")
    print("\n(b) time per batch (ms): predicted / measured by replay")
    report["seconds_per_batch"] = {}
    for kind, chosen in placements.items():
        got = measured.get(kind, {}).get("seconds_per_batch")
        report["seconds_per_batch"][kind] = {
            "predicted": _seconds(chosen), "measured": got,
            "tables": {n: {"chain": o.backends, "caps": o.caps, "policies": o.policies,
                           "predicted": o.seconds,
                           "measured": measured.get(kind, {}).get("table_seconds", {}).get(n)}
                       for n, o in chosen.items()}}
        print(f"  {kind:<13} {_seconds(chosen) * 1e3:9.3f} / "
              + ("-" if got is None else f"{got * 1e3:9.3f}"))
    print("\n(c) DRAM share of the table bytes for 90% of all-DRAM throughput (predicted)")
    report["dram_for_90"] = {}
    all_dram = {n: chain_option(t, model, ["dram"], []) for n, t in profile["tables"].items()}
    base = replay(tables, all_dram, {"dram": int(total * 2), "pmem": 0},
                  directory / "all_dram", warm) if not args.no_replay else None
    for pmem_share in sorted({0.0, args.pmem, 1.0}):
        share, chosen, b = _dram_for_90(profile, model, total, pmem_share)
        got = (replay(tables, chosen, b, directory / f"at90_{pmem_share}", warm)
               if not args.no_replay else None)
        entry = {"dram_share": share, "pmem_share": pmem_share,
                 "predicted_ratio": _seconds(all_dram) / _seconds(chosen),
                 "measured_ratio": (base["seconds_per_batch"] / got["seconds_per_batch"]
                                    if got and base else None)}
        report["dram_for_90"][f"pmem={pmem_share}"] = entry
        print(f"  with pmem {pmem_share:.0%}: DRAM {share:.2%} of the bytes (1/{1 / share:.0f}); "
              f"throughput vs all-DRAM predicted {entry['predicted_ratio']:.2f}"
              + ("" if entry["measured_ratio"] is None
                 else f", measured {entry['measured_ratio']:.2f}"))
    return report
