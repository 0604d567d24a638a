"""`embstore.open`: create, reopen and lock a store from its directory and manifest."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import _counters, _written, layout
from ._access_log import AccessRecorder, check_rates
from ._build import check_ignored_settings
from ._kept import recover_swap
from ._private_dir import io_error
from ._rebuild import check_path
from .errors import (
    ConfigError,
    CorruptStoreError,
    EmbstoreError,
    ReadOnlyError,
    StorageIOError,
    StoreNotFoundError,
)
from .layout import LOCK_NAME, MANIFEST_NAME, read_manifest, write_manifest
from .manifest import make_dirs, read_bytes_nofollow
from .placement import apply_placement
from .spec import TableSpec, TierSpec
from .store import DEFAULT_TIERS, EmbeddingStore

__all__ = ["open"]


def _ours(entry: Path) -> bool:
    """Whether `entry` is one a store's creation makes before it writes the manifest."""
    return entry.name != MANIFEST_NAME and layout.is_store_entry(entry.name)


def _sign_of_use(directory: Path, leftovers: set[Path]) -> str | None:
    """Why `leftovers` (a directory without a manifest) are a store that was in use, if so.

    The manifest is written last when a store is made, and no write is acknowledged before
    it: what a creation cut short leaves holds no counters of a close and no written id. A
    store with either lost its manifest, and making a new one there would delete its rows.
    """
    if directory / _counters.STATS_NAME in leftovers:
        return f"{_counters.STATS_NAME}, which a store writes when it closes"
    records = directory / layout.WRITTEN_DIR
    if records not in leftovers or not records.is_dir() or records.is_symlink():
        return None
    for file in sorted(records.iterdir()):
        try:
            raw = read_bytes_nofollow(file, 1 << 40)
        except (OSError, CorruptStoreError):
            return f"{file}, which it cannot read"
        if file.suffix == ".del" and raw:
            return f"{file}, a journal of deleted rows"
        if file.suffix == ".ids":
            held = len(raw) < _written.BODY_OFFSET or raw[:8] != _written.MAGIC or (
                any(raw[_written.BODY_OFFSET:]))  # ids in a list, or bits set in a bitmap
            if held:
                return f"{file}, a record of rows written"
    return None


def _check_unique(specs: list[TableSpec]) -> None:
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"table names must be unique, {sorted(dup)} given more than once")


def open(path: str | os.PathLike[str] | None, tables: list[TableSpec] | None = None,
         tiers: list[TierSpec] | None = None, *, read_only: bool = False,
         placement: str | os.PathLike[str] | dict[str, Any] | None = None,
         record_accesses: str | os.PathLike[str] | None = None,
         record_sample: float | Mapping[str, float] = 1.0) -> EmbeddingStore:
    """Open or create a store.

    Args:
        path: the store's directory, or None for an in-memory store of DRAM tiers.
        tables: table specs. Required to create a store; on reopen, tables already in the
            manifest must be given exactly as stored, and new ones are added.
        tiers: the default tier chain, top first (default: one DRAM tier). Fixed at creation.
        read_only: open without write access and without the store's lock, beside a writer
            in another process if one holds the store: writes raise ReadOnlyError, and the
            store reads what that writer's last flush left (see `EmbeddingStore`).
        placement: a placement (path or dict, from `embstore plan`) giving tables their tier
            chains; see `embstore.placement.apply_placement`.
        record_accesses: a directory to log each table's batches of ids to (an access log,
            appended to if it exists), which `embstore profile DIR` reads; closed with the
            store. See `embstore._access_log` for the format and what a batch is.
        record_sample: the share of ids the log keeps (SHARDS spatial sampling by id hash,
            so the miss-ratio curves stay estimable), for all tables or per table (others:
            1.0). 1.0 logs every id (8 bytes each); 0.01-0.1 suits long runs on large
            tables, keeping a few thousand distinct ids a table or more.

    Raises:
        StoreNotFoundError: no store at `path` and no tables to create one, or `path` is a file
            or a directory of other files.
        StoreLockedError: (writers only) another process or handle holds the store for
            writing; the error names its pid. Or another store is recording to
            `record_accesses`.
        ConfigError: invalid specs, or specs that contradict the manifest; a bad
            `record_sample` or a `record_accesses` path that is no access log or directory.
        CorruptStoreError: the manifest or a tier's files are damaged.
    """
    attach: Callable[[EmbeddingStore], None] | None = None
    if record_accesses is not None:
        check_rates(record_sample)  # before a store is created for nothing
        _check_log_outside(path, record_accesses)
        log = record_accesses

        def attach(store: EmbeddingStore) -> None:
            store._attach_recorder(AccessRecorder(log, store.tables, record_sample))

    return _open(path, tables, tiers, read_only, placement, attach)


