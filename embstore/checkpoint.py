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

Every checkpoint's manifest also holds a seal (`checkpoint_seal`): a random id, its parent's
id, and per table the number of rows it stores with the sum of their row checksums and the
number and CRC-32C of its tombstones. `restore` checks each link of a chain against it, so a
missing, truncated or changed file, a parent that is another store's or another checkpoint's,
or files swapped between checkpoints are refused rather than restored.

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
import stat
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from . import _crash, registry
from ._private_dir import discard, io_error, make_private, plain_path, publish
from ._written import write_record
from .backend import Backend, BackendSpec
from .checksum import crc32c, row_checksums
from .errors import (
    ConfigError,
    CorruptStoreError,
    EmbstoreError,
    StorageIOError,
    StoreExistsError,
    StoreNotFoundError,
)
from .index import IdIndex
from .layout import (
    LOCK_NAME,
    bottom_dir,
    manifest_body,
    read_manifest,
    store_above,
    table_chain,
    write_manifest,
    written_file,
)
from .manifest import fsync_tree, write_atomic
from .spec import TableSpec, TierSpec

__all__ = ["CheckpointPlan", "CheckpointSource", "CopyState", "restore"]

TOMB_MAGIC = b"EMBSTOMB"
TOMB_HEADER = struct.Struct("<8sQI4x")
BATCH_ROWS = 65536


def _write_tombstones(file: Path, ids: np.ndarray) -> None:
    ids = np.ascontiguousarray(ids, dtype="<i8")
    write_atomic(file, TOMB_HEADER.pack(TOMB_MAGIC, len(ids), crc32c(ids)) + ids.tobytes())


def _read_tombstones(file: Path) -> np.ndarray:
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise CorruptStoreError(f"{file} is missing: the checkpoint is not complete; restore "
                                "from an earlier one") from None
    if len(data) < TOMB_HEADER.size or (len(data) - TOMB_HEADER.size) % 8:
        raise CorruptStoreError(f"{file}: truncated tombstone file; the checkpoint is damaged: "
                                "restore from an earlier one")
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

    def changes_to_keep(self, current: dict[str, IdIndex] | None
                        ) -> dict[str, IdIndex] | None:
        """After a failed checkpoint: the store's `current` change sets with `previous` added.

        In new sets, not `current` changed in place: an interrupt while they are built
        leaves the store's own change sets as they were.
        """
        if current is None or self.previous is None:
            return current
        kept = {}
        for name, changed in current.items():
            before = self.previous.get(name)
            ids = np.zeros(0, np.int64) if before is None else before.items()[0]
            if len(ids):
                changed_too = changed
                changed = IdIndex()
                changed.add(ids)
                changed.add(changed_too.items()[0])
            kept[name] = changed
        return kept

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
    parent_id: str | None = None
    """The seal id `parent` was written with (None: not known)."""


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

    def end_checkpoint(self, dest: Path | None, seal_id: str | None = None) -> None:
        """Stop saving pre-images; `dest` is the finished checkpoint, None after a failure.

        `seal_id`: the finished checkpoint's seal id, the parent id of the next incremental.

        Does nothing where no checkpoint is begun: after a failed `begin_checkpoint`, or a
        second time.
        """


def _as_path(value: object, what: str) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str) \
            or not os.fspath(value):
        raise ConfigError(f"{what} must be a path (str or os.PathLike), got {value!r}")
    if "\0" in os.fspath(value):
        raise ConfigError(f"{what} {os.fspath(value)!r} holds a NUL byte, which no file name "
                          "can")
    return Path(value)


def _check_step(step: object) -> None:
    if step is not None and (isinstance(step, (bool, np.timedelta64))
                             or not isinstance(step, (int, np.integer)) or not 0 <= step < 2**63):
        raise ConfigError(f"step must be None or an int from 0 to 2**63 - 1 (the training "
                          f"step), got {step!r}")


def _check_new(dest: Path, what: str) -> None:
    """Refuse a `dest` that exists or lies inside a store or checkpoint directory.

    Raises:
        StoreExistsError: `dest` exists.
        ConfigError: a directory above `dest` holds a store or checkpoint, whose rewrites
            would drop it and whose checks would find it foreign.
    """
    try:
        there = dest.exists() or dest.is_symlink()
        above = store_above(dest)
    except OSError as exc:  # a name too long, a file above it: the OS refuses the path
        raise io_error(exc, dest, "make") from exc
    if there:
        raise StoreExistsError(f"{dest} exists; {what} never overwrites: choose a new path")
    if above is not None:
        raise ConfigError(f"{dest} lies inside the store or checkpoint {above}; {what} goes to "
                          "a directory of its own beside it, e.g. ckpt/100")


