"""`embstore migrate PATH --tiers ... [--table NAME]`: move a store to another tier layout.

Rewrites the store in place with the new chain (for the whole store, or only the tables named
with --table), bit for bit the same rows, then swaps it in with one atomic rename: a crash at
any point leaves the old layout or the new one, complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from embstore._rebuild import read_store, replace_store
from embstore.errors import UnknownTableError
from embstore.tools._args import add_output_flags, progress, tier_chain

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `migrate` subcommand."""
    p = sub.add_parser("migrate", help="move a store to another tier layout (crash-safe)",
                       description=__doc__,
                       epilog="example: embstore migrate runs/ctr --tiers dram:1GiB:lru,pmem "
                              "--table user",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="the store's directory")
    p.add_argument("--tiers", type=tier_chain, required=True,
                   help="the new chain, top first: backend[:capacity[:eviction]],...")
    p.add_argument("--table", action="append", default=None, metavar="NAME",
                   help="move only this table (repeatable); default: the store's chain")
    add_output_flags(p, json_help="print rows per table as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    _, specs, tiers = read_store(args.path)
    names = [s.name for s in specs]
    if args.table:
        for name in args.table:
            if name not in names:
                raise UnknownTableError(name, names)
        specs = [dataclasses.replace(s, tiers=args.tiers) if s.name in args.table else s
                 for s in specs]
        default = tiers
    else:
        default = args.tiers
    with progress(args, None, label="migrate") as bar:
        rows = replace_store(args.path, default_tiers=default, specs=specs,
                             progress=lambda _t, n: bar.update(n))
    if args.json:
        print(json.dumps({"path": str(args.path), "rows": rows}))
    else:
        print(f"migrated {sum(rows.values()):,} rows of {len(rows)} table(s) in {args.path}")
    return 0