def _check_log_outside(path: str | os.PathLike[str] | None, log: object) -> None:
    """Refuse an access log inside the store's directory, which rewrites would drop.

    Raises:
        ConfigError: `log` lies in the store's directory.
    """
    if not isinstance(path, (str, os.PathLike)) or not isinstance(log, (str, os.PathLike)):
        return  # no store directory, or a log that is no path (AccessRecorder says so)
    store, where = Path(path).resolve(), Path(log).resolve()
    if where == store or store in where.parents:
        raise ConfigError(f"record_accesses={str(log)!r} lies inside the store {str(path)!r}, "
                          "whose rewrites (compact, migrate, repair) would drop it; record "
                          "beside the store, e.g. runs/ctr-log")


def _specs_list(given: Any, kind: type, what: str) -> list[Any]:
    """`given` (tables= or tiers=) as a list, or ConfigError naming what was given instead."""
    if given is None:
        return []
    if isinstance(given, (kind, str, bytes, Mapping)):
        raise ConfigError(f"{what} must be a list of embstore.{kind.__name__}, got "
                          f"{type(given).__name__}"
                          + (f"; wrap one: {what}=[...]" if isinstance(given, kind) else ""))
    try:
        return list(given)
    except TypeError as exc:
        raise ConfigError(f"{what} must be a list of embstore.{kind.__name__}, got "
                          f"{type(given).__name__}") from exc


def _check_new(specs: list[TableSpec], chain: tuple[TierSpec, ...]) -> None:
    """The checks of what a user gives for new tables and a new store's default `chain`."""
    check_ignored_settings(chain)
    for spec in specs:
        spec.check_initial_values()
        spec.optimizer.check_dtype(spec.name, spec.dtype)
        check_ignored_settings(spec.tiers or ())


