"""`embstore.open`: create, reopen and lock a store from its directory and manifest."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import layout
from .errors import ConfigError, ReadOnlyError, StoreNotFoundError
from .layout import LOCK_NAME, MANIFEST_NAME, read_manifest, write_manifest
from .manifest import fsync_dir
from .spec import TableSpec, TierSpec
from .store import DEFAULT_TIERS, EmbeddingStore

__all__ = ["open"]


def _make_dirs(directory: Path) -> None:
    """Create `directory` and its missing parents, syncing the parent of each one created.

    So the store's directory entry survives a power cut once its first flush is done.
    """
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def _check_unique(specs: list[TableSpec]) -> None:
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"table names must be unique, {sorted(dup)} given more than once")


def open(path: str | os.PathLike[str] | None, tables: list[TableSpec] | None = None,
         tiers: list[TierSpec] | None = None, *, read_only: bool = False) -> EmbeddingStore:
    """Open or create a store.

    Args:
        path: the store's directory, or None for an in-memory store of DRAM tiers.
        tables: table specs. Required to create a store; on reopen, tables already in the
            manifest must be given exactly as stored, and new ones are added.
        tiers: the default tier chain, top first (default: one DRAM tier). Fixed at creation.
        read_only: open without write access (a shared lock; writes raise ReadOnlyError).

    Raises:
        StoreNotFoundError: no store at `path` and no tables to create one, or `path` is a file
            or a directory of other files.
        StoreLockedError: another process or handle holds the store.
        ConfigError: invalid specs, or specs that contradict the manifest.
        CorruptStoreError: the manifest or a tier's files are damaged.
    """
    specs = list(tables or [])
    if not all(isinstance(s, TableSpec) for s in specs):
        raise ConfigError("tables must be a list of embstore.TableSpec")
    _check_unique(specs)
    tier_specs = tuple(tiers) if tiers is not None else None
    if tier_specs is not None and (not tier_specs
                                   or not all(isinstance(t, TierSpec) for t in tier_specs)):
        raise ConfigError("tiers must be a non-empty list of embstore.TierSpec")

    if path is None:
        if read_only:
            raise ConfigError("an in-memory store cannot be read-only")
        if not specs:
            raise ConfigError("an in-memory store needs tables=[TableSpec(...)]")
        return EmbeddingStore(None, specs, tier_specs or DEFAULT_TIERS, read_only=False,
                              lock_fd=None)

    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise StoreNotFoundError(f"{directory} is a file, not a store directory")
    exists = (directory / MANIFEST_NAME).exists()
    if not exists:
        if not specs or read_only:
            read_manifest(directory)  # raises StoreNotFoundError with the reason
        if directory.exists() and any(p.name != LOCK_NAME for p in directory.iterdir()):
            raise StoreNotFoundError(
                f"{directory} holds files but no {MANIFEST_NAME}: it is not an embstore store; "
                "choose an empty or new directory"
            )
        before = set(directory.iterdir()) if directory.exists() else None
        _make_dirs(directory)
    lock_fd = layout.lock(directory, read_only)
    try:
        if exists:
            doc = read_manifest(directory)
            if (doc.get("checkpoint") or {}).get("kind") == "incremental":
                raise ConfigError(
                    f"{directory} is an incremental checkpoint (only changed rows); materialise "
                    "it with embstore.restore(src, new_path) and open that"
                )
            stored_tiers = tuple(TierSpec.from_json(t) for t in doc["tiers"])
            if tier_specs is not None and tier_specs != stored_tiers:
                raise ConfigError(
                    f"{directory} was created with tiers {stored_tiers}; a store's default chain "
                    "is fixed at creation: omit tiers= or export/import into a new store"
                )
            stored = [TableSpec.from_json(t) for t in doc["tables"]]
            by_name = {s.name: s for s in stored}
            for spec in specs:
                if spec.name in by_name and by_name[spec.name] != spec:
                    raise ConfigError(
                        f"table {spec.name!r} exists with {by_name[spec.name]}; it was given as "
                        f"{spec}: omit it to use the stored spec"
                    )
            added = [s for s in specs if s.name not in by_name]
            if added and read_only:
                raise ReadOnlyError("cannot add tables to a store opened read-only")
            all_specs, chain = stored + added, stored_tiers
            steps = doc.get("gradient_steps") or {}
        else:
            all_specs, chain, added = specs, tier_specs or DEFAULT_TIERS, specs
            steps = {}
        store = EmbeddingStore(directory, all_specs, chain, read_only=read_only, lock_fd=lock_fd,
                               gradient_steps=steps)
    except BaseException:
        if not exists:  # a failed create leaves the directory as it found it
            for entry in directory.iterdir():
                if before is None or entry not in before:
                    (shutil.rmtree if entry.is_dir() else os.unlink)(entry)
            if before is None:
                directory.rmdir()
        os.close(lock_fd)
        raise
    if added:
        write_manifest(directory, layout.manifest_body(chain, all_specs))
    return store
