"""What every `embstore` subcommand shares: the parser, number readers, progress bars.

`Parser.error` answers a bad invocation with one line and exit 2 (never a traceback);
`amount` reads the sizes and fractions people write (`5%`, `0.05`, `4096` rows, `512MiB`);
`progress` gives a tqdm bar on a terminal and nothing otherwise (or with `--quiet`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from embstore.errors import ConfigError
from embstore.layout import refuse_inside_store
from embstore.spec import parse_bytes

__all__ = ["Amount", "Parser", "add_output_flags", "amount", "bench_size", "check_output",
           "existing_file", "inside_dir", "non_negative_float", "non_negative_int", "one_of",
           "positive_float", "positive_int", "progress", "quick_sizes", "same_file", "some_of",
           "thread_count", "tier_chain", "work_dir"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        """Print `message` as one line naming the command, then exit 2."""
        text = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {text} (see `{self.prog} --help`)\n")

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:
        """Parse like argparse, but let the subcommand that was chosen report leftovers.

        argparse reports arguments no parser took through the top-level parser, so
        `embstore info S --bogus` would name `embstore` and send the user to its help.
        """
        parsed, extras = self.parse_known_args(*args, **kwargs)
        if extras:
            self.subcommand_parser(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        _fill_quick_sizes(self.subcommand_parser(parsed), parsed)
        return parsed

    def subcommand_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost subcommand's parser that `parsed` went through."""
        parser: argparse.ArgumentParser = self
        while True:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            name = getattr(parsed, subs[0].dest, None) if subs else None
            if not subs or name not in subs[0].choices:
                return parser
            parser = subs[0].choices[name]


_LEFT_OUT = object()  # the default of an option whose value --quick may choose


def quick_sizes(parser: argparse.ArgumentParser, **quick: Any) -> None:
    """Give `--quick` its sizes, for the options named by dest.

    Each that the command line leaves out takes its quick value under `--quick` and its
    default otherwise (`Parser.parse_args` fills them in). Sizes given on the command line
    are kept, `--quick` or not (it overrode them, unsaid). Called again for an option, the
    later quick value wins.
    """
    sizes: dict[str, tuple[Any, Any, Any]] = parser.__dict__.setdefault("_quick_sizes", {})
    for action in parser._actions:
        if action.dest in quick:
            default, kind, _ = sizes.get(action.dest, (action.default, action.type, None))
            sizes[action.dest] = (default, kind, quick[action.dest])
            action.default = _LEFT_OUT
    missing = set(quick) - {a.dest for a in parser._actions}
    if missing:
        raise ValueError(f"quick_sizes: no options {sorted(missing)}")  # a bug of the caller


