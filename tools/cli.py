"""The `embstore` command: one subcommand per module in embstore.tools.

Each tool module that defines ``register(subparsers)`` adds its subcommand; the parser it adds
sets ``func`` (``args -> int``). Exit codes: 0 success, 2 bad usage or an embstore error (one
line on stderr, never a traceback); `fsck` uses e2fsck's 0 clean, 1 repaired, 4 problems left,
8 could not run.

Example::

    embstore info runs/ctr --json
    embstore fsck runs/ctr --repair
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from embstore.errors import EmbstoreError
from embstore.tools._args import Parser

__all__ = ["main"]

_EPILOG = """examples:
  embstore info runs/ctr                 tables, tiers, rows, bytes and counters
  embstore fsck runs/ctr --repair        check every file and row; repair into a new copy
  embstore compact runs/ctr              give back the space of deleted rows
  embstore export runs/ctr /tmp/ctr.x    a portable copy; `embstore import` reads it back
  embstore migrate runs/ctr --tiers dram:1GiB:lru,rocksdb

`embstore COMMAND --help` describes each command."""


def build_parser(*, benchmarks: bool = True) -> argparse.ArgumentParser:
    """The argument parser with every tool's subcommand.

    Without `benchmarks`, `bench` is listed but its benchmark modules (which import torch)
    are not loaded.
    """
    import embstore.tools as tools_pkg

    parser = Parser(prog="embstore", description=__doc__.splitlines()[0], epilog=_EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(tools_pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name == "cli":
            continue
        module = importlib.import_module(f"embstore.tools.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            if info.name == "bench":
                register(sub, lazy=not benchmarks)
            else:
                register(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]) and return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(benchmarks=bool(argv) and argv[0] == "bench")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error, already printed on one line
        return exc.code if isinstance(exc.code, int) else 2
    where = f"embstore {args.command}"
    try:
        return int(args.func(args))
    except EmbstoreError as exc:
        print(f"{where}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{where}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line, the traceback on request
        if os.environ.get("EMBSTORE_TRACEBACK"):
            raise
        print(f"{where}: internal error: {type(exc).__name__}: {_one_line(exc)} (please "
              "report it; EMBSTORE_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
