"""The store manifest: `MANIFEST.json` in the store's directory, written atomically.

It records the format version, the default tier chain and every table (dim, dtype, initializer,
optimizer, chain), which is all `embstore.open(path)` needs to reopen a store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import CorruptStoreError, StoreNotFoundError

__all__ = ["FORMAT", "MANIFEST_NAME", "VERSION", "read_manifest", "write_atomic", "write_manifest"]

FORMAT = "embstore"
VERSION = 1
MANIFEST_NAME = "MANIFEST.json"


def fsync_dir(path: Path) -> None:
    """Fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(file: Path, data: bytes) -> None:
    """Replace `file` with `data`; a crash leaves either the old or the new content.

    Writes a temporary file, fsyncs it, renames it over the target, fsyncs the directory.
    """
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, file)
    fsync_dir(file.parent)


def write_manifest(directory: Path, body: dict[str, Any]) -> None:
    """Write the manifest of the store in `directory` atomically."""
    doc = {"format": FORMAT, "version": VERSION, **body}
    write_atomic(directory / MANIFEST_NAME, json.dumps(doc, indent=2, sort_keys=True).encode())


def read_manifest(directory: Path) -> dict[str, Any]:
    """Read and check the manifest of the store in `directory`.

    Raises:
        StoreNotFoundError: there is no manifest.
        CorruptStoreError: the manifest is unreadable or not an embstore manifest.
    """
    file = directory / MANIFEST_NAME
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise StoreNotFoundError(
            f"{directory} holds no embstore store (no {MANIFEST_NAME}); create one by passing "
            "tables=[TableSpec(...)] to embstore.open"
        ) from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStoreError(f"{file} is not valid JSON ({exc}); restore it from a checkpoint"
                                ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptStoreError(f"{file} is not an embstore manifest (format field missing)")
    if doc.get("version") != VERSION:
        raise CorruptStoreError(
            f"{file} has format version {doc.get('version')!r}; this embstore reads version "
            f"{VERSION}: use the embstore release that wrote it"
        )
    for key in ("tables", "tiers"):
        if not isinstance(doc.get(key), list):
            raise CorruptStoreError(f"{file}: field {key!r} is missing or not a list")
    return doc