def _fill_quick_sizes(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> None:
    for dest, (default, kind, quick) in parser.__dict__.get("_quick_sizes", {}).items():
        if getattr(parsed, dest, None) is _LEFT_OUT:
            value = quick if getattr(parsed, "quick", False) else default
            # argparse converts string defaults through the option's type; so do we
            setattr(parsed, dest, kind(value) if isinstance(value, str) and callable(kind)
                    else value)


@dataclass(frozen=True)
class Amount:
    """A size as written on the command line: a fraction, a row count or bytes.

    Exactly one field is set.
    """

    fraction: float | None = None
    rows: int | None = None
    nbytes: int | None = None

    def as_rows(self, total: int, row_bytes: int) -> int:
        """Rows meant: a fraction of `total`, a count, or bytes over `row_bytes` (at least 1)."""
        if self.fraction is not None:
            return max(1, round(self.fraction * total))
        if self.rows is not None:
            return self.rows
        assert self.nbytes is not None
        return max(1, self.nbytes // row_bytes)


_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?\s*")


def amount(text: str) -> Amount:
    """Read `5%`, `0.05` (fractions), `4096` (rows) or `512MiB` (bytes).

    Raises:
        argparse.ArgumentTypeError: none of these forms, or not positive.
    """
    t = text.strip()
    try:
        if t.endswith("%"):
            value = float(t[:-1])
            if not 0 < value <= 100:
                raise ValueError
            return Amount(fraction=value / 100)
        if _NUMBER.fullmatch(t):
            value = float(t)
            if value <= 0:
                raise ValueError
            if value < 1:
                return Amount(fraction=value)
            if value != int(value):
                raise ValueError
            return Amount(rows=int(value))
        n = parse_bytes(t)
        if n <= 0:
            raise ValueError
        return Amount(nbytes=n)
    except (ValueError, ConfigError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size: write a fraction (5% or 0.05), a row count (4096) "
            "or bytes (512MiB)") from None


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least {least}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    return _whole(text, 1)


MAX_PROCESSES = 64
PROCESSES_WHY = "each process is a torch trainer on this host"
"""The most local processes a distributed run starts, and why."""


def whole_up_to(most: int, why: str, *, least: int = 1) -> Callable[[str], int]:
    """An argument type: an int from `least` to `most`; `why` says what the bound protects.

    The bound keeps a size that could never run (memory, processes) from reaching numpy or
    the OS as an allocation of terabytes.
    """
    def parse(text: str) -> int:
        value = _whole(text, least)
        if value > most:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {most:,}: {why}")
        return value
    return parse


bench_size = whole_up_to(2**31 - 1, "no table holds more rows, and no run more")
"""A benchmark's size (rows, a batch, repeats, steps): an int from 1 to 2**31 - 1."""
thread_count = whole_up_to(1024, "more threads than a host runs")
"""A count of threads: an int from 1 to 1024."""


def non_negative_int(text: str) -> int:
    """An int >= 0.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    return _whole(text, 0)


def _real(text: str, *, strictly_positive: bool) -> float:
    """A finite float above 0 (`strictly_positive`) or at least 0, else ArgumentTypeError."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if value < 0 or (strictly_positive and value == 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be "
                                         + ("above 0" if strictly_positive else "at least 0"))
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (nan and inf refused with argparse.ArgumentTypeError)."""
    return _real(text, strictly_positive=True)


def non_negative_float(text: str) -> float:
    """A finite float >= 0 (nan and inf refused with argparse.ArgumentTypeError)."""
    return _real(text, strictly_positive=False)


def existing_file(text: str) -> Path:
    """A file that exists and can be read.

    Raises:
        argparse.ArgumentTypeError: no name, no such file, a directory, or unreadable.
    """
    if not text:
        raise argparse.ArgumentTypeError("is empty; give a file name")
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be read (permission denied)")
    return path


def work_dir(text: str) -> Path:
    """A directory to work in: one that exists, or one that can be made (no file in the way).

    Checked when parsing so that a file given as the folder is refused in one line before a
    benchmark starts, instead of by the OSError of the first file made under it.

    Raises:
        argparse.ArgumentTypeError: no name, or the path or one of its parents is not a folder.
    """
    if not text:
        raise argparse.ArgumentTypeError("is empty; give a directory")
    path = Path(text)
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                what = "" if place == path else f" (in {text!r})"
                raise argparse.ArgumentTypeError(f"{str(place)!r}{what} is a file, not a "
                                                 "directory")
            break
    return path


def _known(known: Sequence[str] | Callable[[], Sequence[str]]) -> Sequence[str]:
    return known() if callable(known) else known


def one_of(known: Sequence[str] | Callable[[], Sequence[str]], what: str
           ) -> Callable[[str], str]:
    """An argparse type taking one of the names `known` (or a function giving them).

    A misspelt name is refused when parsing, before any run (a run would only skip it).
    """
    def parse(text: str) -> str:
        names = _known(known)
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose from "
                                             f"{', '.join(names)}")
        return text
    return parse


def some_of(known: Sequence[str] | Callable[[], Sequence[str]], what: str
            ) -> Callable[[str], str]:
    """An argparse type taking a comma-separated list of some of `known`, joined again."""
    def parse(text: str) -> str:
        names = _known(known)
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in names]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown))}; "
                                             f"choose from {', '.join(names)}")
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} names no {what}; choose from "
                                             f"{', '.join(names)}")
        return ",".join(items)
    return parse


def add_output_flags(p: argparse.ArgumentParser, *, json_help: str = "print JSON",
                     quiet: bool = True) -> None:
    """Add `--json` and (with `quiet`) `--quiet` to `p`."""
    p.add_argument("--json", action="store_true", help=json_help)
    if quiet:
        p.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bar (there is none when stderr is not a terminal)")


class _Bar:
    """A progress bar over a known total, or nothing."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: int) -> None:
        """Advance by `n` units."""
        if self._bar is not None:
            self._bar.update(n)

    def describe(self, text: str) -> None:
        """Set the bar's label."""
        if self._bar is not None:
            self._bar.set_description(text)


@contextmanager
def progress(args: argparse.Namespace, total: int | None, unit: str = "rows",
             label: str = "") -> Iterator[_Bar]:
    """A tqdm bar on stderr when it is a terminal and neither --quiet nor --json was given."""
    show = (sys.stderr.isatty() and not getattr(args, "quiet", False)
            and not getattr(args, "json", False))
    bar = None
    if show:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm comes with the torch extra; without it, no bar
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=total, unit=unit, desc=label, file=sys.stderr, leave=False,
                       unit_scale=True)
    try:
        yield _Bar(bar)
    finally:
        if bar is not None:
            bar.close()


