"""`embstore import EXPORT PATH [--tiers ...]`: create a store from an export, any tier layout.

Reads what `embstore export` wrote (checking its CRC-32s) into a new store at PATH, with the
exported tier chain or the one given by --tiers (top first, backend[:capacity[:eviction]]).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from embstore._export import import_store
from embstore.tools._args import add_output_flags, progress, tier_chain

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `import` subcommand."""
    p = sub.add_parser("import", help="create a store from an export (any tier layout)",
                       description=__doc__,
                       epilog="example: embstore import /backup/ctr runs/ctr2 --tiers "
                              "dram:1GiB:lru,lmdb",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, metavar="EXPORT", help="the export directory")
    p.add_argument("path", type=Path, help="a new directory for the store")
    p.add_argument("--tiers", type=tier_chain, default=None,
                   help="the new store's tier chain, e.g. dram:512MiB:lru,rocksdb (default: "
                        "the exported one)")
    add_output_flags(p, json_help="print rows per table as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    with progress(args, None, label="import") as bar:
        rows = import_store(args.src, args.path, tiers=args.tiers,
                            progress=lambda _t, n: bar.update(n))
    if args.json:
        print(json.dumps({"out": str(args.src), "path": str(args.path), "rows": rows}))
    else:
        print(f"imported {sum(rows.values()):,} rows of {len(rows)} table(s) into {args.path}")
    return 0