def _digest(ids: np.ndarray, rows: np.ndarray) -> int:
    """Sum (mod 2**64) of the rows' checksums over (id, row): independent of their order."""
    if not len(ids):
        return 0
    return int(row_checksums(np.ascontiguousarray(ids),
                             np.ascontiguousarray(rows)).sum(dtype=np.uint64))


def take_checkpoint(source: CheckpointSource, dest: str | os.PathLike[str], *,
                    step: int | None,
                    incremental: bool,
                    progress: Callable[[str, int, int], None] | None) -> Path:
    """Write a checkpoint of `source` to `dest` (see `EmbeddingStore.checkpoint`).

    Raises:
        ConfigError: `dest` is no path or lies inside a store or checkpoint; `step` is not
            None or an int >= 0; `incremental` is not a bool.
        StoreExistsError: `dest` exists.
        StorageIOError: `dest` cannot be made or written; nothing is left of it.
    """
    dest = _as_path(dest, "the checkpoint's destination")
    _check_step(step)
    if not isinstance(incremental, bool):
        raise ConfigError(f"incremental must be True or False, got {incremental!r}")
    if progress is not None and not callable(progress):
        raise ConfigError(f"progress must be None or a callable (table, done, total), got "
                          f"{progress!r}")
    _check_new(dest, "a checkpoint")
    tmp, made = make_private(dest, StorageIOError)
    try:
        plan = source.begin_checkpoint(incremental)
        _crash.point("checkpoint.begin")
        seal: dict[str, Any] = {}
        for spec in plan.specs:
            total = plan.rows[spec.name]
            stored, digest = 0, 0
            with _bottom_backend(tmp, spec, plan.tiers, read_only=False) as target:
                deleted: list[np.ndarray] = []
                scanned = 0
                for n, ids, rows, found in source.checkpoint_pages(spec.name, BATCH_ROWS):
                    k, h = _write_batch(target, ids, rows, found, deleted)
                    stored, digest = stored + k, (digest + h) % 2**64
                    _crash.point("checkpoint.page")
                    scanned += n
                    if progress is not None:
                        progress(spec.name, min(scanned, total), total)
                saved = source.checkpoint_preimages(spec.name)
                if saved is not None:
                    k, h = _write_batch(target, *saved, deleted)
                    stored, digest = stored + k, (digest + h) % 2**64
                if not incremental:  # a full checkpoint opens as a store: its written ids
                    write_record(written_file(tmp, spec.name), spec.num_embeddings,
                                 target.ids())
            dead = np.concatenate(deleted) if deleted and incremental else np.zeros(0, np.int64)
            if incremental:
                _write_tombstones(tmp / f"{spec.name}.deleted", dead)
            seal[spec.name] = {"rows": stored, "digest": digest, "deleted": len(dead),
                               "deleted_crc": crc32c(np.ascontiguousarray(dead, dtype="<i8"))}
        body = manifest_body(plan.tiers, plan.specs, plan.gradient_steps)
        body["checkpoint"] = {"step": None if step is None else int(step),
                              "kind": "incremental" if incremental else "full",
                              "parent": None if not incremental or plan.parent is None
                              else os.path.relpath(os.path.realpath(plan.parent),
                                                   os.path.realpath(dest.parent))}
        parent_id = None
        if incremental and plan.parent is not None:
            try:
                parent_doc = read_manifest(plan.parent)
            except StoreNotFoundError:
                raise ConfigError(
                    f"the checkpoint {plan.parent} this incremental one would follow is gone "
                    "(moved or removed); take a full checkpoint") from None
            parent_id = (parent_doc.get("checkpoint_seal") or {}).get("id")
            if plan.parent_id is not None and parent_id != plan.parent_id:
                # another checkpoint put in its place (another store's, or a later one of
                # the same path): linked to it, a restore would materialise its rows
                raise ConfigError(
                    f"the checkpoint {plan.parent} this incremental one would follow was "
                    "replaced by another since it was taken; take a full checkpoint")
        seal_id = uuid.uuid4().hex
        body["checkpoint_seal"] = {"id": seal_id, "parent_id": parent_id, "tables": seal}
        write_manifest(tmp, body)
        _crash.point("checkpoint.before_publish")
        publish(tmp, dest, "the checkpoint")
        # the parent of the next incremental one, by a path a later chdir leaves right
        source.end_checkpoint(plain_path(dest), seal_id)
    except BaseException as exc:
        # also where begin_checkpoint failed or end_checkpoint(dest) was cut short: ending
        # an ended or never begun checkpoint does nothing
        discard(tmp, made)
        source.end_checkpoint(None)
        if isinstance(exc, OSError) and not isinstance(exc, EmbstoreError):
            raise io_error(exc, dest, "write") from exc
        raise
    return dest


