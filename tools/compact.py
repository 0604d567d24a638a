"""`embstore compact PATH`: rewrite a store without the space of deleted and overwritten rows.

Every table's store of record is copied, page by page, into a new store beside the old one
(RocksDB: sorted SST files compacted to one level; LMDB: a fresh B-tree with no free pages;
pmem: a slot file sized to its rows), which then replaces the old one with one atomic rename:
a crash at any point leaves the old store or the new one, complete. Prints the bytes before
and after.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from embstore._kept import recover_swap
from embstore._rebuild import read_store, replace_store
from embstore.tools._args import add_output_flags, progress

__all__ = ["register", "store_bytes"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `compact` subcommand."""
    p = sub.add_parser("compact", help="give back the space of deleted rows (crash-safe)",
                       description=__doc__, epilog="example: embstore compact runs/ctr",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="the store's directory")
    add_output_flags(p, json_help="print bytes before and after as JSON")
    p.set_defaults(func=run)


def store_bytes(root: Path) -> int:
    """Bytes of the files under `root` (their sizes, not following links)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def run(args: argparse.Namespace) -> int:
    """Compact the store and print its size before and after."""
    recover_swap(args.path)  # a swap cut short between its renames: the store is put back
    read_store(args.path)  # no store there: say so before measuring the whole tree
    before = store_bytes(args.path)
    with progress(args, None, label="compact") as bar:
        counts = replace_store(args.path, progress=lambda _t, n: bar.update(n))
    after = store_bytes(args.path)
    report = {"path": str(args.path), "bytes_before": before, "bytes_after": after,
              "rows": counts}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        # a small store can grow: a rewrite starts fresh files (RocksDB's log and options,
        # LMDB's first pages) whose fixed size outweighs the deleted rows given back
        change = (f"{100 * (before - after) / before:.0f}% given back" if after <= before
                  else f"grew by {after - before:,}: the fixed size of fresh files outweighs "
                  "the deleted rows")
        print(f"{args.path}: {before:,} -> {after:,} bytes ({change}), "
              f"{sum(counts.values()):,} rows")
    return 0
