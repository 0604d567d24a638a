"""`embstore bench NAME`: benchmarks that quote ratios against a baseline measured in the same run.

Each benchmark lives in a module ``embstore.tools._bench_<name>`` defining
``add_arguments(parser)`` and ``run(args) -> int``; this module finds them by name.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

__all__ = ["register"]


def _benchmarks() -> list[str]:
    import embstore.tools as tools_pkg

    return sorted(i.name[len("_bench_"):] for i in pkgutil.iter_modules(tools_pkg.__path__)
                  if i.name.startswith("_bench_"))


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand and one sub-subcommand per benchmark module."""
    parser = sub.add_parser("bench", help="run a benchmark against its baseline")
    bench_sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    bench_sub.required = True
    for name in _benchmarks():
        module = importlib.import_module(f"embstore.tools._bench_{name}")
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(func=module.run)
