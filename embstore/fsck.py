"""`check`: verify a store end to end and list what is wrong with it.

Every stored row is read back through its backend, so every per-row checksum is verified;
ids must lie in the table's range, values must be finite where the table says so, and scans
must agree with the row counts. Nothing is changed: this is a dry run by design (the way to
repair a damaged table is to restore it from a checkpoint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import EmbstoreError
from .store import EmbeddingStore

__all__ = ["Finding", "check"]


@dataclass(frozen=True)
class Finding:
    """One problem found in a store."""

    table: str | None
    """The table concerned; None for the store as a whole (manifest, lock, ...)."""
    message: str
    """What is wrong, and where."""


def _check_table(store: EmbeddingStore, name: str) -> list[Finding]:
    spec = store.table_spec(name)
    findings: list[Finding] = []
    seen = 0
    try:
        for ids, weights, state in store.items(name):
            seen += len(ids)
            n = spec.num_embeddings
            # a range or finiteness violation can only come from damage or a foreign writer:
            # the store's own API rejects such input before it is written
            if n is not None and len(ids) and (ids.min() < 0 or ids.max() >= n):
                bad = ids[(ids < 0) | (ids >= n)]
                findings.append(Finding(name, f"{len(bad)} stored id(s) outside [0, {n}), "
                                              f"e.g. {int(bad[0])}"))
            if not spec.allow_nonfinite:
                rows = np.concatenate([weights, state], axis=1)
                bad_rows = ~np.isfinite(rows).all(axis=1)
                if bad_rows.any():
                    findings.append(Finding(name, f"{int(bad_rows.sum())} stored row(s) hold "
                                                  f"NaN or infinity, e.g. id "
                                                  f"{int(ids[bad_rows][0])}"))
    except EmbstoreError as exc:
        findings.append(Finding(name, f"scan stopped after {seen} rows: {exc}"))
        return findings
    counted = store.num_rows(name)
    if counted != seen:
        findings.append(Finding(name, f"the backend counts {counted} rows but a scan "
                                      f"returned {seen}"))
    # rows written and flushed that the medium no longer has (embstore._written)
    try:
        lost = store.lost_rows(name)
    except EmbstoreError as exc:
        findings.append(Finding(name, f"cannot compare the written-id record: {exc}"))
        return findings
    if len(lost):
        findings.append(Finding(name, f"{len(lost)} written row(s) lost by the medium, "
                                      f"e.g. id {int(lost[0])}: restore them from a checkpoint"))
    return findings


def check(store: EmbeddingStore | str | os.PathLike[str]) -> list[Finding]:
    """Every problem found in `store` (an open store, or the path of one to open read-only).

    Returns an empty list for a healthy store.
    """
    if not isinstance(store, EmbeddingStore):
        from ._open import open as open_store

        try:
            opened = open_store(Path(store), read_only=True)
        except EmbstoreError as exc:
            return [Finding(None, f"cannot open {store}: {exc}")]
        with opened:
            return check(opened)
    findings: list[Finding] = []
    for name in store.tables:
        findings.extend(_check_table(store, name))
    return findings
