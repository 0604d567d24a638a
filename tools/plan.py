"""`embstore plan PROFILE --tiers TIERS --budget dram=8GiB,pmem=64GiB -o placement.json`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    p = sub.add_parser(
        "plan", help="place tables on tiers from a profile, a tier model and budgets",
        description="Give each profiled table a tier chain, cache sizes and eviction policies "
                    "within the budgets so that the predicted time per batch is smallest; "
                    "print the plan and write it as a placement for embstore.open(..., "
                    "placement=).")
    p.add_argument("profile", metavar="PROFILE", type=Path, help="from `embstore profile`")
    p.add_argument("--tiers", required=True, type=Path,
                   help="tier model, from `embstore bench tiers` or written by hand")
    p.add_argument("--budget", required=True,
                   help="bytes per budgeted tier, e.g. dram=8GiB,pmem=64GiB (a number without "
                        "a unit is bytes); rocksdb and lmdb are not limited (rocksdb=unbounded "
                        "is accepted)")
    # a str, not a Path: Path("") is "." and an empty -o must be told apart from a folder
    p.add_argument("-o", "--output", default="placement.json",
                   help="placement to write (default placement.json)")
    p.add_argument("--json", action="store_true", help="print the placement as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from embstore.errors import ConfigError
    from embstore.placement import load_document, save_document

    from ._args import check_output
    from ._plan import describe, parse_budget, plan, to_placement

    check_output(args.output, "-o", [args.profile, args.tiers])
    profile = load_document(args.profile, "profile")
    model = load_document(args.tiers, "tiers")
    row = min(t["row_bytes"] for t in profile["tables"].values())
    budget = parse_budget(args.budget, row, model)
    chosen = plan(profile, model, budget)
    doc = to_placement(chosen, budget)
    try:  # what `embstore.open(placement=...)` will read back, checked before it is written
        load_document(doc, "placement")
    except ConfigError as exc:
        raise ConfigError(f"the plan's figures do not fit a placement ({exc}); check the tier "
                          "model's latencies and the budgets; nothing was written") from None
    save_document(args.output, doc)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(describe(chosen))
        print(f"wrote {args.output}")
    return 0
