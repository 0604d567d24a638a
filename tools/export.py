"""`embstore export PATH OUT`: copy every table to a portable directory (see embstore._export).

OUT holds header.json (specs, tiers, step, row counts, CRC-32s) and per table raw
little-endian files of ids and rows (weights then optimizer state): no pickle, readable with
numpy alone. Streams page by page, so memory stays bounded whatever the table size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from embstore._export import export_store
from embstore.tools._args import add_output_flags, progress

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `export` subcommand."""
    p = sub.add_parser("export", help="write every table to a portable directory",
                       description=__doc__, epilog="example: embstore export runs/ctr /backup/ctr",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="the store's directory")
    p.add_argument("out", type=Path, help="a new directory for the export")
    add_output_flags(p, json_help="print rows per table as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    with progress(args, None, label="export") as bar:
        header = export_store(args.path, args.out, progress=lambda _t, n: bar.update(n))
    rows = {t["spec"]["name"]: t["rows"] for t in header["tables"]}
    if args.json:
        print(json.dumps({"path": str(args.path), "out": str(args.out), "rows": rows}))
    else:
        print(f"exported {sum(rows.values()):,} rows of {len(rows)} table(s) to {args.out}")
    return 0
