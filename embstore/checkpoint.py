"""Checkpoints: consistent, self-contained copies of a store, full or incremental.

A full checkpoint is a store directory of its own (same tables and tier chain, bottom tier
only) whose manifest also records the training step; `embstore.open(dest)` opens it. An
incremental checkpoint holds only the rows written since the previous checkpoint, the ids
deleted since then (`<table>.deleted`) and a link to its parent; `restore` materialises any
chain of them into a full store, equal to what a full checkpoint at the same moment holds.

Consistency without stalling: the store is flushed and the ids to copy are fixed under the
store's lock (time T0); the rows are then copied batch by batch, taking the lock only per batch.
A write during the copy to an id not yet copied first saves that row's T0 value (a pre-image),
so the checkpoint is the table as of T0 while lookups and writes go on.

Crash safety: everything is written under a temporary name, fsynced, then renamed into place;
an interrupted checkpoint leaves only a `.<name>.tmp-*` directory and every earlier checkpoint
intact.

Tombstone file layout (`<table>.deleted`):

    offset  size  field
    0       8     magic b"EMBSTOMB"
    8       8     n, number of ids (little-endian)
    16      4     CRC-32C of the ids
    20      4     reserved (zero)
    24      8*n   ids, int64 little-endian
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import registry
from .backend import BackendSpec
from .checksum import crc32c
from .errors import ConfigError, CorruptStoreError, StoreExistsError
from .index import IdIndex
from .manifest import fsync_dir, read_manifest, write_atomic, write_manifest
from .spec import TableSpec, TierSpec

if TYPE_CHECKING:
    from .store import EmbeddingStore

__all__ = ["restore"]

TOMB_MAGIC = b"EMBSTOMB"
TOMB_HEADER = struct.Struct("<8sQI4x")
BATCH_ROWS = 65536


def _write_tombstones(file: Path, ids: np.ndarray) -> None:
    ids = np.ascontiguousarray(ids, dtype="<i8")
    write_atomic(file, TOMB_HEADER.pack(TOMB_MAGIC, len(ids), crc32c(ids)) + ids.tobytes())


def _read_tombstones(file: Path) -> np.ndarray:
    data = file.read_bytes()
    if len(data) < TOMB_HEADER.size:
        raise CorruptStoreError(f"{file}: truncated tombstone file")
    magic, n, crc = TOMB_HEADER.unpack_from(data)
    ids = np.frombuffer(data, dtype="<i8", offset=TOMB_HEADER.size)
    if magic != TOMB_MAGIC or len(ids) != n or crc32c(ids) != crc:
        raise CorruptStoreError(f"{file}: tombstone file fails its checks; the checkpoint is "
                                "damaged: restore from an earlier one")
    return ids.astype(np.int64)


@dataclass
class CopyState:
    """The checkpoint being copied: ids still to copy and the saved T0 values of rows that
    were written before the copier reached them."""

    pending: dict[str, IdIndex]
    saved_ids: dict[str, list[np.ndarray]] = field(default_factory=dict)
    saved_rows: dict[str, list[np.ndarray]] = field(default_factory=dict)
    saved_found: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def capture(self, table: str, ids: np.ndarray, read_bottom: Callable[..., Any]) -> None:
        """Before a write to distinct `ids`, save the T0 value of those not copied yet."""
        pending = self.pending.get(table)
        if pending is None or not len(pending):
            return
        hit = pending.find(ids) >= 0
        if not hit.any():
            return
        ids = np.ascontiguousarray(ids[hit])
        rows, found = read_bottom(ids)
        pending.remove(ids)
        self.saved_ids.setdefault(table, []).append(ids)
        self.saved_rows.setdefault(table, []).append(rows)
        self.saved_found.setdefault(table, []).append(found)

    def take(self, table: str, ids: np.ndarray, read_bottom: Callable[..., Any]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The T0 rows of the still-pending `ids` of one batch; marks them copied."""
        pending = self.pending[table]
        still = pending.find(ids) >= 0
        ids = np.ascontiguousarray(ids[still])
        rows, found = read_bottom(ids)
        pending.remove(ids)
        return ids, rows, found

    def saved(self, table: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """All pre-images of `table`, once the copier has passed every batch."""
        if table not in self.saved_ids:
            return None
        return (np.concatenate(self.saved_ids[table]), np.concatenate(self.saved_rows[table]),
                np.concatenate(self.saved_found[table]))


def take_checkpoint(store: EmbeddingStore, dest: Path, *, step: int | None, incremental: bool,
                    progress: Callable[[str, int, int], None] | None) -> Path:
    """Write a checkpoint of `store` to `dest` (see `EmbeddingStore.checkpoint`)."""
    from ._open import open as open_store

    dest = Path(dest)
    if dest.exists():
        raise StoreExistsError(f"{dest} exists; checkpoints never overwrite: choose a new name")
    with store._mutex:
        store._check_open()
        parent = store._last_checkpoint
        if incremental and (parent is None or store._changes is None):
            raise ConfigError(
                "an incremental checkpoint needs an earlier checkpoint taken by this handle "
                "(changes are tracked in memory from it); take a full checkpoint first"
            )
        if not store.read_only:
            store.flush()
        to_copy: dict[str, np.ndarray] = {}
        for name, t in store._tables.items():
            if incremental:
                to_copy[name] = store._changes[name].items()[0]
            else:
                t.chain.write_back_all()
                to_copy[name] = t.chain.tiers[-1].backend.ids()
        previous_changes = store._changes
        store._changes = {name: IdIndex() for name in store._tables}  # changes after T0
        pending = {}
        for name, ids in to_copy.items():
            pending[name] = IdIndex(max(16, 2 * len(ids)))
            pending[name].add(np.ascontiguousarray(ids))
        store._copy = CopyState(pending)
        specs = [t.spec for t in store._tables.values()]
        tiers = list(store._default_tiers)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open_store(tmp, tables=specs, tiers=tiers) as out:
            for name, ids in to_copy.items():
                target = out._tables[name].chain.tiers[-1].backend
                deleted: list[np.ndarray] = []
                read = store._tables[name].chain.tiers[-1].backend.get
                for start in range(0, len(ids), BATCH_ROWS):
                    with store._mutex:  # per batch only: lookups and writes go on between
                        got_ids, rows, found = store._copy.take(name, ids[start:start + BATCH_ROWS],
                                                                read)
                    _write_batch(target, got_ids, rows, found, deleted)
                    if progress is not None:
                        progress(name, min(start + BATCH_ROWS, len(ids)), len(ids))
                with store._mutex:
                    saved = store._copy.saved(name)
                if saved is not None:
                    _write_batch(target, *saved, deleted)
                if incremental:
                    _write_tombstones(tmp / f"{name}.deleted",
                                      np.concatenate(deleted) if deleted else np.zeros(0, np.int64))
        body = read_manifest(tmp)
        body.pop("format"), body.pop("version")
        body["checkpoint"] = {"step": step, "kind": "incremental" if incremental else "full",
                              "parent": None if not incremental else os.path.relpath(
                                  parent.resolve(), dest.parent.resolve())}
        write_manifest(tmp, body)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        with store._mutex:
            # the rows meant for this checkpoint must go into the next incremental one
            if previous_changes is not None:
                for name, ids in to_copy.items():
                    store._changes[name].add(np.ascontiguousarray(ids))
        raise
    finally:
        with store._mutex:
            store._copy = None
    store._last_checkpoint = dest
    return dest


def _write_batch(target: Any, ids: np.ndarray, rows: np.ndarray, found: np.ndarray,
                 deleted: list[np.ndarray]) -> None:
    if found.any():
        target.put(np.ascontiguousarray(ids[found]), np.ascontiguousarray(rows[found]))
    if not found.all():
        deleted.append(ids[~found])


def checkpoint_chain(src: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The checkpoints from `src` back to its full base: [(path, manifest)], newest first."""
    chain = []
    path = Path(src)
    seen = set()
    while True:
        doc = read_manifest(path)
        info = doc.get("checkpoint")
        if info is None:
            raise ConfigError(f"{path} is a store, not a checkpoint")
        chain.append((path, doc))
        if info["kind"] == "full":
            return chain
        parent = (path.parent / info["parent"]).resolve()
        if parent in seen or not parent.exists():
            raise CorruptStoreError(f"{path}: its parent checkpoint {parent} is missing")
        seen.add(parent)
        path = parent


def restore(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Materialise the checkpoint `src` (full, or the newest of a chain of incrementals) as a
    new store at `dest`.

    Raises:
        StoreExistsError: `dest` exists.
        CorruptStoreError: a checkpoint of the chain is missing or damaged.
    """
    dest = Path(dest)
    if dest.exists():
        raise StoreExistsError(f"{dest} exists; restore into a new directory")
    chain = checkpoint_chain(Path(src))
    base = chain[-1][0]
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(base, tmp, ignore=shutil.ignore_patterns("LOCK"))
        doc = read_manifest(tmp)
        tables = {t["name"]: TableSpec.from_json(t) for t in doc["tables"]}
        tiers = tuple(TierSpec.from_json(t) for t in doc["tiers"])
        for path, inc in reversed(chain[:-1]):  # oldest increment first
            _apply_increment(tmp, path, inc, tables, tiers)
        doc.pop("format"), doc.pop("version")
        doc["restored_from"] = {"checkpoint": str(Path(src)), "step": chain[0][1]["checkpoint"]
                                ["step"]}
        doc.pop("checkpoint", None)
        write_manifest(tmp, doc)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _bottom_backend(root: Path, spec: TableSpec, tiers: tuple[TierSpec, ...], read_only: bool
                    ) -> Any:
    chain = spec.tiers or tiers
    level, ts = len(chain) - 1, chain[-1]
    cls = registry.load_backend(ts.backend)
    return cls.open(BackendSpec(path=root / f"tier{level}-{ts.backend}", dim=spec.row_width,
                                dtype=spec.dtype, table=spec.name, read_only=read_only),
                    **ts.options)


def _apply_increment(root: Path, inc_path: Path, inc: dict[str, Any],
                     tables: dict[str, TableSpec], tiers: tuple[TierSpec, ...]) -> None:
    for data in inc["tables"]:
        spec = TableSpec.from_json(data)
        if spec.name in tables and tables[spec.name] != spec:
            raise CorruptStoreError(f"{inc_path}: table {spec.name!r} differs from its parent's")
        tables[spec.name] = spec
        with _bottom_backend(root, spec, tiers, read_only=False) as target, \
                _bottom_backend(inc_path, spec, tiers, read_only=True) as delta:
            for ids, rows in delta.items(BATCH_ROWS):
                target.put(ids, rows)
            dead = _read_tombstones(inc_path / f"{spec.name}.deleted")
            if len(dead):
                target.delete(dead)
    body = {"tiers": [t.to_json() for t in tiers],
            "tables": [s.to_json() for s in tables.values()]}
    write_manifest(root, body)
