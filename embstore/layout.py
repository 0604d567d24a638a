"""The store directory's layout: where each tier's files go, what the manifest holds, the lock.

Every module that reads or writes a store's directory asks this one (opening a store, its
checkpoints, restore), so the names below are written in one place:

    <store>/
        MANIFEST.json                 format, version, default tiers, tables, gradient steps
                                      of half-precision tables (`manifest_body`)
        LOCK                          flock: exclusive for a writer (`lock`), which writes its
                                      pid into it; shared for export and fsck; read-only
                                      opens take none
        tier<level>-<backend>/        the store of record of every table whose chain ends there
        cache/tier<level>-<backend>/  cache tiers that need files; emptied on open
        written/<table>.ids           the written-id record of a table (`embstore._written`)

Directories are created 0700 and files 0600; the lock file names the pid of its holder.

A checkpoint adds `checkpoint` to the manifest (and `<table>.deleted` files when incremental).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import (
    ConfigError,
    CorruptStoreError,
    StorageIOError,
    StoreLockedError,
    StoreNotFoundError,
)
from .manifest import (
    FORMAT,
    MANIFEST_NAME,
    read_manifest,
    write_manifest,
)
from .spec import TableSpec, TierSpec

__all__ = ["LOCK_NAME", "MANIFEST_NAME", "bottom_dir", "check_inside", "foreign_entries",
           "is_store_entry", "lock", "lock_for_reading", "manifest_body", "parked_store",
           "process_alive", "read_manifest", "refuse_inside_store", "release",
           "remove_dead_owned", "store_above", "table_chain", "tier_dir", "write_manifest",
           "written_file"]

LOCK_NAME = "LOCK"
CACHE_DIR = "cache"
WRITTEN_DIR = "written"


def written_file(root: Path, table: str) -> Path:
    """The written-id record of table `table` in the store rooted at `root`."""
    return root / WRITTEN_DIR / f"{table}.ids"


def parse_manifest(directory: Path, doc: dict[str, Any]
                   ) -> tuple[tuple[TierSpec, ...], list[TableSpec]]:
    """The default tiers and tables of a manifest that passed its checksum.

    Raises:
        CorruptStoreError: a field is missing, empty where it cannot be, or of the wrong
            kind (a manifest written by hand or by a foreign tool).
    """
    try:
        for raw in [*doc["tiers"], *(t for spec in doc["tables"]
                                     for t in (spec.get("tiers") or []))]:
            for key in ("options", "eviction_options", "admission_options"):
                if not isinstance(raw.get(key, {}), dict):
                    raise TypeError(f"a tier's {key} must be an object, got {raw[key]!r}")
        tiers = tuple(TierSpec.from_json(t) for t in doc["tiers"])
        tables = [TableSpec.from_json(t) for t in doc["tables"]]
        if not tiers:
            raise ValueError("the default tier chain is empty")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names are given twice: {sorted(names)}")
        listed = doc.get("written_records", [])
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise TypeError(f"written_records must be a list of table names, got {listed!r}")
        stray = sorted(set(listed) - {t.name for t in tables})
        if stray:  # tables dropped from the list, their rows still on disk
            raise ValueError(f"written-id records are listed for tables {stray} that the "
                             "manifest does not have")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptStoreError(
            f"{directory / MANIFEST_NAME} passes its checksum but does not describe a store "
            f"({type(exc).__name__}: {exc}); restore it from a checkpoint") from exc
    return tiers, tables


def tier_dir(root: Path, level: int, backend: str, *, is_bottom: bool) -> Path:
    """The directory of tier `level` (backend `backend`) of a store rooted at `root`.

    Caches live apart from the store of record, so that a crash's unflushed cache rows never
    shadow the bottom tier's on the next open.
    """
    name = f"tier{level}-{backend}"
    return root / name if is_bottom else root / CACHE_DIR / name


def parked_store(root: Path) -> Path:
    """Where a swap without an atomic exchange parks the old store between its two renames."""
    return root.parent / f".{root.name}.swap-old"


_PID_MAX = 1 << 22
"""Linux's largest pid_max: no process has a larger id (and os.kill would overflow)."""


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (under any user)."""
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_owned(parent: Path, owner: Callable[[str], int | None]) -> list[Path]:
    """Remove the directories in `parent` whose owning process is gone; returns them.

    `owner` gives the process id an entry's name carries, or None for an entry that is not
    such a directory. A killed command's scratch directory (a row dump, a private build) has
    nothing else to remove it; a live process's is its own.
    """
    removed: list[Path] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed  # no parent yet: nothing left there
    for name in names:
        pid = owner(name)
        entry = parent / name
        if (pid is not None and not process_alive(pid) and entry.is_dir()
                and not entry.is_symlink()):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


# a tier directory is tier<level>-<backend>, and a plugin's backend name may hold '-' or '.'
_STORE_ENTRY = re.compile(r"(LOCK|MANIFEST\.json|STATS\.json|cache|written|tier\d+-.+)"
                          r"(\.tmp)?")


def store_above(path: Path) -> Path | None:
    """The store or checkpoint directory that `path` lies inside, or None.

    What is written there is foreign to that store: its rewrites (compact, migrate, repair)
    would delete it.
    """
    # through links too: a link to a store's folder puts what is written there in the store
    written, real = Path(os.path.abspath(path)).parents, Path(os.path.realpath(path)).parents
    for p in dict.fromkeys([*written, *real]):  # each folder read once
        if is_store(p):
            return p
    return None


def refuse_inside_store(path: Path, advice: str, shown: str | None = None) -> None:
    """Refuse to write at `path` where it lies inside a store or checkpoint (`store_above`).

    What is written there is foreign to that store, whose rewrites would delete it.

    Raises:
        ConfigError: naming the store; `advice` ends the message, `shown` names `path`.
    """
    above = store_above(path)
    if above is not None:
        raise ConfigError(f"{path if shown is None else shown} lies inside the store or "
                          f"checkpoint {above}, whose rewrites would delete it; {advice}")


def require_directory(root: Path, *, links: bool) -> None:
    """Refuse `root` unless it is a directory (a link to one too, where `links`).

    Rewrites (compact, migrate) refuse links: they put the rebuilt store in place by renaming
    it, which would replace the link and leave the store it names as it was.

    Raises:
        StoreNotFoundError: saying what `root` is instead.
    """
    if root.is_symlink() and not links:
        raise StoreNotFoundError(
            f"{root} is a symbolic link (to {os.readlink(root)}): this rewrites a store by "
            "renaming its directory, which would replace the link; give the store's own path")
    if not root.exists():
        raise StoreNotFoundError(f"{root} does not exist"
                                 + (" (a broken symbolic link)" if root.is_symlink() else ""))
    if not root.is_dir():
        raise StoreNotFoundError(f"{root} is a file, not a store directory")


def is_store(directory: Path) -> bool:
    """Whether `directory` holds an embstore manifest (damaged or not), not another tool's."""
    try:
        with open(directory / MANIFEST_NAME, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    # written with sorted keys, a manifest names its format in its first lines (after the
    # checksum): read no further, so that a large or damaged file costs nothing
    return re.search(rb'"format":\s*"' + re.escape(FORMAT.encode()) + rb'"', head) is not None


def is_store_entry(name: str) -> bool:
    """Whether a store makes an entry of this name in its directory."""
    return _STORE_ENTRY.fullmatch(name) is not None


def foreign_entries(root: Path) -> list[str]:
    """Names in the store directory `root` that no store makes: files a user put there.

    Rewriting a store (compact, migrate, repair) builds a new directory and swaps it in, so
    whatever else lay in the old one would be deleted with it.
    """
    return sorted(p.name for p in root.iterdir() if not is_store_entry(p.name))


def check_inside(root: Path, path: Path) -> None:
    """Refuse a tier directory that is, or holds, a symbolic link, or lies outside `root`.

    The manifest names tables and backends, and from them the files a store opens; a link
    planted among them would make the store read or write a file elsewhere.

    Raises:
        CorruptStoreError: a symbolic link, or a path outside the store.
    """
    def refuse(what: str) -> CorruptStoreError:
        return CorruptStoreError(
            f"{what}: embstore opens only files inside the store directory {root}, never "
            "through a symbolic link; replace the link with the files themselves")

    for p in (path, *path.parents):
        if p == root or p in root.parents:
            break
        if p.is_symlink():
            raise refuse(f"{p} is a symbolic link")
    if not path.exists():
        return
    if not path.resolve().is_relative_to(root.resolve()):
        raise refuse(f"{path} lies outside the store")
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise refuse(f"{os.path.join(dirpath, name)} is a symbolic link")


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

    `written_records` names the tables whose written-id record must exist (embstore._written):
    once a manifest lists a table, a missing record is damage, not a new table.
    `gradient_steps` (per table, its count of optimizer steps, which seeds the stochastic
    rounding of half-precision tables) is recorded where given and not empty.
    """
    body: dict[str, Any] = {"tiers": [t.to_json() for t in default_tiers],
                            "tables": [s.to_json() for s in specs],
                            "written_records": sorted(s.name for s in specs)}
    if gradient_steps:
        body["gradient_steps"] = dict(gradient_steps)
    return body


def lock(root: Path, read_only: bool) -> int:
    """Take the store's lock (shared when `read_only`); returns the descriptor that holds it.

    Closing the descriptor releases the lock; a writer calls `release` instead, which also
    takes its pid out of the file. `embstore.open(path, read_only=True)` takes no lock at
    all (it reads beside a writer); a shared lock here is for the tools that need the store
    to hold still (export, fsck).

    Raises:
        StoreLockedError: another process or handle holds the store, named by its pid when
            a live writer holds it.
    """
    fd = _open_lock(root, os.O_RDWR | os.O_CREAT)
    _take(root, fd, read_only)
    if not read_only:
        # the holder's pid, for the error of the next one to try (not synced: only a hint)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def lock_for_reading(root: Path) -> int | None:
    """The store's shared lock, for a reader that wants the store to hold still.

    Returns None where the store has no lock file (no writer ever opened it): nothing is
    created.

    Raises:
        StoreLockedError: a writer holds the store (named by its pid where known).
    """
    try:
        fd = _open_lock(root, os.O_RDONLY)
    except FileNotFoundError:
        return None
    _take(root, fd, True)
    return fd


def _open_lock(root: Path, flags: int) -> int:
    """The descriptor of the store's lock file, opened with `flags` (never through a link).

    Raises:
        FileNotFoundError: there is none (and `flags` do not create it).
        CorruptStoreError: something other than a plain file lies at its name.
        StorageIOError: it cannot be opened (permissions, a full or failing disk).
    """
    file = root / LOCK_NAME

    def not_a_file(why: str) -> CorruptStoreError:
        return CorruptStoreError(f"{file} is not a plain file ({why}): a store's lock is a file "
                                 "of its own; remove what lies there (no embstore process "
                                 "holds it)")

    try:
        fd = os.open(file, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.ELOOP, errno.ENXIO):
            raise not_a_file(exc.strerror or "") from None
        raise StorageIOError(exc.errno, f"cannot open the store's lock {file}: "
                             f"{exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory opens read-only
        os.close(fd)
        raise not_a_file("a directory or a device")
    return fd


def release(fd: int) -> None:
    """Release a writer's lock taken with `lock(root, read_only=False)`, clearing its pid."""
    try:
        with contextlib.suppress(OSError):  # only a hint: closing releases the lock anyway
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _take(root: Path, fd: int, read_only: bool) -> None:
    """Flock `fd` without waiting; on failure close it and raise naming the holder."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if read_only else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        if holder == os.getpid():
            who = "a handle of this process holds it for writing"
        elif holder is not None:
            who = f"process {holder} holds it for writing"
        elif read_only:
            who = "its writer holds it"
        else:
            who = ("a reader that needs it to hold still, such as embstore export or fsck, "
                   "or a writer still starting holds it")
        raise StoreLockedError(
            f"{root} is open in another process or handle ({who}); close that store first",
            holder_pid=holder) from None


def _holder(fd: int) -> int | None:
    """The pid written in the lock file by its writer, if that process is alive."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    pid = int(text)
    # a writer that died: whoever holds the lock now is no writer of ours
    return pid if process_alive(pid) else None
