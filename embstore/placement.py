"""Placement files: versioned JSON for table profiles, tier models and placements.

Three documents, each a JSON object with ``"format"`` and ``"version"`` keys:

``embstore.profile`` v1 (written by ``embstore profile``)::

    {"format": "embstore.profile", "version": 1, "trace": str, "batches": int,
     "samples_per_batch": int, "policies": [eviction specs with a curve],
     "tables": {name: {
        "rows_touched": int,           # distinct ids in the trace
        "lookups_per_batch": float,    # ids per batch, duplicates included
        "distinct_per_batch": float,   # what reaches a tier: distinct ids per batch
        "lookups_per_sample": float, "row_bytes": int,
        "bytes_per_sample": float,     # bandwidth demand: lookups_per_sample x row_bytes
        "method": "exact" | "shards", "sample_rate": float,
        "error_bound": float | null,   # null: too few sampled ids for the tested bound
        "recorded_rate": float,        # only for an access log that sampled its ids
        "sampled_ids": int,            # (likewise) distinct ids the log kept
        "reuse": {"edges": [ids], "lookups": [share per log2 bin], "cold": share},
        "mrc": {"capacities": [ids, increasing], "<policy>": [miss ratio per capacity]}}}}

``embstore.tiers`` v1 (written by ``embstore bench tiers``, or by hand)::

    {"format": "embstore.tiers", "version": 1, "host": str, "row_bytes": int,
     "tiers": {"dram" | "pmem" | "rocksdb" | "lmdb": {
        "read":  {"bytes_per_s": float, "batch_latency_s": float},
        "write": {"bytes_per_s": float, "batch_latency_s": float},
        "overhead_bytes_per_row": float, "note": str}}}

``embstore.placement`` v1 (written by ``embstore plan``)::

    {"format": "embstore.placement", "version": 1, "budget": {tier: bytes},
     "predicted_seconds_per_batch": float,
     "tables": {name: {"tiers": [TierSpec JSON, top first], "policy": str,
                        "cache_rows": [rows per cache tier], "hit_ratios": [per tier],
                        "seconds_per_batch": float, "bytes": {tier: bytes}}}}

`load_document` checks the format, version (an int), and the fields the planner and `open`
use and a placement's figures (every number finite and within its range, table names as
`TableSpec` takes them, the file UTF-8 JSON, a profile's distinct ids per batch no more
than its lookups per batch and rows; a placement's figures beside its chains are optional,
as `open` needs only the chains), and raises `ConfigError` naming the file, the
field and the fix; `apply_placement` gives table specs their planned chains
(``embstore.open(..., placement=path)``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import registry
from ._private_dir import temporary_beside
from .errors import ConfigError, StorageIOError
from .errors import brief as _short
from .spec import TABLE_NAME_RULE, TableSpec, TierSpec, is_table_name

__all__ = ["KNOWN_TIERS", "apply_placement", "load_document", "placement_chains",
           "save_document"]

KNOWN_TIERS = ("dram", "pmem", "rocksdb", "lmdb")
"""Tier (backend) names a tier model or placement may use."""
MAX_NUMBER = 2**53
"""The largest number a document's field may hold (JSON's largest exact integer): products
and sums of a few such figures stay finite floats, so no planner figure overflows."""
_VERSIONS = {"embstore.profile": 1, "embstore.tiers": 1, "embstore.placement": 1}
_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM,
                errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP}
"""Write failures that come from the path given, not the medium: a ConfigError to fix."""


def save_document(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write `doc` as indented JSON, atomically (a temporary file renamed over `path`).

    Raises:
        ConfigError: `path` names no file (empty, or a directory), cannot be written there (no
            such folder, no permission, a read-only file system), or `doc` holds NaN or an
            infinity (JSON has neither, and readers would refuse the file); nothing is written.
        StorageIOError: the medium failed the write (a full disk, EIO); nothing is written.
    """
    path = Path(path)
    if not path.name or path.is_dir():
        raise ConfigError(f"cannot write {str(path)!r}: give a file name, not a directory")
    try:
        text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
    except ValueError as exc:  # a NaN or infinity slipped through: refuse, never write it
        raise ConfigError(f"not writing {str(path)!r}: the document holds NaN or an infinity, "
                          "which JSON cannot hold (a bug: please report it)") from exc
    tmp = temporary_beside(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # a failed write leaves no stray temporary file
            tmp.unlink()
        if not isinstance(exc, OSError):
            raise
        # said of the path asked for: the temporary file is ours, not the caller's
        message = f"cannot write {str(path)!r}: {exc.strerror or exc}"
        if exc.errno in _PATH_ERRNOS:
            raise ConfigError(message) from None
        raise StorageIOError(exc.errno, message) from None


def load_document(source: str | os.PathLike[str] | dict[str, Any], kind: str) -> dict[str, Any]:
    """Read and check a profile, tier model or placement document.

    `kind` is "profile", "tiers" or "placement"; `source` a path or an already parsed dict.

    Raises:
        ConfigError: unreadable file, wrong format or version, or a missing or bad field.
    """
    fmt = f"embstore.{kind}"
    if fmt not in _VERSIONS:
        raise ConfigError(f"unknown document kind {kind!r}; expected profile, tiers or placement")
    where = "the given dict"
    if isinstance(source, dict):
        doc = source
    elif not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"a {kind} is a path to its JSON file or an already parsed dict, "
                          f"got {type(source).__name__} {source!r}")
    else:
        where = str(source)
        try:
            data = Path(source).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {kind} {where!r}: {exc.strerror or exc}") from exc
        doc = _parse_json(data, f"{kind} {where!r}", kind)
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(f"{where!r} is not an {fmt} document (format {got!r}); give the "
                          f"file written by `embstore {_MAKER[kind]}`")
    version = doc.get("version")
    # an int, not 1.0 or true: both equal 1 in Python, and no writer of this format emits them
    if isinstance(version, bool) or not isinstance(version, int) or version != _VERSIONS[fmt]:
        raise ConfigError(f"{where!r}: {fmt} version {doc.get('version')!r} is not supported "
                          f"(this embstore reads version {_VERSIONS[fmt]})")
    _CHECKS[kind](doc, where)
    return doc


