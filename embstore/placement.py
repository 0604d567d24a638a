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

`load_document` checks the format, version and the fields the planner and `open` use, and
raises `ConfigError` naming the file, the field and the fix; `apply_placement` gives table
specs their planned chains (``embstore.open(..., placement=path)``).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .spec import TableSpec, TierSpec

__all__ = ["KNOWN_TIERS", "apply_placement", "load_document", "placement_chains",
           "save_document"]

KNOWN_TIERS = ("dram", "pmem", "rocksdb", "lmdb")
"""Tier (backend) names a tier model or placement may use."""
_VERSIONS = {"embstore.profile": 1, "embstore.tiers": 1, "embstore.placement": 1}


def save_document(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write `doc` as indented JSON, atomically (a temporary file renamed over `path`)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


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
    else:
        where = str(source)
        try:
            doc = json.loads(Path(source).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read {kind} {where!r}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{kind} {where!r} is not JSON ({exc}); write it again with "
                              f"the command that makes it") from exc
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(f"{where!r} is not an {fmt} document (format {got!r}); give the "
                          f"file written by `embstore {_MAKER[kind]}`")
    if doc.get("version") != _VERSIONS[fmt]:
        raise ConfigError(f"{where!r}: {fmt} version {doc.get('version')!r} is not supported "
                          f"(this embstore reads version {_VERSIONS[fmt]})")
    _CHECKS[kind](doc, where)
    return doc


_MAKER = {"profile": "profile", "tiers": "bench tiers", "placement": "plan"}


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


def _check_profile(doc: dict[str, Any], where: str) -> None:
    tables = _need(doc, "tables", dict, where, "the profile")
    if not tables:
        raise ConfigError(f"{where!r}: the profile has no tables; profile a trace that has ids")
    for name, t in tables.items():
        what = f"table {name!r}"
        for key in ("rows_touched", "row_bytes"):
            if _need(t, key, int, where, what) < 1:
                raise ConfigError(f"{where!r}: {what}.{key} must be >= 1, got {t[key]}")
        for key in ("distinct_per_batch", "lookups_per_sample", "bytes_per_sample"):
            _need(t, key, (int, float), where, what)
        mrc = _need(t, "mrc", dict, where, what)
        caps = _need(mrc, "capacities", list, where, f"{what}.mrc")
        curves = [k for k in mrc if k != "capacities"]
        if not caps or not curves:
            raise ConfigError(f"{where!r}: {what}.mrc needs capacities and at least one curve")
        if any(b <= a for a, b in zip(caps, caps[1:], strict=False)):
            raise ConfigError(f"{where!r}: {what}.mrc.capacities must increase")
        for k in curves:
            curve = mrc[k]
            if not isinstance(curve, list) or len(curve) != len(caps) or not all(
                    isinstance(v, (int, float)) and 0 <= v <= 1 for v in curve):
                raise ConfigError(f"{where!r}: {what}.mrc.{k} must be {len(caps)} miss ratios "
                                  "in [0, 1], one per capacity")


def _check_tiers(doc: dict[str, Any], where: str) -> None:
    tiers = _need(doc, "tiers", dict, where, "the tier model")
    if not tiers:
        raise ConfigError(f"{where!r}: the tier model lists no tiers")
    for name, t in tiers.items():
        if name not in KNOWN_TIERS:
            raise ConfigError(f"{where!r}: unknown tier {name!r}; known: {list(KNOWN_TIERS)}")
        for op in ("read", "write"):
            o = _need(t, op, dict, where, f"tier {name!r}")
            if _need(o, "bytes_per_s", (int, float), where, f"tier {name!r}.{op}") <= 0:
                raise ConfigError(f"{where!r}: tier {name!r}.{op}.bytes_per_s must be > 0")
            if _need(o, "batch_latency_s", (int, float), where, f"tier {name!r}.{op}") < 0:
                raise ConfigError(f"{where!r}: tier {name!r}.{op}.batch_latency_s must be >= 0")


def _check_placement(doc: dict[str, Any], where: str) -> None:
    tables = _need(doc, "tables", dict, where, "the placement")
    for name, t in tables.items():
        chain = _need(t, "tiers", list, where, f"table {name!r}")
        if not chain:
            raise ConfigError(f"{where!r}: table {name!r} has an empty tier chain")
        for tier in chain:
            backend = tier.get("backend") if isinstance(tier, dict) else None
            if backend not in KNOWN_TIERS:
                raise ConfigError(f"{where!r}: table {name!r} uses unknown tier {backend!r}; "
                                  f"known: {list(KNOWN_TIERS)}")
            try:
                TierSpec.from_json(tier)
            except (TypeError, ConfigError) as exc:
                raise ConfigError(f"{where!r}: table {name!r}: bad tier {tier!r}: {exc}") from exc


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
