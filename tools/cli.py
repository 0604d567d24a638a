"""The `embstore` command: one subcommand per module in embstore.tools.

Each tool module that defines ``register(subparsers)`` adds its subcommand; the parser it adds
sets ``func`` (``args -> int``). Exit codes: 0 success, 1 the check or task found a problem,
2 bad usage or an embstore error.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from embstore.errors import EmbstoreError

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every tool's subcommand."""
    import embstore.tools as tools_pkg

    parser = argparse.ArgumentParser(prog="embstore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(tools_pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name == "cli":
            continue
        module = importlib.import_module(f"embstore.tools.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]) and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except EmbstoreError as exc:
        print(f"embstore {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
