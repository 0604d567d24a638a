"""Checkpoints: consistent, self-contained copies of a store, full or incremental.

A full checkpoint is a store directory of its own (same tables and tier chain, bottom tier
only) whose manifest also records the training step; `embstore.open(dest)` opens it. An
incremental checkpoint holds only the rows written since the previous checkpoint, the ids
deleted since then (`<table>.deleted`) and a link to its parent; `restore` materialises any
chain of them into a full store, equal to what a full checkpoint at the same moment holds.

Consistency without stalling: the store is flushed under its lock (time T0); the rows are then
copied from the store of record page by page, taking the lock only per page. From T0 on, a write
to an id not yet copied first saves that row's T0 value (a pre-image) and the copier skips the
id in its pages, so the checkpoint is the table as of T0 while lookups and writes go on. The
store meets the checkpoint through `CheckpointSource`, a small interface of its own.

Crash safety: everything is written under a temporary name, fsynced, then renamed into place
and the directory synced (new parent directories too), so a checkpoint or restore that returned
survives a power cut; an interrupted one leaves only a `.<name>.tmp-*` directory and every
earlier checkpoint intact.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from . import _crash, registry
from ._written import write_record
from .backend import Backend, BackendSpec
from .checksum import crc32c
from .errors import ConfigError, CorruptStoreError, StoreExistsError
from .index import IdIndex
from .layout import (
    LOCK_NAME,
    bottom_dir,
    manifest_body,
    read_manifest,
    table_chain,
    write_manifest,
    written_file,
)
from .manifest import fsync_dir, fsync_tree, make_dirs, write_atomic
from .spec import TableSpec, TierSpec

__all__ = ["CheckpointPlan", "CheckpointSource", "CopyState", "restore"]

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
    """The checkpoint being copied, and the T0 values it saved.

    It knows which ids are copied or saved already, and holds the T0 values (pre-images) of
    rows written before the copier reached them.

    Args:
        scope: per table, the ids the checkpoint covers (an incremental one: the ids changed
            since its parent); None covers every id.
        previous: the store's change sets before this checkpoint began, restored into the
            next incremental one if this checkpoint fails.
    """

    scope: dict[str, IdIndex] | None
    previous: dict[str, IdIndex] | None
    done: dict[str, IdIndex] = field(default_factory=dict)
    saved: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = field(
        default_factory=dict)

    def capture(self, table: str, ids: np.ndarray,
                read_bottom: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> None:
        """Before a write to distinct `ids`, save the T0 value of those not copied yet."""
        done = self.done.setdefault(table, IdIndex())
        want = done.find(ids) < 0
        if self.scope is not None:
            want &= self.scope[table].find(ids) >= 0
        if not want.any():
            return
        ids = np.ascontiguousarray(ids[want])
        rows, found = read_bottom(ids)
        done.add(ids)
        self.saved.setdefault(table, []).append((ids, rows, found))

    def take(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Mark a page's ids copied; returns which still held their T0 value.

        bool[N]: which of the page's distinct `ids` were neither copied nor saved yet (their value
        in the store of record is T0's).
        """
        done = self.done.setdefault(table, IdIndex())
        fresh = done.find(ids) < 0
        done.add(np.ascontiguousarray(ids[fresh]))
        return fresh

    def preimages(self, table: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """All pre-images of `table` (ids, rows, found at T0), once every page is copied."""
        parts = self.saved.get(table)
        if not parts:
            return None
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]))


@dataclass(frozen=True)
class CheckpointPlan:
    """What `CheckpointSource.begin_checkpoint` fixed at T0."""

    specs: list[TableSpec]
    """The tables, in the store's order."""
    tiers: tuple[TierSpec, ...]
    """The store's default tier chain."""
    parent: Path | None
    """The previous checkpoint of this handle (the parent of an incremental one)."""
    rows: dict[str, int]
    """Per table, the rows to copy (for progress reports)."""
    gradient_steps: dict[str, int] = field(default_factory=dict)
    """Per half-precision table, its optimizer steps at T0 (seeds its rounding)."""


