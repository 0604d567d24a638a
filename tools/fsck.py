"""`embstore fsck PATH`: verify every row of a store; exit 1 if anything is wrong."""

from __future__ import annotations

import argparse

from embstore import fsck

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `fsck` subcommand."""
    p = sub.add_parser("fsck", help="verify a store: checksums, ranges, counts (read-only)")
    p.add_argument("path", help="the store's directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print each finding; 0 when there is none, 1 otherwise."""
    findings = fsck.check(args.path)
    for f in findings:
        print(f"{f.table or '(store)'}: {f.message}")
    if not findings:
        print(f"{args.path}: no problems found")
    return 1 if findings else 0
