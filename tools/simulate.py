"""`embstore simulate TRACE`: miss ratios of policy pairs beside Belady's MIN."""

from __future__ import annotations

import argparse
import json
from typing import Any

from embstore.errors import ConfigError
from embstore.tools._args import Amount, amount, non_negative_int, positive_int

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `simulate` subcommand."""
    p = sub.add_parser(
        "simulate", help="replay an id trace through eviction x admission policies",
        epilog="example: embstore simulate trace.npy --policy lru,lfu --capacity 1%,5%",
        description="Replay TRACE batch by batch through a cache of each capacity run by every "
                    "eviction x admission pair; print miss ratios (per distinct id per batch) "
                    "beside Belady's MIN and an infinite cache, and for a synth: trace a "
                    "cache that knows each id's true popularity (the oracle: about the best "
                    "a policy that does not see the future can do).")
    p.add_argument("trace", metavar="TRACE",
                   help="a .npy (2-D: a batch per row; 1-D: cut by --batch-size), a .npz with "
                        "'ids' and 'offsets', or synth:key=value,... (e.g. "
                        "synth:seed=1,batches=20,profile=2021) for "
                        "embstore.tools.traces.synthesize")
    p.add_argument("--policy", default="lru", help="eviction specs, comma-separated; "
                   "settings as name:key=value:key=value (default: lru)")
    p.add_argument("--admission", default="always",
                   help="admission specs, comma-separated (default: always)")
    p.add_argument("--capacity", default="0.01,0.05,0.1", type=_capacities,
                   help="cache sizes, comma-separated: fractions of the distinct ids (5%% or "
                        "0.05), id counts (4096) or bytes (512MiB, over --row-bytes) "
                        "(default: 0.01,0.05,0.1)")
    p.add_argument("--row-bytes", type=positive_int, default=256,
                   help="bytes per row, to turn a --capacity in bytes into ids (default: 256, "
                        "a dim-64 float32 row)")
    p.add_argument("--batch-size", type=positive_int, default=4096,
                   help="batch length for a 1-D .npy trace (default: 4096)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed handed to every policy")
    p.add_argument("--exact-lfu", action="store_true",
                   help="also replay a cache that counts every id's reads exactly, with the "
                        "best of several half-lives: what a frequency policy could reach "
                        "with a perfect estimate (about 10 s per capacity on a trace of 2M "
                        "accesses)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from embstore.tools.simulator import load_trace, simulate_trace

    if args.seed >= 2**63:  # policies take an int64 seed: not theirs to blame
        raise ConfigError(f"--seed {args.seed}: the seed must be an integer >= 0 and < 2**63")
    policies = [s for s in args.policy.split(",") if s.strip()]
    admissions = [s for s in args.admission.split(",") if s.strip()]
    for flag, specs in (("--policy", policies), ("--admission", admissions)):
        if not specs:  # nothing would be simulated, and exit 0 would say all went well
            raise ConfigError(f"{flag} names no policy; give at least one, e.g. lru")
    for c in args.capacity:
        if c.nbytes is not None and c.nbytes < args.row_bytes:  # as --tiers dram:1B is refused
            raise ConfigError(f"--capacity of {c.nbytes} bytes holds no row of {args.row_bytes} "
                              "bytes (--row-bytes); raise it")
    trace = load_trace(args.trace, batch_size=args.batch_size)
    if not trace.lookups:  # every ratio would be 0/0, printed as a perfect cache
        raise ConfigError(f"trace {args.trace!r} holds no ids; nothing to simulate")
    distinct = max(1, int(trace.distinct))
    capacities = [c.fraction if c.fraction is not None and c.fraction < 1
                  else float(c.as_rows(distinct, args.row_bytes)) for c in args.capacity]
    report = simulate_trace(trace, policies, admissions, capacities, seed=args.seed)
    if args.exact_lfu:
        from embstore.tools._frequency_bound import add_exact_lfu

        add_exact_lfu(report, trace)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report))
    return 0


def _capacities(text: str) -> list[Amount]:
    return [amount(part) for part in text.split(",")]


def _table(report: dict[str, Any]) -> str:
    inf = report["infinite"]
    lines = [f"{report['batches']} batches, {report['accesses']} accesses, "
             f"{report['lookups']} lookups (distinct per batch), {report['distinct']} ids",
             f"infinite cache: miss ratio {inf['miss_ratio']:.4f} (compulsory misses only)"]
    header = f"{'capacity':>10} {'eviction':<16} {'admission':<16} {'miss':>7} {'hit':>7} " \
             f"{'x MIN':>6} {'seconds':>8}"
    for cap in report["capacities"]:
        best = cap["belady"]
        lines += ["", header,
                  f"{cap['capacity']:>10} {'belady (MIN)':<16} {'-':<16} "
                  f"{best['miss_ratio']:>7.4f} {best['hit_ratio']:>7.4f} {1.0:>6.3f} "
                  f"{best['seconds']:>8.2f}"]
        oracle = cap.get("oracle")
        if oracle is not None:  # a synthetic trace: about the best an online policy can do
            lines.append(f"{cap['capacity']:>10} {'oracle':<16} {'(popularity)':<16} "
                         f"{oracle['miss_ratio']:>7.4f} {oracle['hit_ratio']:>7.4f} "
                         f"{oracle['miss_vs_belady']:>6.3f} {oracle['seconds']:>8.2f}")
        counted = cap.get("exact_lfu")
        if counted is not None:  # asked for: the best a perfect frequency estimate reached
            half_life = counted["half_life"]
            aging = "(no aging)" if half_life is None else f"(half-life {half_life:g})"
            lines.append(f"{cap['capacity']:>10} {'exact-lfu':<16} {aging:<16} "
                         f"{counted['miss_ratio']:>7.4f} {counted['hit_ratio']:>7.4f} "
                         f"{counted['miss_vs_belady']:>6.3f} {counted['seconds']:>8.2f}")
        for row in sorted(cap["policies"], key=lambda r: r["misses"]):
            lines.append(f"{cap['capacity']:>10} {row['eviction']:<16} {row['admission']:<16} "
                         f"{row['miss_ratio']:>7.4f} {row['hit_ratio']:>7.4f} "
                         f"{row['miss_vs_belady']:>6.3f} {row['seconds']:>8.2f}")
    return "\n".join(lines)
