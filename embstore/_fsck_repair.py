"""What a repair lost: the finding that lists the rows `fsck --repair` dropped, and its sources.

A scanner names the rows it dropped (failed checks); rows it could not read at all (a RocksDB
block failing its checksum) it cannot name. The store's written-id record can: every id it
held that the repaired store lacks was lost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import _counters
from ._fsck_common import Finding, TableScan
from .errors import EmbstoreError
from .layout import bottom_dir, written_file
from .spec import TableSpec, TierSpec

__all__ = ["closed_cleanly", "dropped_finding", "record_ids"]


def dropped_finding(table: str, scan: TableScan, held: np.ndarray | None, kept: np.ndarray,
             complete: bool, backup: Path) -> Finding | None:
    """The finding listing the rows a repair dropped from `table`, None if it dropped none.

    Their ids are those the scan dropped, and those the old written-id record `held` that
    the repaired store does not keep (`kept`): rows in RocksDB blocks that could not be read
    at all, and rows the medium had lost before. Where rows could not be read and no record
    says which, the finding says that more were lost than it can count. `complete`: the
    store was closed cleanly and not opened since, so the record held every row (else rows
    written after the last flush before a crash may be missing from it).
    """
    dropped = scan.dropped_ids()
    known = np.unique(dropped[dropped != -1])
    unlisted = int(np.count_nonzero(dropped == -1))  # beyond what the scanner listed
    if held is not None:
        gone = np.setdiff1d(held, kept, assume_unique=True)
        known = np.union1d(known, gone)
    n = len(known) + unlisted
    if not n and not scan.unreadable:
        return None
    what = f"dropped {n} row(s) that failed their checks or could not be read"
    if scan.unreadable:
        if held is None:
            what = (f"dropped {n} row(s) that failed their checks, and an unknown number "
                    "more in blocks that could not be read (the table keeps no written-id "
                    "record to name them)")
        elif not complete:
            what += (" (those in blocks that could not be read as the written-id record "
                     "names them: rows written after the store's last flush, if any, may be "
                     "lost too without being listed)")
    return Finding(table, f"{what}; they read as never written from now on; the old store "
                   f"is kept at {backup}", ids=tuple(int(i) for i in known[:1000]),
                   repaired=True)


def record_ids(root: Path, spec: TableSpec) -> np.ndarray | None:
    """The ids the written-id record of `spec` holds (sorted); None without a sound record."""
    from ._written import WrittenIds

    file = written_file(root, spec.name)
    if not file.is_file():
        return None
    try:
        return WrittenIds(file, spec.num_embeddings, lambda: np.zeros(0, np.int64),
                          read_only=True).ids()
    except EmbstoreError:
        return None


def closed_cleanly(root: Path, specs: list[TableSpec], tiers: tuple[TierSpec, ...]
                    ) -> set[str]:
    """Tables whose store of record is as the last clean close left it (its fingerprint)."""
    recorded = _counters.load(root).get("fingerprints") or {}
    now = _counters.fingerprints(root, specs, tiers)
    out = set()
    for spec in specs:
        rel = str(bottom_dir(root, spec, tiers).relative_to(root))
        if rel in recorded and recorded[rel] == now.get(rel):
            out.add(spec.name)
    return out
