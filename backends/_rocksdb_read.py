"""Opening a RocksDB database read-only without writing anything in its directory.

rocksdict writes its own config file (``rocksdict-config.json``) into the directory it opens,
read-only or not. A reader beside a writer, and fsck, must change nothing in a store: so a
read-only database is opened through a private directory of symbolic links to its files,
removed as soon as the database is open.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import rocksdict

from embstore.errors import CorruptStoreError, StoreNotFoundError
from embstore.manifest import read_bytes_nofollow

from ._kv import missing_medium

__all__ = ["check_log_framing", "db_files", "error_text", "open_read_only"]

_VIEW_PREFIX: Final = "embstore-rocksdb-read-"
_DB_FILE: Final = re.compile(r"^(CURRENT|IDENTITY|MANIFEST-\d+|OPTIONS-\d+|\d+\.(sst|log|blob))$")
_OPEN_TRIES: Final = 8
_LOG_BLOCK: Final = 32768
_LOG_HEADER: Final = struct.Struct("<IHB")  # masked CRC-32C, payload length, record type
# Record types of a recycled log: full, first, middle, last (5-8), a timestamp size (11), and
# a predecessor's record (131, in RocksDB releases after the 9.8 this was measured on).
# RocksDB's log reader (9.8.4) meets one past a log's first record by returning "bad
# record" without consuming it, and reads it again forever: an open, a read-only open and
# fsck hang at full CPU. This store never recycles logs, so only damage puts one there.
_RECYCLED_TYPES: Final = frozenset({5, 6, 7, 8, 11, 131})
_REGULAR: Final = 0o100000


def check_log_framing(directory: Path) -> None:
    """Refuse log files in `directory` that RocksDB cannot read without hanging.

    Walks the record headers of the MANIFEST that CURRENT names and of every write-ahead
    log, block by block as RocksDB's reader does (fewer than 7 bytes left end a block, as
    does a zero header). Checksums are RocksDB's to check (it reports those as corruption);
    headers only, so a log a writer is appending meanwhile (a short last record) passes.
    Files that are missing or unreadable are left to RocksDB's own error.

    Raises:
        CorruptStoreError: a record of a recycled log's type, or a log that is a symbolic
            link or not a regular file.
    """
    files = [directory / p.name for p in sorted(directory.glob("*.log"))]
    try:
        current = read_bytes_nofollow(directory / "CURRENT", 4096)
    except (OSError, CorruptStoreError):
        current = b""  # RocksDB reports a missing or damaged CURRENT
    name = current.decode("ascii", "replace").strip()
    if re.fullmatch(r"MANIFEST-\d+", name):
        files.insert(0, directory / name)
    for file in files:
        _check_one_log(file)


def _check_one_log(file: Path) -> None:
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise CorruptStoreError(f"RocksDB log {file} is a symbolic link or special file; "
                                    "restore the store from a checkpoint") from exc
        return  # gone (a writer beside us deleted it) or unreadable: RocksDB says which
    try:
        if os.fstat(fd).st_mode & 0o170000 != _REGULAR:
            raise CorruptStoreError(f"RocksDB log {file} is not a regular file; restore the "
                                    "store from a checkpoint")
        base = 0
        while block := os.pread(fd, _LOG_BLOCK, base):
            pos = 0
            while len(block) - pos >= _LOG_HEADER.size:
                _, length, kind = _LOG_HEADER.unpack_from(block, pos)
                if kind in _RECYCLED_TYPES:
                    raise CorruptStoreError(
                        f"RocksDB log {file} is damaged at byte {base + pos}: a record of "
                        f"type {kind}, which this store never writes")
                if kind == 0 and length == 0:
                    break  # zero padding: the reader goes on at the next block
                pos += _LOG_HEADER.size + length
            base += _LOG_BLOCK
    finally:
        os.close(fd)


def open_read_only(directory: Path, db_options: Any,
                   cf_options: Callable[[], Any] | None) -> tuple[Any, list[str]]:
    """Open the RocksDB database in `directory` read-only, writing nothing there.

    rocksdict writes its own config file into the directory it opens, read-only or not; so
    the database is opened through a private directory of symbolic links to its files,
    removed once open (every table file is opened then: max_open_files -1). RocksDB's
    read-only open takes no lock and replays the write-ahead log in memory: it reads beside
    a writer, as of the open. That writer may delete or add a file between the listing and
    the open (a log after a memtable flush, SSTs in a compaction, a new MANIFEST): the open
    is then tried again with a fresh listing.

    Args:
        directory: the tier directory.
        db_options: the database's options (rocksdict.Options).
        cf_options: options of each table's column family, or None to open only the
            default column family.

    Returns:
        The database (rocksdict.Rdict) and the names of its column families.

    Raises:
        StoreNotFoundError: no RocksDB database in `directory`.
        CorruptStoreError: a log RocksDB would hang on (`check_log_framing`).
        Exception: what rocksdict raised on the last try.
    """
    db_options.set_max_open_files(-1)
    check_log_framing(directory)
    last: Exception | None = None
    for _ in range(_OPEN_TRIES):
        view = Path(tempfile.mkdtemp(prefix=_VIEW_PREFIX))
        try:
            if not directory.is_dir():
                raise missing_medium("RocksDB database", directory)
            with os.scandir(directory) as entries:
                for entry in entries:
                    if _DB_FILE.match(entry.name) and entry.is_file(follow_symlinks=False):
                        os.symlink(os.path.abspath(entry.path), view / entry.name)
            if not (view / "CURRENT").exists():
                raise missing_medium("RocksDB database", directory)
            cfs = rocksdict.Rdict.list_cf(str(view), rocksdict.Options(raw_mode=True))
            families = ({n: cf_options() for n in cfs if n != "default"} or None
                        if cf_options is not None else None)
            db = rocksdict.Rdict(str(view), db_options, column_families=families,
                                 access_type=rocksdict.AccessType.read_only(False))
            return db, cfs
        except StoreNotFoundError:
            raise
        except Exception as exc:
            if "No such file" not in str(exc) and "NotFound" not in str(exc):
                raise _naming(exc, directory) from exc
            last = exc  # a file the writer removed or added meanwhile: list again
        finally:
            shutil.rmtree(view, ignore_errors=True)
    assert last is not None
    raise _naming(last, directory) from last


def _naming(exc: Exception, directory: Path) -> Exception:
    """`exc` as the same kind of error, naming `directory` where it named the private view.

    The view is gone by the time anyone reads the message.
    """
    text = error_text(exc, directory)
    if text == str(exc):
        return exc
    try:
        return type(exc)(text)
    except Exception:  # a type that wants other arguments: keep the original
        return exc


def db_files(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime ns) of the database files in `directory`: changes with any write."""
    out = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if _DB_FILE.match(entry.name):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out.append((entry.name, st.st_size, st.st_mtime_ns))
    except FileNotFoundError:
        pass  # the open that follows says what is missing
    return tuple(sorted(out))


_VIEW: Final = re.compile(r"\S*/" + _VIEW_PREFIX + r"[A-Za-z0-9_]+")


def error_text(exc: Exception, directory: Path) -> str:
    """The message of a rocksdict error, naming `directory` where it names a reader's links.

    A read-only database is opened through a private directory of links (`open_read_only`):
    RocksDB's messages name that directory, which is gone by the time anyone reads them.
    """
    return _VIEW.sub(str(directory), str(exc))
