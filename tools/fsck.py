"""`embstore fsck PATH [--repair]`: check every file and row of a store, and repair it.

Checks the manifest, each tier's files (pmem headers and records, LMDB's structure, RocksDB's
log and block checksums), every row's checksum, id and values against the table spec, and
row counts against the store's record. `--repair` writes the rows that pass into a new copy,
swaps it in atomically and keeps the old store beside it (`.NAME.fsck-backup-TIME`).

Beside a writer (another process holds the store open for writing) fsck checks what the
writer's last flush left, changes nothing and says so in a note; --repair is refused until the
writer closes the store.

Exit codes (as e2fsck): 0 clean, 1 problems repaired, 4 problems left, 8 fsck could not run.
"""

from __future__ import annotations

import argparse
import json
import sys

from embstore import fsck
from embstore.tools._args import add_output_flags, progress

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `fsck` subcommand."""
    p = sub.add_parser("fsck", help="check a store's files and rows; --repair fixes them",
                       description=__doc__, epilog="example: embstore fsck runs/ctr --repair",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="the store's directory")
    p.add_argument("--repair", action="store_true",
                   help="write a repaired copy (only rows failing their checks are dropped) "
                        "and swap it in; the old store is kept beside it")
    add_output_flags(p, json_help="print the findings and the exit code as JSON")
    p.set_defaults(func=run)


def _line(f: fsck.Finding) -> str:
    where = ", ".join(x for x in (f.file, None if f.offset is None else f"offset {f.offset}",
                                  None if f.id is None else f"id {f.id}") if x)
    what = f"; expected {f.expected}, found {f.found}" if f.expected or f.found else ""
    tag = "note: " if f.note else "repaired: " if f.repaired else ""
    ids = f" (ids {', '.join(map(str, f.ids[:20]))}{', ...' if len(f.ids) > 20 else ''})" \
        if f.ids else ""
    return f"{tag}{f.table or '(store)'}: {f.message}{what}{ids}" + (f" [{where}]" if where
                                                                      else "")


def run(args: argparse.Namespace) -> int:
    """Print each finding; return e2fsck's exit code."""
    with progress(args, None, unit="parts", label="fsck") as bar:
        def step(name: str) -> None:
            bar.describe(f"fsck {name}")
            bar.update(1)
        try:
            findings = fsck.check(args.path, repair=args.repair, progress=step)
        except Exception as exc:  # e2fsck's "could not run", never a traceback
            print(f"embstore fsck: error: fsck could not run: {type(exc).__name__}: "
                  f"{' '.join(str(exc).split())}", file=sys.stderr)
            return 8
    code = fsck.exit_code(findings)
    if args.json:
        print(json.dumps({"path": args.path, "exit_code": code,
                          "findings": [f.to_json() for f in findings]}, indent=2))
        return code
    for f in findings:
        print(_line(f))
    print({0: f"{args.path}: clean", 1: f"{args.path}: every problem repaired",
           4: f"{args.path}: {sum(not f.repaired and not f.note for f in findings)} "
              "problem(s) left",
           8: f"{args.path}: fsck could not run"}[code])
    return code
