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
import select
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TextIO

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


def build_parser(*, benchmarks: bool = True) -> Parser:
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
    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        # the reason and the file in words: "[Errno 2]" means nothing to the reader
        files = [os.fsdecode(f) for f in (exc.filename, exc.filename2)
                 if isinstance(f, (str, bytes))]
        text = exc.strerror + (f": {' -> '.join(files)}" if files else "")
    return " ".join(text.split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]) and return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Named before parsing, so that a Ctrl-C while the parser imports torch names it too.
    where = "embstore" + (f" {argv[0]}" if argv and not argv[0].startswith("-") else "")
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()


def _run(argv: list[str]) -> int:
    parser = build_parser(benchmarks=bool(argv) and argv[0] == "bench")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error, already printed on one line
        return exc.code if isinstance(exc.code, int) else 2
    # the innermost subcommand: `embstore bench lookup`, not `embstore bench`
    where = parser.subcommand_parser(args).prog
    with warnings.catch_warnings():
        warnings.showwarning = _warning_printer(where)
        return _call(args, where)


def _warning_printer(where: str) -> Callable[..., None]:
    """A `warnings.showwarning` that prints one line, as errors are: no file, line or source."""
    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        text = " ".join(str(message).split()) or category.__name__
        print(f"{where}: warning: {text}", file=sys.stderr if file is None else file)
    return show


def _call(args: argparse.Namespace, where: str) -> int:
    try:
        code = int(args.func(args))
        # what is still buffered goes now, so a closed pipe is seen here and not at exit
        sys.stdout.flush()
        return code
    except BrokenPipeError as exc:
        if _stdout_gone():
            raise
        # a pipe to a worker process broke: a failure to report, not a reader that left
        print(f"{where}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except EmbstoreError as exc:
        print(f"{where}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{where}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # sizes past this machine: numpy's words name no flag
        print(f"{where}: error: not enough memory ({_one_line(exc) or 'an allocation failed'}); "
              "give smaller sizes", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: still one line, the traceback on request
        if os.environ.get("EMBSTORE_TRACEBACK"):
            raise
        print(f"{where}: internal error: {type(exc).__name__}: {_one_line(exc)} (please "
              "report it; EMBSTORE_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 2


SIGPIPE_EXIT = 128 + 13
"""The status a shell reports for a tool killed by SIGPIPE, as `cat` and `grep` end."""


def _stdout_gone() -> bool:
    """Whether nothing reads stdout any more (a pipe whose reader exited)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (OSError, ValueError, AttributeError):  # no poll, or stdout is no file
        return True
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events)


def _stdout_closed() -> int:
    """End quietly after the reader of stdout went away (`embstore info S | head -1`).

    stdout is pointed at /dev/null first: the interpreter flushes it once more at exit and
    would otherwise print a second BrokenPipeError as it shuts down.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (a test's capture): nothing to redirect
        pass
    return SIGPIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
