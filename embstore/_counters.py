"""The store's history: cumulative counters, rows, last flush and checkpoint, kept across opens.

A writer's `close()` adds the counters of its session to those read at open and writes them,
with each table's row count and a fingerprint of every store of record (`_fileinfo`), to
`STATS.json` in the store's directory (atomically). `embstore info` shows them, and `fsck`
compares the row counts with what it finds when the fingerprints say that no writer touched
the store since (a crash loses only the counters of the session it ends).

    {"format": "embstore-stats", "version": 1, "closed_at": unix seconds,
     "last_flush": unix seconds | null, "last_checkpoint": {"path", "step", "time"} | null,
     "tables": {name: {"rows": int, "updates_dropped": int,
                       "tiers": [{"level", "backend", "lookups", "hits", ...}]}},
     "fingerprints": {tier directory relative to the store: value}}
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._fileinfo import fingerprint
from .layout import bottom_dir, table_chain
from .manifest import is_json_int, write_atomic
from .spec import TableSpec, TierSpec

__all__ = ["COUNTERS", "STATS_NAME", "cumulative", "damage", "fingerprints", "load", "save"]

STATS_NAME = "STATS.json"
FORMAT = "embstore-stats"
COUNTERS = ("lookups", "hits", "misses", "promotions", "admissions_rejected", "evictions",
            "writebacks")
_MAX_BYTES = 64 << 20


def load(root: Path) -> dict[str, Any]:
    """The history of the store at `root`; empty when there is none or it is unreadable."""
    return _read(root)[0]


def damage(root: Path) -> str | None:
    """Why the store's STATS.json cannot be read, or None (a store may lack it)."""
    return _read(root)[1]


def _read(root: Path) -> tuple[dict[str, Any], str | None]:
    """(the history, None) or ({}, why it is unreadable); ({}, None) where there is none."""
    file = root / STATS_NAME
    try:
        # O_NONBLOCK: a named pipe in the file's place would block the open for a writer
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return {}, f"cannot be opened ({exc.strerror or exc})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}, "is not a regular file"
        if os.fstat(fd).st_size > _MAX_BYTES:
            return {}, f"is over {_MAX_BYTES >> 20} MiB"
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read()
        doc = json.loads(raw)
    except OSError as exc:
        return {}, f"cannot be read ({exc.strerror or exc})"
    except ValueError:
        return {}, "is not JSON"
    finally:
        os.close(fd)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return {}, f"is not an {FORMAT} document"
    problem = _schema_problem(doc)
    if problem is not None:
        return {}, problem
    return doc, None


def _count(value: Any) -> bool:
    return is_json_int(value) and value >= 0


def _time(value: Any) -> bool:
    """A unix time as `save` writes one (up to the year 5000), or None."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and 0 <= value < 1e11)


def _schema_problem(doc: dict[str, Any]) -> str | None:
    """What in `doc` is not as `save` writes it, or None.

    The file has no checksum (it holds figures, not rows), so its readers get it only once
    every field they use has the kind they expect.
    """
    for key in ("closed_at", "last_flush"):
        if not _time(doc.get(key)):
            return f"has a {key} that is no time: {doc.get(key)!r:.40}"
    ckpt = doc.get("last_checkpoint")
    if ckpt is not None and not (isinstance(ckpt, dict) and isinstance(ckpt.get("path"), str)
                                 and (ckpt.get("step") is None or _count(ckpt.get("step")))
                                 and _time(ckpt.get("time"))):
        return f"has a last_checkpoint that is not one: {ckpt!r:.60}"
    tables = doc.get("tables", {})
    if not isinstance(tables, dict):
        return f"has tables that are not an object: {tables!r:.40}"
    for name, t in tables.items():
        if not (isinstance(t, dict) and _count(t.get("rows", 0))
                and _count(t.get("updates_dropped", 0))
                and isinstance(t.get("tiers", []), list)
                and all(isinstance(s, dict) and all(_count(s.get(k, 0)) for k in COUNTERS)
                        for s in t.get("tiers", []))):
            return f"has figures for table {name!r} that are not counts: {t!r:.60}"
    if not isinstance(doc.get("fingerprints", {}), dict):
        return f"has fingerprints that are not an object: {doc.get('fingerprints')!r:.40}"
    return None


def cumulative(history: dict[str, Any], table: str, level: int, backend: str,
               current: dict[str, Any]) -> dict[str, int]:
    """The counters of tier `level` of `table` over every session: `history`'s plus `current`."""
    out = {k: int(current.get(k, 0)) for k in COUNTERS}
    tiers = ((history.get("tables") or {}).get(table) or {}).get("tiers") or []
    for old in tiers:
        if isinstance(old, dict) and old.get("level") == level \
                and old.get("backend") == backend:
            for k in COUNTERS:
                value = old.get(k, 0)
                out[k] += value if isinstance(value, int) else 0
    return out


def fingerprints(root: Path, specs: Sequence[TableSpec],
                 default_tiers: Sequence[TierSpec]) -> dict[str, Any]:
    """The fingerprint of every store of record, by directory relative to `root`."""
    dirs: dict[Path, tuple[str, list[str]]] = {}
    for spec in specs:
        d = bottom_dir(root, spec, default_tiers)
        backend = table_chain(spec, default_tiers)[-1].backend
        dirs.setdefault(d, (backend, []))[1].append(spec.name)
    return {str(d.relative_to(root)): fingerprint(d, backend, names)
            for d, (backend, names) in sorted(dirs.items())}


def save(root: Path, specs: Sequence[TableSpec], default_tiers: Sequence[TierSpec],
         tables: dict[str, dict[str, Any]], history: dict[str, Any],
         last_flush: float | None, last_checkpoint: dict[str, Any] | None) -> None:
    """Write the history at a clean close: `tables` holds this session's figures per table.

    `tables[name]` is {"rows", "updates_dropped", "tiers": [TierStatistics as dicts]}.
    """
    out: dict[str, Any] = {}
    for name, t in tables.items():
        old = (history.get("tables") or {}).get(name) or {}
        dropped = old.get("updates_dropped", 0)
        out[name] = {
            "rows": int(t["rows"]),
            "updates_dropped": int(t["updates_dropped"])
            + (dropped if isinstance(dropped, int) else 0),
            "tiers": [{"level": s["level"], "backend": s["backend"],
                       **cumulative(history, name, s["level"], s["backend"], s)}
                      for s in t["tiers"]]}
    doc = {"format": FORMAT, "version": 1, "closed_at": time.time(), "last_flush": last_flush,
           "last_checkpoint": last_checkpoint, "tables": out,
           "fingerprints": fingerprints(root, specs, default_tiers)}
    write_atomic(root / STATS_NAME, json.dumps(doc, indent=1, sort_keys=True).encode())