class CheckpointSource(Protocol):
    """What a checkpoint needs of a store (`EmbeddingStore` implements it).

    Between `begin_checkpoint` and `end_checkpoint` the store saves the T0 value of every row
    the checkpoint covers before a write changes it; each method takes the store's lock only
    for its own work, so other threads go on between pages.
    """

    def begin_checkpoint(self, incremental: bool) -> CheckpointPlan:
        """Flush and fix the checkpoint's moment T0; start saving pre-images.

        Raises:
            StoreClosedError: the store is closed.
            ConfigError: `incremental` without an earlier checkpoint from this handle.
        """

    def checkpoint_pages(self, table: str, batch_rows: int
                         ) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """Yield (ids scanned, ids, rows, found) pages of T0 rows in the store of record.

        The store's lock is taken only while one page is read.
        """

    def checkpoint_preimages(self, table: str
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The saved T0 rows of `table` (ids, rows, found), after its last page."""

    def end_checkpoint(self, dest: Path | None) -> None:
        """Stop saving pre-images; `dest` is the finished checkpoint, None after a failure."""


def take_checkpoint(source: CheckpointSource, dest: Path, *, step: int | None,
                    incremental: bool,
                    progress: Callable[[str, int, int], None] | None) -> Path:
    """Write a checkpoint of `source` to `dest` (see `EmbeddingStore.checkpoint`)."""
    dest = Path(dest)
    if dest.exists():
        raise StoreExistsError(f"{dest} exists; checkpoints never overwrite: choose a new name")
    plan = source.begin_checkpoint(incremental)
    _crash.point("checkpoint.begin")
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        make_dirs(dest.parent)  # new parents: their entries must survive with the checkpoint
        tmp.mkdir(mode=0o700)
        for spec in plan.specs:
            total = plan.rows[spec.name]
            with _bottom_backend(tmp, spec, plan.tiers, read_only=False) as target:
                deleted: list[np.ndarray] = []
                scanned = 0
                for n, ids, rows, found in source.checkpoint_pages(spec.name, BATCH_ROWS):
                    _write_batch(target, ids, rows, found, deleted)
                    _crash.point("checkpoint.page")
                    scanned += n
                    if progress is not None:
                        progress(spec.name, min(scanned, total), total)
                saved = source.checkpoint_preimages(spec.name)
                if saved is not None:
                    _write_batch(target, *saved, deleted)
                if not incremental:  # a full checkpoint opens as a store: its written ids
                    write_record(written_file(tmp, spec.name), spec.num_embeddings,
                                 target.ids())
            if incremental:
                _write_tombstones(tmp / f"{spec.name}.deleted",
                                  np.concatenate(deleted) if deleted else np.zeros(0, np.int64))
        body = manifest_body(plan.tiers, plan.specs, plan.gradient_steps)
        body["checkpoint"] = {"step": step, "kind": "incremental" if incremental else "full",
                              "parent": None if not incremental or plan.parent is None
                              else os.path.relpath(plan.parent.resolve(),
                                                   dest.parent.resolve())}
        write_manifest(tmp, body)
        _crash.point("checkpoint.before_publish")
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        source.end_checkpoint(None)
        raise
    source.end_checkpoint(dest)
    return dest


def _write_batch(target: Backend, ids: np.ndarray, rows: np.ndarray, found: np.ndarray,
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
    """Materialise the checkpoint `src` as a new store at `dest`.

    `src` is a full checkpoint, or the newest of a chain of incrementals.

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
    make_dirs(dest.parent)
    try:
        shutil.copytree(base, tmp, ignore=shutil.ignore_patterns(LOCK_NAME))  # not synced
        doc = read_manifest(tmp)
        tables = {t["name"]: TableSpec.from_json(t) for t in doc["tables"]}
        tiers = tuple(TierSpec.from_json(t) for t in doc["tiers"])
        for path, inc in reversed(chain[:-1]):  # oldest increment first
            _apply_increment(tmp, path, inc, tables, tiers)
        for spec in tables.values():  # the rows now stored are the written ones
            with _bottom_backend(tmp, spec, tiers, read_only=True) as bottom:
                write_record(written_file(tmp, spec.name), spec.num_embeddings, bottom.ids())
        doc.pop("format"), doc.pop("version")
        doc["restored_from"] = {"checkpoint": str(Path(src)), "step": chain[0][1]["checkpoint"]
                                ["step"]}
        doc.pop("gradient_steps", None)
        if chain[0][1].get("gradient_steps"):  # the newest checkpoint's counts
            doc["gradient_steps"] = chain[0][1]["gradient_steps"]
        doc.pop("checkpoint", None)
        write_manifest(tmp, doc)
        fsync_tree(tmp)  # the copied files and their directory entries, before publishing
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _bottom_backend(root: Path, spec: TableSpec, tiers: tuple[TierSpec, ...], read_only: bool
                    ) -> Backend:
    """The store of record of table `spec` in the store or checkpoint at `root`."""
    ts = table_chain(spec, tiers)[-1]
    cls: type[Backend] = registry.load_backend(ts.backend)
    return cls.open(BackendSpec(path=bottom_dir(root, spec, tiers), dim=spec.storage_width,
                                dtype=spec.storage_dtype, table=spec.name, read_only=read_only),
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
    write_manifest(root, manifest_body(tiers, list(tables.values())))
