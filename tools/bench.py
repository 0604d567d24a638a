"""`embstore bench NAME`: benchmarks that quote ratios against a baseline measured in the same run.

Each benchmark lives in a module ``embstore.tools._bench_<name>`` defining
``add_arguments(parser)`` and ``run(args) -> int``; this module finds them by name.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import pkgutil
from collections.abc import Callable

__all__ = ["register"]


def _benchmarks() -> list[str]:
    import embstore.tools as tools_pkg

    return sorted(i.name[len("_bench_"):] for i in pkgutil.iter_modules(tools_pkg.__path__)
                  if i.name.startswith("_bench_"))


def register(sub: argparse._SubParsersAction, *, lazy: bool = True) -> None:
    """Add the `bench` subcommand and, unless `lazy`, one sub-subcommand per benchmark.

    Benchmark modules import heavy libraries (torch), so they are imported only when the
    command line asks for `bench` (`embstore.tools.cli` passes lazy=False then): no other
    command pays for them.
    """
    parser = sub.add_parser("bench", help="run a benchmark against its baseline",
                            epilog="example: embstore bench lookup --quick --json")
    if lazy:
        return
    bench_sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    bench_sub.required = True
    for name in _benchmarks():
        module = importlib.import_module(f"embstore.tools._bench_{name}")
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        quick = any("--quick" in a.option_strings for a in p._actions)
        p.epilog = f"example: embstore bench {name}{' --quick' if quick else ''}"
        if not any("--json" in a.option_strings for a in p._actions):
            p.add_argument("--json", action="store_true",
                           help="print the figures as JSON (tables and the run's log)")
        p.set_defaults(func=_runner(name, module.run))


def _runner(name: str, run: Callable[[argparse.Namespace], int]
            ) -> Callable[[argparse.Namespace], int]:
    """`run`, whose printed figures become one JSON document with --json."""
    def wrapped(args: argparse.Namespace) -> int:
        if not getattr(args, "json", False):
            return run(args)
        from embstore.tools import _benchutil

        _benchutil.TABLES.clear()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = run(args)
        print(json.dumps({"benchmark": name, "exit_code": code,
                          "tables": _benchutil.TABLES,
                          "log": out.getvalue().splitlines()}, indent=2))
        return code
    return wrapped