def tier_chain(text: str) -> tuple[Any, ...]:
    """Read a tier chain, top first: `dram:512MiB:lru,rocksdb` (backend[:capacity[:eviction]]).

    A capacity is a row count (4096) or a size (512MiB).

    Raises:
        argparse.ArgumentTypeError: not such a chain, or an invalid tier.
    """
    from embstore.spec import TierSpec

    tiers = []
    try:
        for part in text.split(","):
            backend, *rest = part.strip().split(":")
            if not backend or len(rest) > 2:
                raise ConfigError(f"tier {part!r} is not backend[:capacity[:eviction]]")
            cap: int | str | None = None
            if rest and rest[0].strip():
                text_cap = rest[0].strip()
                if _NUMBER.fullmatch(text_cap) and not text_cap.isdigit():
                    # a bare number is rows (below it would be read as bytes): 100.0 is none
                    raise ConfigError(f"capacity {text_cap!r} is no whole row count; write "
                                      "rows (4096) or bytes with a unit (512MiB)")
                cap = int(text_cap) if text_cap.isascii() and text_cap.isdigit() else text_cap
                if isinstance(cap, str):
                    try:
                        parse_bytes(cap)
                    except ConfigError:  # its words offer bytes alone; here a number is rows
                        raise ConfigError(f"cannot read {cap!r} as a size; write rows (4096) "
                                          "or bytes (512MiB)") from None
            eviction = rest[1] if len(rest) > 1 and rest[1] else None
            tiers.append(TierSpec(backend, capacity=cap, eviction=eviction))
    except (ConfigError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as tiers ({exc}); write e.g. dram:512MiB:lru,rocksdb"
        ) from None
    from embstore import registry

    known = set(registry.backend_names())
    for t in tiers:
        if t.backend not in known:
            raise argparse.ArgumentTypeError(
                f"unknown backend {t.backend!r}; choose from {sorted(known)}")
    return tuple(tiers)


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether paths `a` and `b` name one file (links and hard links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they would be
        pass
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):  # a symlink loop: compare the paths as written
        return os.path.abspath(a) == os.path.abspath(b)


def inside_dir(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether `path` (existing or not) lies inside the directory `folder`, links resolved."""
    if not Path(folder).is_dir():
        return False
    try:
        return Path(folder).resolve() in Path(path).resolve().parents
    except (OSError, RuntimeError):  # a symlink loop: compare the paths as written
        return Path(os.path.abspath(folder)) in Path(os.path.abspath(path)).parents


def check_output(path: str | os.PathLike[str], flag: str,
                 inputs: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Refuse an output path before any work: no name, a directory, no such folder, an input.

    Checked up front so that a long run does not end in an error, and so that writing the
    output never replaces one of the files it was computed from.

    Raises:
        ConfigError: `path` is empty, a directory, in a missing folder, one of `inputs`, or
            inside one of them that is a directory (an access log).
    """
    text = os.fspath(path)
    if not text:
        raise ConfigError(f"{flag} is empty; give a file name")
    out = Path(text)
    if out.is_dir():
        raise ConfigError(f"{flag} {text!r} is a directory; give a file name in it")
    if not out.name or text.endswith(os.sep):
        raise ConfigError(f"{flag} {text!r} names no file; give a file name")
    refuse_inside_store(out, "write it beside the store", shown=f"{flag} {text!r}")
    if not out.parent.is_dir():
        if out.parent.exists():  # a file where the folder should be
            raise ConfigError(f"{flag} {text!r}: {str(out.parent)!r} is not a folder")
        raise ConfigError(f"{flag} {text!r}: folder {str(out.parent)!r} does not exist; "
                          "create it first")
    for source in inputs:
        if same_file(out, source):
            raise ConfigError(f"{flag} {text!r} is also an input ({os.fspath(source)!r}); "
                              "write the output to another file")
        if inside_dir(out, source):  # an access log: the file would replace or join its own
            raise ConfigError(f"{flag} {text!r} lies inside the input directory "
                              f"{os.fspath(source)!r}, whose files it would replace or join; "
                              "write the output beside it")