def _open(path: str | os.PathLike[str] | None, tables: list[TableSpec] | None,
          tiers: list[TierSpec] | None, read_only: bool,
          placement: str | os.PathLike[str] | dict[str, Any] | None,
          attach: Callable[[EmbeddingStore], None] | None) -> EmbeddingStore:
    """`open`, with `attach(store)` run before a new store's manifest is written.

    A failure in `attach` closes the store and undoes a create, as any other failure does.
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a str, an os.PathLike or None (in memory), got "
                          f"{type(path).__name__}" + ("; decode it first" if isinstance(
                              path, bytes) else ""))
    if not isinstance(read_only, bool):  # "no" is truthy: it would open read-only
        raise ConfigError(f"read_only must be True or False, got {read_only!r}")
    specs = _specs_list(tables, TableSpec, "tables")
    if not all(isinstance(s, TableSpec) for s in specs):
        raise ConfigError("tables must be a list of embstore.TableSpec")
    _check_unique(specs)
    if placement is not None:
        specs = apply_placement(specs, placement)
    tier_specs = tuple(_specs_list(tiers, TierSpec, "tiers")) if tiers is not None else None
    if tier_specs is not None and (not tier_specs
                                   or not all(isinstance(t, TierSpec) for t in tier_specs)):
        raise ConfigError("tiers must be a non-empty list of embstore.TierSpec")

    if path is None:
        if read_only:
            raise ConfigError("an in-memory store cannot be read-only")
        if not specs:
            raise ConfigError("an in-memory store needs tables=[TableSpec(...)]")
        _check_new(specs, tier_specs or ())
        memory = EmbeddingStore(None, specs, tier_specs or DEFAULT_TIERS, read_only=False,
                                lock_fd=None)
        try:
            if attach is not None:
                attach(memory)
        except BaseException:
            memory.close()
            raise
        return memory

    directory = _store_path(path)
    try:
        return _open_directory(directory, specs, tier_specs, read_only, attach)
    except OSError as exc:
        if isinstance(exc, EmbstoreError):
            raise
        # the OS's own refusal of the path (a file above it, a name too long, a read-only
        # file system): a StorageIOError naming it, and the file within it that failed
        error = io_error(exc, directory, "open the store at")
        if exc.filename is not None and Path(os.fsdecode(exc.filename)) != directory:
            error = StorageIOError(exc.errno, f"{error.strerror} ({os.fsdecode(exc.filename)})")
        raise error from exc


def _store_path(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path, or ConfigError where no file system could hold it."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise ConfigError(f"path must name a str path, got {type(text).__name__}; decode it "
                          "first")
    if "\0" in text:
        raise ConfigError(f"path {text!r} holds a NUL byte, which no file name can")
    return Path(text)


def _open_directory(directory: Path, specs: list[TableSpec],
                    tier_specs: tuple[TierSpec, ...] | None, read_only: bool,
                    attach: Callable[[EmbeddingStore], None] | None) -> EmbeddingStore:
    """`_open` of the store in `directory` (created where it holds none and specs are given)."""
    if not read_only:  # a compact or migrate killed between its two renames; readers write nothing
        recover_swap(directory)
    if directory.exists() and not directory.is_dir():
        raise StoreNotFoundError(f"{directory} is a file, not a store directory")
    exists = (directory / MANIFEST_NAME).exists()
    if not exists:
        try:
            leftovers = ({p for p in directory.iterdir() if p.name != LOCK_NAME}
                         if directory.exists() else set())
        except OSError as exc:
            raise io_error(exc, directory, "list") from None
        used = _sign_of_use(directory, leftovers)
        if used is not None:
            raise CorruptStoreError(
                f"{directory} holds a store that was in use ({used}) but no {MANIFEST_NAME}: "
                "its manifest was removed or lost. Nothing was changed; restore the store "
                "from a checkpoint, or open another directory to make a new one")
        if not specs or read_only:
            read_manifest(directory)  # raises StoreNotFoundError with the reason
        if not all(_ours(p) for p in leftovers):
            raise StoreNotFoundError(
                f"{directory} holds files but no {MANIFEST_NAME}: it is not an embstore store; "
                "choose an empty or new directory"
            )
        layout.refuse_inside_store(directory, "make the new store in a directory beside it")
        before = set(directory.iterdir()) - leftovers if directory.exists() else None
        make_dirs(directory, 0o700)
    # a reader takes no lock: it reads beside a writer (see EmbeddingStore's docstring)
    lock_fd = None if read_only else layout.lock(directory, read_only=False)
    try:
        if not exists:
            # what a creation cut short by a crash left: its manifest, written last, is
            # missing, so no write was ever acknowledged in it
            for entry in leftovers:
                (shutil.rmtree if entry.is_dir() and not entry.is_symlink() else os.unlink)(entry)
        if exists:
            doc = read_manifest(directory)
            if (doc.get("checkpoint") or {}).get("kind") == "incremental":
                raise ConfigError(
                    f"{directory} is an incremental checkpoint (only changed rows); materialise "
                    "it with embstore.restore(src, new_path) and open that"
                )
            stored_tiers, stored = layout.parse_manifest(directory, doc)
            if tier_specs is not None and tier_specs != stored_tiers:
                raise ConfigError(
                    f"{directory} was created with tiers {stored_tiers}; a store's default chain "
                    "is fixed at creation: omit tiers= or export/import into a new store"
                )
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
        # new tables and chains only: stored ones opened before these checks
        _check_new(added, tier_specs if not exists and tier_specs else ())
        if not read_only:
            check_path(directory, all_specs, chain)
        store = EmbeddingStore(directory, all_specs, chain, read_only=read_only, lock_fd=lock_fd,
                               gradient_steps=steps)
    except BaseException:
        if not exists:
            _undo_create(directory, before)
        if lock_fd is not None:
            layout.release(lock_fd)
        raise
    try:
        if attach is not None:  # before the manifest: a store whose log fails is not made
            attach(store)
        if added:  # the stored fields kept (step counts, a restore's origin), tables added
            write_manifest(directory, {**(doc if exists else {}),
                                       **layout.manifest_body(chain, all_specs, steps)})
    except BaseException:
        store.close()  # releases the lock: the caller may try again in this process
        if not exists:
            _undo_create(directory, before)
        raise
    return store


def _undo_create(directory: Path, before: set[Path] | None) -> None:
    """Leave the directory of a failed create as it was found (`before`: None if absent)."""
    for entry in directory.iterdir():
        if before is None or entry not in before:
            (shutil.rmtree if entry.is_dir() else os.unlink)(entry)
    if before is None:
        directory.rmdir()
