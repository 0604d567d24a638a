"""The store directory's layout: where each tier's files go, what the manifest holds, the lock.

Every module that reads or writes a store's directory asks this one (opening a store, its
checkpoints, restore), so the names below are written in one place:

    <store>/
        MANIFEST.json                 format, version, default tiers, tables, gradient steps
                                      of half-precision tables (`manifest_body`)
        LOCK                          flock: exclusive for a writer, shared for readers (`lock`)
        tier<level>-<backend>/        the store of record of every table whose chain ends there
        cache/tier<level>-<backend>/  cache tiers that need files; emptied on open

A checkpoint adds `checkpoint` to the manifest (and `<table>.deleted` files when incremental).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import StoreLockedError
from .manifest import MANIFEST_NAME, read_manifest, write_manifest
from .spec import TableSpec, TierSpec

__all__ = ["LOCK_NAME", "MANIFEST_NAME", "bottom_dir", "lock", "manifest_body", "read_manifest",
           "table_chain", "tier_dir", "write_manifest"]

LOCK_NAME = "LOCK"
CACHE_DIR = "cache"


def tier_dir(root: Path, level: int, backend: str, *, is_bottom: bool) -> Path:
    """The directory of tier `level` (backend `backend`) of a store rooted at `root`.

    Caches live apart from the store of record, so that a crash's unflushed cache rows never
    shadow the bottom tier's on the next open.
    """
    name = f"tier{level}-{backend}"
    return root / name if is_bottom else root / CACHE_DIR / name


def table_chain(spec: TableSpec, default_tiers: Sequence[TierSpec]) -> tuple[TierSpec, ...]:
    """The tier chain of table `spec`: its own, else the store's default."""
    return tuple(spec.tiers or default_tiers)


def bottom_dir(root: Path, spec: TableSpec, default_tiers: Sequence[TierSpec]) -> Path:
    """The directory of the store of record of table `spec`."""
    chain = table_chain(spec, default_tiers)
    return tier_dir(root, len(chain) - 1, chain[-1].backend, is_bottom=True)


def manifest_body(default_tiers: Sequence[TierSpec], specs: Sequence[TableSpec],
                  gradient_steps: dict[str, int] | None = None) -> dict[str, Any]:
    """The manifest's fields beside format and version: the default chain and every table.

    `gradient_steps` (per table, its count of optimizer steps, which seeds the stochastic
    rounding of half-precision tables) is recorded where given and not empty.
    """
    body: dict[str, Any] = {"tiers": [t.to_json() for t in default_tiers],
                            "tables": [s.to_json() for s in specs]}
    if gradient_steps:
        body["gradient_steps"] = dict(gradient_steps)
    return body


def lock(root: Path, read_only: bool) -> int:
    """Take the store's lock (shared when `read_only`); returns the descriptor that holds it.

    Closing the descriptor releases the lock.

    Raises:
        StoreLockedError: another process or handle holds the store.
    """
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if read_only else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLockedError(
            f"{root} is open in another process or handle; close that store first"
        ) from None
    return fd