def _write_batch(target: Backend, ids: np.ndarray, rows: np.ndarray, found: np.ndarray,
                 deleted: list[np.ndarray]) -> tuple[int, int]:
    """Store the found rows, note the others as deleted; returns (rows stored, their digest)."""
    n, digest = 0, 0
    if found.any():
        kept, rows = np.ascontiguousarray(ids[found]), np.ascontiguousarray(rows[found])
        target.put(kept, rows)
        n, digest = len(kept), _digest(kept, rows)
    if not found.all():
        deleted.append(ids[~found])
    return n, digest


def checkpoint_chain(src: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The checkpoints from `src` back to its full base: [(path, manifest)], newest first.

    Raises:
        ConfigError: `src` is a store, not a checkpoint.
        CorruptStoreError: a parent is missing, or is not the checkpoint its child was
            taken after (another store's, or another checkpoint put in its place).
    """
    chain: list[tuple[Path, dict[str, Any]]] = []
    path = Path(src)
    seen = set()
    while True:
        doc = read_manifest(path)
        info = doc.get("checkpoint")
        if info is None:
            raise ConfigError(f"{path} is a store, not a checkpoint")
        _check_link(path, doc, info)
        if chain:
            want = (chain[-1][1].get("checkpoint_seal") or {}).get("parent_id")
            have = (doc.get("checkpoint_seal") or {}).get("id")
            if want is not None and want != have:
                raise CorruptStoreError(
                    f"{chain[-1][0]}: its parent {path} is not the checkpoint it was taken "
                    "after (another store's, or another checkpoint put in its place); put the "
                    "right one back or restore another checkpoint")
        chain.append((path, doc))
        if info["kind"] == "full":
            return chain
        parent = _parent_path(path, info["parent"])
        if parent in seen or not parent.exists():
            raise CorruptStoreError(f"{path}: its parent checkpoint {parent} is missing")
        seen.add(parent)
        path = parent


def _parent_path(path: Path, parent: str) -> Path:
    """Where the parent `parent` (a path relative to the folder of checkpoint `path`) lies.

    Relative to the folder the checkpoint was written in, where `path` is a link to it
    (a `latest` link elsewhere), and else to the link's folder: a chain put together from
    links beside each other.
    """
    # os.path.realpath, not Path.resolve, which raises RuntimeError on a link loop
    real = Path(os.path.realpath(Path(os.path.realpath(path)).parent / parent))
    return real if real.exists() else Path(os.path.realpath(path.parent / parent))


def _check_link(path: Path, doc: dict[str, Any], info: Any) -> None:
    """Refuse a checkpoint whose manifest's checkpoint fields do not hold together.

    Raises:
        CorruptStoreError: an incremental with no parent's path, no tiers, tables that are
            not named objects, or a seal whose tables are not the manifest's (or not objects).
    """
    problem = None  # (`read_manifest` checked the kind and step)
    parent = info.get("parent")
    tables = doc.get("tables")
    seal = doc.get("checkpoint_seal")
    sealed = seal.get("tables") if isinstance(seal, dict) else None
    if info["kind"] == "incremental" and not (isinstance(parent, str) and parent
                                              and "\0" not in parent):
        problem = "an incremental checkpoint names no parent"
    elif not doc.get("tiers"):
        problem = "it names no tiers"
    elif not isinstance(tables, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in tables):
        problem = "its list of tables is damaged"
    elif seal is not None and (
            not isinstance(sealed, dict) or set(sealed) != {t["name"] for t in tables}
            or not all(isinstance(v, dict) for v in sealed.values())):
        problem = "its tables are not those its seal lists"
    if problem is not None:
        raise CorruptStoreError(f"{path}: {problem}; the manifest is damaged: restore "
                                "another checkpoint")


def restore(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Materialise the checkpoint `src` as a new store at `dest`.

    `src` is a full checkpoint, or the newest of a chain of incrementals. Every link is
    checked against its seal (rows, their checksums, tombstones, parent) before `dest`
    appears.

    Raises:
        StoreExistsError: `dest` exists.
        ConfigError: `src` or `dest` is no path; `dest` lies inside a store or checkpoint.
        CorruptStoreError: a checkpoint of the chain is missing, damaged or mismatched.
        StorageIOError: `dest` cannot be made or written; nothing is left of it.
    """
    src = _as_path(src, "the checkpoint to restore")
    dest = _as_path(dest, "the restored store's path")
    _check_new(dest, "a restore")
    try:
        chain = checkpoint_chain(src)
    except OSError as exc:
        if isinstance(exc, EmbstoreError):
            raise
        raise io_error(exc, src, "read the checkpoint") from exc  # the OS refused the path
    base = chain[-1][0]
    tmp, made = make_private(dest, StorageIOError)
    try:
        _copy_base(base, tmp)  # not synced
        doc = read_manifest(tmp)
        tables = {t["name"]: TableSpec.from_json(t) for t in doc["tables"]}
        tiers = tuple(TierSpec.from_json(t) for t in doc["tiers"])
        base_ids: dict[str, np.ndarray] = {}
        for spec in tables.values():  # the seal's check reads every row of the base once
            with _checkpoint_rows(base, tmp, spec, tiers) as bottom:
                stored, digest, seen = 0, 0, []
                for ids, rows in bottom.items(BATCH_ROWS):
                    stored, digest = stored + len(ids), (digest + _digest(ids, rows)) % 2**64
                    if len(chain) == 1:  # no increment follows: these are the written ids
                        seen.append(ids)
            _check_sealed(base, doc, spec.name, stored, digest, np.zeros(0, np.int64))
            base_ids[spec.name] = np.concatenate(seen) if seen else np.zeros(0, np.int64)
        for path, inc in reversed(chain[:-1]):  # oldest increment first
            _apply_increment(tmp, path, inc, tables, tiers)
        for spec in tables.values():  # the rows now stored are the written ones
            if len(chain) == 1:  # the base's, as its scan listed them
                write_record(written_file(tmp, spec.name), spec.num_embeddings,
                             base_ids[spec.name])
                continue
            with _bottom_backend(tmp, spec, tiers, read_only=True) as bottom:
                write_record(written_file(tmp, spec.name), spec.num_embeddings, bottom.ids())
        doc.pop("format"), doc.pop("version")
        doc["restored_from"] = {"checkpoint": str(Path(src)), "step": chain[0][1]["checkpoint"]
                                ["step"]}
        doc.pop("gradient_steps", None)
        if chain[0][1].get("gradient_steps"):  # the newest checkpoint's counts
            doc["gradient_steps"] = chain[0][1]["gradient_steps"]
        doc.pop("checkpoint", None)
        doc.pop("checkpoint_seal", None)
        write_manifest(tmp, doc)
        fsync_tree(tmp)  # the copied files and their directory entries, before publishing
        publish(tmp, dest, "the restore")
    except BaseException as exc:
        discard(tmp, made)
        if isinstance(exc, OSError) and not isinstance(exc, EmbstoreError):
            raise io_error(exc, dest, "write") from exc
        raise
    return dest


def _copy_base(base: Path, tmp: Path) -> None:
    """Copy the full checkpoint `base` into the empty directory `tmp`, without syncing.

    Only folders and regular files, as a checkpoint holds (lock files left out: each open
    makes its own). Not `shutil.copytree`, which gathers every failure into one
    `shutil.Error` with no errno, so a full disk read as "Error", and which follows links
    and blocks on a pipe put in a file's place.

    Raises:
        CorruptStoreError: `base` holds a link, a device or a pipe, or a file it cannot read.
        OSError: `tmp` cannot be written (a full disk), with its errno.
    """
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        for name in sorted(dirnames + filenames):
            src = here / name
            dst = tmp / src.relative_to(base)
            if name == LOCK_NAME:
                dirnames[:] = [d for d in dirnames if d != name]
                continue
            try:
                fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:  # a link (ELOOP), or a file the OS will not let us read
                raise _not_copied(base, src, exc.strerror or str(exc)) from exc
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISDIR(mode):
                    dst.mkdir(mode=0o700)
                elif not stat.S_ISREG(mode):
                    raise _not_copied(base, src, "not a regular file")
                else:
                    # 0600 as the store's own files, whatever the checkpoint's (one made
                    # read-only to keep it would give a restored store it cannot write)
                    fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                     0o600)
                    with open(fd_out, "wb") as out:
                        while True:
                            try:
                                chunk = os.read(fd, 1 << 20)
                            except OSError as exc:
                                raise _not_copied(base, src, exc.strerror or str(exc)
                                                  ) from exc
                            if not chunk:
                                break
                            out.write(chunk)
            finally:
                os.close(fd)


def _not_copied(base: Path, src: Path, why: str) -> CorruptStoreError:
    return CorruptStoreError(f"{base}: cannot copy {src} ({why}); a checkpoint holds only "
                             "folders and regular files: the checkpoint is damaged: restore "
                             "another one")


def _check_sealed(where: Path, doc: dict[str, Any], table: str, stored: int, digest: int,
                  dead: np.ndarray) -> None:
    """Refuse a table of checkpoint `where` whose rows or tombstones differ from its seal.

    Checkpoints written before seals existed have none and are taken as they are.

    Raises:
        CorruptStoreError: the rows stored, their checksums or the tombstones differ.
    """
    seal = doc.get("checkpoint_seal")
    if seal is None:
        return
    want = (seal.get("tables") or {}).get(table)
    have = {"rows": stored, "digest": digest, "deleted": len(dead),
            "deleted_crc": crc32c(np.ascontiguousarray(dead, dtype="<i8"))}
    if want != have:
        raise CorruptStoreError(
            f"{where}: table {table!r} does not hold what the checkpoint stored ({stored} rows "
            f"and {len(dead)} deletions found, its manifest records "
            f"{None if want is None else (want.get('rows'), want.get('deleted'))} with other "
            "checksums): files are missing, damaged or from another checkpoint, or the "
            "checkpoint was opened for writing and changed since it was taken (open "
            "checkpoints with read_only=True, or restore them, to train on); restore another "
            "checkpoint")


def _bottom_backend(root: Path, spec: TableSpec, tiers: tuple[TierSpec, ...], read_only: bool
                    ) -> Backend:
    """The store of record of table `spec` in the store or checkpoint at `root`."""
    ts = table_chain(spec, tiers)[-1]
    cls: type[Backend] = registry.load_backend(ts.backend)
    return cls.open(BackendSpec(path=bottom_dir(root, spec, tiers), dim=spec.storage_width,
                                dtype=spec.storage_dtype, table=spec.name, read_only=read_only),
                    **ts.options)


def _checkpoint_rows(where: Path, root: Path, spec: TableSpec, tiers: tuple[TierSpec, ...]
                     ) -> Backend:
    """The rows of `spec` in checkpoint `where` (read from its copy at `root`), read-only.

    Raises:
        CorruptStoreError: the checkpoint lacks the table's files.
    """
    try:
        return _bottom_backend(root, spec, tiers, read_only=True)
    except StoreNotFoundError as exc:
        raise CorruptStoreError(
            f"{where}: the rows of table {spec.name!r} are missing "
            f"({bottom_dir(where, spec, tiers).name} holds no "
            f"{table_chain(spec, tiers)[-1].backend} data); the checkpoint is not complete: "
            "restore another one") from exc


def _apply_increment(root: Path, inc_path: Path, inc: dict[str, Any],
                     tables: dict[str, TableSpec], tiers: tuple[TierSpec, ...]) -> None:
    # the increment's rows lie in its own layout: its base may have been migrated since
    inc_tiers = tuple(TierSpec.from_json(t) for t in inc["tiers"])
    for data in inc["tables"]:
        spec = TableSpec.from_json(data)
        known = tables.setdefault(spec.name, spec)
        if replace(known, tiers=None) != replace(spec, tiers=None):
            raise CorruptStoreError(f"{inc_path}: table {spec.name!r} differs from its parent's")
        with _bottom_backend(root, known, tiers, read_only=False) as target, \
                _checkpoint_rows(inc_path, inc_path, spec, inc_tiers) as delta:
            dead = _read_tombstones(inc_path / f"{spec.name}.deleted")
            stored, digest = 0, 0
            for ids, rows in delta.items(BATCH_ROWS):  # a mismatch below discards all of it
                target.put(ids, rows)
                stored, digest = stored + len(ids), (digest + _digest(ids, rows)) % 2**64
            _check_sealed(inc_path, inc, spec.name, stored, digest, dead)
            if len(dead):
                target.delete(dead)
    write_manifest(root, manifest_body(tiers, list(tables.values())))
