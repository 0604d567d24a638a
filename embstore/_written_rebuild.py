"""Rebuilding lost written-id records (embstore._written) from a store's rows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ._open import open as open_store
from .layout import WRITTEN_DIR, manifest_body, read_manifest, write_manifest
from .spec import TableSpec, TierSpec

__all__ = ["rebuild_written_records"]


def rebuild_written_records(path: str | os.PathLike[str]) -> list[str]:
    """Rebuild the written-id records of the store at `path` from its rows; returns the tables.

    For a store whose records were lost while its rows are known to be intact: every stored
    row counts as written from then on. Opens the store (nothing else may hold it).

    Raises:
        StoreLockedError, StoreNotFoundError, CorruptStoreError: from opening the store.
    """
    root = Path(path)
    doc = read_manifest(root)
    shutil.rmtree(root / WRITTEN_DIR, ignore_errors=True)
    tiers = [TierSpec.from_json(t) for t in doc["tiers"]]
    specs = [TableSpec.from_json(t) for t in doc["tables"]]
    body = {k: v for k, v in doc.items() if k not in ("format", "version")}
    body["written_records"] = []
    write_manifest(root, body)  # no record is required while they are rebuilt
    with open_store(root) as store:
        names = store.tables
    write_manifest(root, {**body, **manifest_body(tiers, specs)})
    return names