_MAKER = {"profile": "profile", "tiers": "bench tiers", "placement": "plan"}


def _parse_json(data: bytes, what: str, kind: str) -> Any:
    """The JSON value in `data`, or a ConfigError saying in our words why there is none.

    json's and the codec's own messages ("Expecting value", "invalid start byte") mean
    little to someone who gave the wrong file: say what is wrong and where instead.
    """
    fix = f"give the file written by `embstore {_MAKER[kind]}`"
    if not data.strip():
        raise ConfigError(f"{what} is not a JSON document: the file is empty; {fix}")
    try:
        text = data.decode("utf-8-sig")  # a BOM some editors add is no error
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not a JSON document: byte {exc.start} (0x"
                          f"{data[exc.start]:02x}) is not UTF-8 text; {fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not a JSON document: malformed at line {exc.lineno} "
                          f"column {exc.colno}; {fix}") from None
    except (ValueError, RecursionError):  # an over-long number or nesting too deep
        raise ConfigError(f"{what} is not a JSON document this reader can take (a number "
                          f"too long or nesting too deep); {fix}") from None


def _need(obj: Any, key: str, types: type | tuple[type, ...], where: str, what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ConfigError(f"{where!r}: {what} lacks {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, types):
        raise ConfigError(f"{where!r}: {what}.{key} must be {_names(types)}, got {value!r}")
    return value


def _names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def _number(obj: dict[str, Any], key: str, where: str, what: str, *, least: float = 0.0,
            above: bool = False, most: float | None = None, whole: bool = False,
            optional: bool = False) -> Any:
    """`obj[key]`, checked to be a finite number (an int if `whole`) within its range.

    The range is [least, most], or (least, most] when `above`, `most` being `MAX_NUMBER`
    unless given; an `optional` key may be absent (None is returned). NaN, infinities and
    huge numbers, which Python's json reads, are refused here: they would otherwise reach
    the planner's arithmetic and come out as "nan" figures or overflow a float.
    """
    if not isinstance(obj, dict) or key not in obj:
        if optional:
            return None
        raise ConfigError(f"{where!r}: {what} lacks {key!r}")
    value = obj[key]
    most = MAX_NUMBER if most is None else most
    low = f"> {least:g}" if above else f">= {least:g}"
    high = "2**53" if most == MAX_NUMBER else f"{most:g}"
    want = f"{'a whole number' if whole else 'a finite number'} {low} and <= {high}"
    if (not _is_number(value) or (whole and not isinstance(value, int)) or value < least
            or (above and value == least) or value > most):
        shown = repr(value)  # a huge number is cut short: the message stays one line
        shown = shown if len(shown) <= 40 else f"{shown[:37]}..."
        raise ConfigError(f"{where!r}: {what}.{key} must be {want}, got {shown}")
    return value


def _check_profile(doc: dict[str, Any], where: str) -> None:
    for key, least in (("batches", 0), ("warmup_batches", 0), ("samples_per_batch", 1),
                       ("step_calls", 1)):
        _number(doc, key, where, "the profile", least=least, whole=True, optional=True)
    tables = _need(doc, "tables", dict, where, "the profile")
    if not tables:
        raise ConfigError(f"{where!r}: the profile has no tables; profile a trace that has ids")
    for name, t in tables.items():
        _check_table_name(name, where, "profile")
        what = f"table {name!r}"
        for key in ("rows_touched", "row_bytes"):
            _number(t, key, where, what, least=1, whole=True)
        for key in ("distinct_per_batch", "lookups_per_sample", "bytes_per_sample"):
            _number(t, key, where, what)
        _number(t, "lookups_per_batch", where, what, optional=True)
        # no batch reaches more distinct rows than it looks up, nor than its table has (a
        # sampled log's estimates keep both: its row count is rounded to the nearest)
        distinct, rows = t["distinct_per_batch"], t["rows_touched"]
        for most, of in ((t.get("lookups_per_batch"), "its lookups_per_batch"),
                         (rows + 0.5, f"the {rows} rows it touches (rows_touched)")):
            if most is not None and distinct > most:
                raise ConfigError(f"{where!r}: {what}.distinct_per_batch is {_short(distinct)}, "
                                  f"more than {of}: the figures contradict each other; "
                                  "profile the trace again")
        _number(t, "sampled_ids", where, what, whole=True, optional=True)
        for key in ("sample_rate", "recorded_rate"):
            _number(t, key, where, what, above=True, most=1, optional=True)
        if t.get("error_bound") is not None:  # null: too few sampled ids for a bound
            _number(t, "error_bound", where, what)
        if "reuse" in t:
            _check_reuse(t["reuse"], where, f"{what}.reuse")
        mrc = _need(t, "mrc", dict, where, what)
        caps = _need(mrc, "capacities", list, where, f"{what}.mrc")
        curves = [k for k in mrc if k != "capacities"]
        if not caps or not curves:
            raise ConfigError(f"{where!r}: {what}.mrc needs capacities and at least one curve")
        # capacities become cache sizes (whole rows) and are interpolated in log C
        if not all(isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= MAX_NUMBER
                   for c in caps):
            raise ConfigError(f"{where!r}: {what}.mrc.capacities must be whole row counts "
                              ">= 1 and <= 2**53")
        if any(b <= a for a, b in zip(caps, caps[1:], strict=False)):
            raise ConfigError(f"{where!r}: {what}.mrc.capacities must increase")
        for k in curves:
            curve = mrc[k]
            if not isinstance(curve, list) or len(curve) != len(caps) or not all(
                    _is_number(v) and 0 <= v <= 1 for v in curve):
                raise ConfigError(f"{where!r}: {what}.mrc.{k} must be {len(caps)} miss ratios "
                                  "in [0, 1], one per capacity")


def _is_number(value: Any) -> bool:
    """A finite int or float (no bool; math.isfinite would overflow on a huge int)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and math.isfinite(value))


def _check_reuse(reuse: Any, where: str, what: str) -> None:
    """A reuse histogram: finite bin edges and shares of lookups in [0, 1]."""
    if not isinstance(reuse, dict):
        raise ConfigError(f"{where!r}: {what} must be an object, got {reuse!r}")
    _number(reuse, "cold", where, what, most=1, optional=True)
    for key, most in (("edges", None), ("lookups", 1.0)):
        values = reuse.get(key, [])
        if not isinstance(values, list) or not all(
                _is_number(v) and v >= 0
                and (most is None or v <= most) for v in values):
            bound = "in [0, 1]" if most is not None else "finite and >= 0"
            raise ConfigError(f"{where!r}: {what}.{key} must be a list of numbers {bound}")


def _check_tiers(doc: dict[str, Any], where: str) -> None:
    _number(doc, "row_bytes", where, "the tier model", least=1, whole=True, optional=True)
    tiers = _need(doc, "tiers", dict, where, "the tier model")
    if not tiers:
        raise ConfigError(f"{where!r}: the tier model lists no tiers")
    for name, t in tiers.items():
        if name not in KNOWN_TIERS:
            raise ConfigError(f"{where!r}: unknown tier {name!r}; known: {list(KNOWN_TIERS)}")
        for op in ("read", "write"):
            o = _need(t, op, dict, where, f"tier {name!r}")
            # at least a byte a second: a throughput nearer 0 makes a batch last forever
            # (a divisor: a huge one is harmless, and a fit of two close timings makes one)
            _number(o, "bytes_per_s", where, f"tier {name!r}.{op}", least=1, most=1e30)
            _number(o, "batch_latency_s", where, f"tier {name!r}.{op}")
        # bytes a row costs beyond its own: none is fine, fewer than none is not
        _number(t, "overhead_bytes_per_row", where, f"tier {name!r}", optional=True)


def _check_placement(doc: dict[str, Any], where: str) -> None:
    _check_tier_bytes(doc, "budget", where, "the placement's budget", whole=True)
    _number(doc, "predicted_seconds_per_batch", where, "the placement", optional=True)
    tables = _need(doc, "tables", dict, where, "the placement")
    if not tables:
        raise ConfigError(f"{where!r}: the placement places no table; plan from a profile of "
                          "the store's tables")
    for name, t in tables.items():
        _check_table_name(name, where, "placement")
        what = f"table {name!r}"
        if not isinstance(t, dict):
            raise ConfigError(f"{where!r}: {what} must be an object with its 'tiers', got "
                              f"{_short(t)}")
        chain = _need(t, "tiers", list, where, what)
        if not chain:
            raise ConfigError(f"{where!r}: table {name!r} has an empty tier chain")
        for i, tier in enumerate(chain):
            if not isinstance(tier, dict):
                raise ConfigError(f"{where!r}: {what}.tiers[{i}] must be an object (a TierSpec's "
                                  f"JSON, e.g. {{\"backend\": \"rocksdb\"}}), got {_short(tier)}")
            backend = tier.get("backend")
            if backend not in KNOWN_TIERS:
                raise ConfigError(f"{where!r}: table {name!r} uses unknown tier {backend!r}; "
                                  f"known: {list(KNOWN_TIERS)}")
            try:
                TierSpec.from_json(tier)
            except (TypeError, ConfigError) as exc:
                raise ConfigError(f"{where!r}: table {name!r}: bad tier {tier!r}: {exc}") from exc
        _check_placed_figures(t, len(chain), where, what)


def _check_placed_figures(t: dict[str, Any], tiers: int, where: str, what: str) -> None:
    """The planner's figures of one placed table, each optional: `open` needs only the chain.

    Present, they must be what `embstore plan` writes: an eviction policy spec or null, a
    cache size per cache tier, a hit ratio per tier, finite seconds and bytes.
    """
    policy = t.get("policy")
    if policy is not None and (not isinstance(policy, str) or policy.split(":")[0]
                               not in registry.policy_names("eviction")):
        raise ConfigError(f"{where!r}: {what}.policy must be an eviction policy spec (one of "
                          f"{registry.policy_names('eviction')}) or null, got {_short(policy)}")
    for key, count, whole in (("cache_rows", tiers - 1, True), ("hit_ratios", tiers, False)):
        if key not in t:
            continue
        values = t[key]
        if not isinstance(values, list) or len(values) != count:
            each = "a row count per cache tier" if whole else "a hit ratio per tier"
            raise ConfigError(f"{where!r}: {what}.{key} must be a list of {each} ({count} for "
                              f"its chain of {tiers}), got {_short(values)}")
        # a level's share of hits may be below 0 in plans of earlier versions, which let a
        # lower cache miss more than the one above where a curve rose between profiled sizes
        low, high = (1, MAX_NUMBER) if whole else (-1, 1)
        for i, v in enumerate(values):
            if not _is_number(v) or (whole and not isinstance(v, int)) or not low <= v <= high:
                want = "whole row counts >= 1 and <= 2**53" if whole else "ratios in [-1, 1]"
                raise ConfigError(f"{where!r}: {what}.{key}[{i}] must be {want}, got "
                                  f"{_short(v)}")
    _number(t, "seconds_per_batch", where, what, optional=True)
    _check_tier_bytes(t, "bytes", where, f"{what}.bytes", whole=False)


def _check_tier_bytes(doc: dict[str, Any], key: str, where: str, label: str, *,
                      whole: bool) -> None:
    """`doc[key]` (`label` in messages), if present: an object of known tier to bytes."""
    given = doc.get(key, {})
    if not isinstance(given, dict) or not set(given) <= set(KNOWN_TIERS):
        raise ConfigError(f"{where!r}: {label} must be an object of tier "
                          f"({list(KNOWN_TIERS)}) to bytes, got {_short(given)}")
    for tier in given:
        _number(given, tier, where, label, whole=whole)


def _check_table_name(name: str, where: str, kind: str) -> None:
    if not is_table_name(name):  # a table's name makes file names
        raise ConfigError(f"{where!r}: the {kind} names table {_short(name)}, which is no "
                          f"table name ({TABLE_NAME_RULE})")


_CHECKS = {"profile": _check_profile, "tiers": _check_tiers, "placement": _check_placement}


def placement_chains(source: str | os.PathLike[str] | dict[str, Any]
                     ) -> dict[str, tuple[TierSpec, ...]]:
    """Each placed table's tier chain, top first.

    Raises:
        ConfigError: the placement cannot be read (see `load_document`).
    """
    doc = load_document(source, "placement")
    return {name: tuple(TierSpec.from_json(t) for t in entry["tiers"])
            for name, entry in doc["tables"].items()}


def apply_placement(specs: list[TableSpec],
                    source: str | os.PathLike[str] | dict[str, Any]) -> list[TableSpec]:
    """`specs` with each placed table's `tiers` set to its planned chain.

    Tables the placement does not name keep their chain (the store's default).

    Raises:
        ConfigError: the placement is unreadable, names a table that is not among `specs`,
            or would change a table whose spec already sets other tiers.
    """
    chains = placement_chains(source)
    names = {s.name for s in specs}
    unknown = sorted(set(chains) - names)
    if unknown and not names:
        # reopening a store without its specs: its tables are only known once it is open
        raise ConfigError(f"the placement places tables {unknown}, but no tables were given: "
                          "open(..., placement=) sets the chains of the TableSpecs passed "
                          "with it (tables=[...]); to move the tables of an existing store, "
                          "run `embstore migrate STORE --placement FILE`")
    if unknown:
        raise ConfigError(f"the placement places tables {unknown} that are not among the "
                          f"tables given ({sorted(names)}); pass their TableSpecs too or plan "
                          "again from a profile of these tables")
    out = []
    for spec in specs:
        chain = chains.get(spec.name)
        if chain is not None and spec.tiers is not None and spec.tiers != chain:
            raise ConfigError(f"table {spec.name!r} sets its own tiers and the placement "
                              "others; drop one of them")
        out.append(spec if chain is None else replace(spec, tiers=chain))
    return out
