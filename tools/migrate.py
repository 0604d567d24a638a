"""`embstore migrate PATH --tiers ... | --placement FILE [--table NAME]`: another tier layout.

Rewrites the store in place with the new chain (for the whole store, or only the tables named
with --table), bit for bit the same rows, then swaps it in with one atomic rename: a crash at
any point leaves the old layout or the new one, complete.

--placement applies a plan written by `embstore plan`: each table gets its planned chain,
cache sizes and policies (the store's default chain stays). Every table moved must be in the
plan and the plan must name only the store's tables; otherwise, or for a tier this machine
cannot open, the command stops before it writes anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from embstore._rebuild import read_store, replace_store
from embstore.errors import ConfigError, UnknownTableError
from embstore.placement import placement_chains
from embstore.tools._args import add_output_flags, progress, tier_chain

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `migrate` subcommand."""
    p = sub.add_parser("migrate", help="move a store to another tier layout (crash-safe)",
                       description=__doc__,
                       epilog="examples: embstore migrate runs/ctr --tiers dram:1GiB:lru,pmem "
                              "--table user\n          embstore migrate runs/ctr --placement "
                              "placement.json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="the store's directory")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--tiers", type=tier_chain,
                       help="the new chain, top first: backend[:capacity[:eviction]],...")
    where.add_argument("--placement", type=Path, metavar="FILE",
                       help="a placement from `embstore plan`: each table its planned chain")
    p.add_argument("--table", action="append", default=None, metavar="NAME",
                   help="move only this table (repeatable); default: the store's chain, or "
                        "every table with --placement")
    add_output_flags(p, json_help="print rows per table as JSON")
    p.set_defaults(func=_run)


def _planned(path: Path, placement: Path, names: list[str], moved: list[str]
             ) -> dict[str, tuple]:
    """The planned chain of each table in `moved`.

    Raises:
        ConfigError: the placement is unreadable, lacks a moved table or places a table the
            store does not have.
    """
    chains = placement_chains(placement)
    foreign = sorted(set(chains) - set(names))
    if foreign:
        raise ConfigError(f"{placement} places tables {foreign} that {path} does not have "
                          f"({names}); plan from a profile of this store's tables")
    missing = [n for n in moved if n not in chains]
    if missing:
        raise ConfigError(f"{placement} has no chain for tables {missing} of {path}; plan "
                          "again from a profile of every table, or move only the planned "
                          "ones with --table")
    return {n: chains[n] for n in moved}


def _run(args: argparse.Namespace) -> int:
    _, specs, tiers = read_store(args.path)
    names = [s.name for s in specs]
    for name in args.table or []:
        if name not in names:
            raise UnknownTableError(name, names)
    if args.placement is not None:
        chains = _planned(args.path, args.placement, names, args.table or names)
        specs = [dataclasses.replace(s, tiers=chains[s.name]) if s.name in chains else s
                 for s in specs]
        default = tiers
    elif args.table:
        specs = [dataclasses.replace(s, tiers=args.tiers) if s.name in args.table else s
                 for s in specs]
        default = tiers
    else:  # the whole store: tables given a chain of their own earlier take this one too
        specs = [dataclasses.replace(s, tiers=None) for s in specs]
        default = args.tiers
    with progress(args, None, label="migrate") as bar:
        rows = replace_store(args.path, default_tiers=default, specs=specs,
                             progress=lambda _t, n: bar.update(n))
    if args.json:
        print(json.dumps({"path": str(args.path), "rows": rows}))
    else:
        print(f"migrated {sum(rows.values()):,} rows of {len(rows)} table(s) in {args.path}")
    return 0
