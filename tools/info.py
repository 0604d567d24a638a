"""`embstore info PATH`: the tables, tiers, rows, bytes and cumulative counters of a store.

The counters (lookups, hits, misses, evictions, write-backs, ...) are those of every session
up to the last close, which the store keeps in STATS.json. Exits 2 where a table's medium lost
rows it held (a removed file, say), after the description.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import embstore
from embstore.tools._args import add_output_flags

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `info` subcommand."""
    p = sub.add_parser("info", help="describe a store: tables, tiers, rows, bytes, counters",
                       description=__doc__, epilog="example: embstore info runs/ctr --json")
    p.add_argument("path", help="the store's directory")
    add_output_flags(p, json_help="print JSON instead of text", quiet=False)
    p.set_defaults(func=run)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _when(t: float | None) -> str:
    return "never" if t is None else time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _print_text(info: dict[str, Any]) -> None:
    print(f"store {info['path']}")
    ckpt = info.get("last_checkpoint")
    print(f"last flush {_when(info.get('last_flush'))}; last close "
          f"{_when(info.get('last_close'))}; last checkpoint "
          + ("none" if not ckpt else f"{ckpt['path']} (step {ckpt['step']}) at "
             f"{_when(ckpt['time'])}"))
    for name, t in info["tables"].items():
        spec = t["spec"]
        print(f"table {name}: dim {spec['dim']} {spec['dtype']}, optimizer "
              f"{spec['optimizer']['name']}, init {spec['init']['name']}; "
              f"{t['rows']:,} rows, {_size(t['bytes'])}"
              + (f"; {t['lost_rows']:,} rows lost" if t["lost_rows"] else ""))
        for tier in t["tiers"]:
            rows = tier["capacity_rows"]
            cap = "unbounded" if rows is None else f"{rows:,} rows"
            extra = {k: v for k, v in tier["medium"].items()
                     if k not in ("backend", "rows", "bytes")}
            policy = f", eviction {tier['eviction']}" if tier["eviction"] else ""
            if tier.get("stand_in"):  # a cache with files of its own, which info leaves shut
                print(f"  tier {tier['level']} {tier['backend']} ({cap}{policy}): a cache; "
                      "its files are not opened by a read-only open")
            else:
                print(f"  tier {tier['level']} {tier['backend']} ({cap}{policy}): "
                      f"{tier['rows']:,} rows, {_size(tier['bytes'])}"
                      + (f"; {', '.join(f'{k}={v}' for k, v in extra.items())}"
                         if extra else ""))
            c = tier["cumulative"]
            print(f"    lookups {c['lookups']:,}, hits {c['hits']:,}, misses {c['misses']:,}, "
                  f"evictions {c['evictions']:,}, write-backs {c['writebacks']:,} "
                  "(all sessions to the last close)")


def run(args: argparse.Namespace) -> int:
    """Open the store read-only and print its description."""
    with embstore.open(args.path, read_only=True) as store:
        info = store.describe()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_text(info)
    lost = {name: t["lost_rows"] for name, t in info["tables"].items() if t["lost_rows"]}
    if lost:
        print("embstore info: error: the medium lost rows the store wrote ("
              + ", ".join(f"table {name}: {n:,}" for name, n in lost.items())
              + f"); `embstore fsck {args.path}` lists them", file=sys.stderr)
        return 2
    return 0
