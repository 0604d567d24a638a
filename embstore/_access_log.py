"""Access logs: the ids a store's tables are called with, batch by batch, for `embstore profile`.

``embstore.open(..., record_accesses=PATH, record_sample=RATE)`` makes the store append, per
table, the ids of each batch to an access log at PATH; ``embstore profile PATH`` reads it as
it reads a trace. A batch is one `lookup` call. `apply_gradients` and `update` calls that
follow a lookup of the same table are that step's writes of the rows just looked up, which
the profile already models (``--step-calls``): they are not logged again. A write with no
lookup of its own (a table trained by `apply_gradients` alone) is logged as a batch. A write
is matched to the oldest lookup not yet written whose ids hold all of its own, and lookups
before that one had no write (an evaluation): so a pipeline that looks up up to 64 batches
ahead of the one it writes is logged right, and a lookup that no write follows keeps no
later write of other ids out of the log (one of ids it looked up reads as its step).

Sampling is spatial, as SHARDS does it (Waldspurger et al., FAST 2015): an id is kept when the
top 24 bits of its splitmix64 hash fall below RATE x 2**24, in every batch it occurs in. So
the log is the sub-trace of a fixed random subset of the ids: their reuse distances are the
full trace's scaled by RATE, and the miss-ratio curves stay estimable from it (with a small,
bounded error: `embstore.tools._mrc`), which sampling whole batches would not give (the
reuses between logged batches would be unknown). The rate is stored in the header; profile
scales counts back by it, and the hash is the one `embstore.tools._mrc.sample_trace` uses,
so profiling a log sampled at RATE equals profiling the full trace sampled at RATE.
Recording costs one pass of a C kernel over the ids and two ``pwrite`` calls per batch.

Layout (format ``embstore.access_log``, version 1), a directory holding::

    ACCESS_LOG.json    {"format", "version", "byte_order": "little", "dtype": "int64",
                        "sampling": {"method": "shards", "hash": "splitmix64", "seed": 0,
                                     "bits": 24},
                        "tables": {name: {"rate": float, "threshold": int}}}
    <table>.ids        the logged ids, int64 little-endian, batch after batch
    <table>.offsets    int64 little-endian: 0, then where each batch ends in <table>.ids
    LOCK               held (flock) by the store writing the log

No pickle, nothing but raw arrays and JSON. Files are 0600, the directory 0700. Each batch's
ids are written before its end offset, at known positions, so a writer killed at any point
leaves a log whose complete batches read back whole: the torn tail it can leave (ids past
the last offset, a last offset record cut short) is passed over by `read_access_log` and cut
off by a store opened on the log again before it appends. Anything else is damage, which
both refuse with CorruptStoreError naming the file rather than drop batches unseen: offsets
that do not start at 0, fall, or point past the ids; a listed table's file missing; a table's
files holding batches the header does not list; a header field not as above. `flush` fsyncs
the files (the store's `flush` and `close` call it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import _crash
from ._access_log_read import (
    _DAMAGED,
    FORMAT,
    HASH_BITS,
    HEADER_NAME,
    VERSION,
    AccessLog,
    _check_unlisted,
    _complete_batches,
    _read_header,
    _sampled,
    _sampling,
    _whole_records,
    is_access_log,
    read_access_log,
    sample_mask,
    threshold_of,
)
from ._validate import as_ids
from .errors import ConfigError, CorruptStoreError, StorageIOError, StoreLockedError
from .manifest import DIR_MODE, FILE_MODE, make_dirs, write_atomic
from .spec import TableSpec

__all__ = ["HEADER_NAME", "AccessLog", "AccessRecorder", "check_rates", "is_access_log",
           "read_access_log", "sample_mask"]

_LOCK_NAME = "LOCK"


def check_rates(sample: float | Mapping[str, float]) -> None:
    """Check the rates of `sample` (a rate, or rates by table name), tables aside.

    Raises:
        ConfigError: a rate outside [2**-24, 1], or not a rate nor a mapping of rates.
    """
    if isinstance(sample, Mapping):
        _rates(list(sample), sample)
    else:
        _rates(["every table"], sample)


def _rates(tables: Sequence[str], sample: float | Mapping[str, float]) -> dict[str, float]:
    """Each table's sampling rate, rounded down to a multiple of 2**-24.

    Raises:
        ConfigError: a rate outside (0, 1] or below 2**-24, or a table not in the store.
    """
    if isinstance(sample, Mapping):
        unknown = sorted(map(repr, set(sample) - set(tables)))
        if unknown:
            raise ConfigError(f"record_sample names tables {', '.join(unknown)} the store "
                              f"does not have ({sorted(tables)})")
        given = {name: sample.get(name, 1.0) for name in tables}
    else:
        given = dict.fromkeys(tables, sample)
    out = {}
    for name, rate in given.items():
        # numpy's numbers are rates too (np.bool_ is neither np.integer nor np.floating)
        if isinstance(rate, bool) or not isinstance(
                rate, (int, float, np.integer, np.floating)) or not (
                0 < rate <= 1) or threshold_of(float(rate)) < 1:
            raise ConfigError(f"record_sample for table {name!r} must be a rate in "
                              f"[2**-{HASH_BITS}, 1], got {rate!r}; e.g. 0.01 keeps 1% of ids")
        out[name] = threshold_of(float(rate)) / (1 << HASH_BITS)
    return out


class _TableLog:
    """One table's two files and where its next batch goes."""

    def __init__(self, root: Path, name: str, threshold: int, *, fresh: bool) -> None:
        """Open (`fresh`: create or empty) table `name`'s files in the log at `root`.

        Raises:
            CorruptStoreError: a table the log lists has a file missing, or offsets that are
                no torn tail (`_complete_batches`): cutting them off would drop batches.
            OSError: a file cannot be opened (a link, permissions).
        """
        self.threshold = threshold
        # a listed table's files must be there: creating them would hide the loss
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_TRUNC if fresh else 0)
        self.ids_fd = self.off_fd = -1
        try:
            self.ids_fd = os.open(root / f"{name}.ids", flags, FILE_MODE)
            self.off_fd = os.open(root / f"{name}.offsets", flags, FILE_MODE)
            # the ids of lookups not yet written, oldest first (`AccessRecorder.write`)
            self.unwritten: deque[np.ndarray] = deque(maxlen=_MAX_UNWRITTEN)
            off = np.zeros(1, dtype=np.int64) if fresh else _whole_records(
                os.pread(self.off_fd, os.fstat(self.off_fd).st_size, 0))
            off, problem = _complete_batches(name, os.fstat(self.ids_fd).st_size // 8, off)
            if problem is not None:
                raise CorruptStoreError(f"access log {root}: table {name!r}: {problem}; "
                                        f"{_DAMAGED}")
            # continue after the last complete batch: a killed writer's torn tail is cut off
            self.batches, self.end = len(off) - 1, int(off[-1])
            os.ftruncate(self.ids_fd, self.end * 8)
            os.ftruncate(self.off_fd, (self.batches + 1) * 8)
            if self.batches == 0:
                os.pwrite(self.off_fd, np.zeros(1, dtype="<i8").tobytes(), 0)
        except (FileNotFoundError, IsADirectoryError) as exc:
            self.close()
            file = Path(str(exc.filename)).name
            what = ("is missing" if isinstance(exc, FileNotFoundError)
                    else "is a directory, not a file")
            raise CorruptStoreError(f"access log {root}: table {name!r} is listed in "
                                    f"{HEADER_NAME} but its file {file} {what}; "
                                    f"{_DAMAGED}") from None
        except BaseException:
            self.close()
            raise

    def append(self, ids: np.ndarray) -> None:
        kept = _sampled(ids, self.threshold)
        data = kept.astype("<i8", copy=False) if sys.byteorder != "little" else kept
        _pwrite_all(self.ids_fd, np.ascontiguousarray(data).view(np.uint8).data, self.end * 8)
        _crash.point("access_log.after_ids")
        end = self.end + len(kept)
        _pwrite_all(self.off_fd, np.array([end], dtype="<i8").view(np.uint8).data,
                    (self.batches + 1) * 8)
        self.end, self.batches = end, self.batches + 1

    def truncate(self, end: int, batches: int) -> None:
        """Cut the log back to its first `batches` batches, which end at id `end`."""
        os.ftruncate(self.off_fd, (batches + 1) * 8)
        os.ftruncate(self.ids_fd, end * 8)
        self.end, self.batches = end, batches

    def close(self) -> None:
        """Close both files (either may not be open: -1)."""
        try:
            if self.ids_fd >= 0:
                os.close(self.ids_fd)
        finally:
            if self.off_fd >= 0:
                os.close(self.off_fd)
            self.ids_fd = self.off_fd = -1


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while data:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


_MAX_UNWRITTEN = 64  # lookups awaiting their write: a pipeline's depth, with room to spare


def _holds(looked_up: np.ndarray, ids: np.ndarray) -> bool:
    """Whether every id of `ids` is among `looked_up` (a step writes what it looked up)."""
    if len(ids) == len(looked_up):
        if np.array_equal(ids, looked_up):  # the usual step: the same ids, in order
            return True
        if _multiset_hash(ids) == _multiset_hash(looked_up):  # in another order
            return True
    return bool(np.isin(ids, looked_up).all())


def _multiset_hash(ids: np.ndarray) -> tuple[int, int]:
    """An order-free fingerprint of `ids`: their sum, and the sum of a 64-bit mix of each."""
    x = ids.view(np.uint64)
    with np.errstate(over="ignore"):
        mixed = (x ^ (x >> np.uint64(31))) * np.uint64(0x9E3779B97F4A7C15)
        mixed ^= mixed >> np.uint64(29)
        return int(x.sum(dtype=np.uint64)), int(mixed.sum(dtype=np.uint64))


class AccessRecorder:
    """Appends a store's batches to an access log (see the module doc).

    Args:
        path: the log's directory: created, or an existing log to append to.
        tables: the store's tables.
        sample: the rate of ids kept, one for all tables or per table (others: 1.0).

    Raises:
        ConfigError: a bad rate, a path that is not a directory, a directory of other files,
            a log recorded at other rates, or a path that cannot be written.
        StoreLockedError: another store is writing this log.
        CorruptStoreError: the log to append to is damaged (see `read_access_log`).
    """

    def __init__(self, path: str | os.PathLike[str], tables: Sequence[str],
                 sample: float | Mapping[str, float] = 1.0) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"record_accesses must be a path, got {path!r}")
        rates = _rates(tables, sample)
        self.path = root = Path(path)
        self._logs: dict[str, _TableLog] = {}
        self._lock: int | None = None
        try:
            self._open(root, rates)
        except OSError as exc:
            self.close()
            raise ConfigError(f"cannot record accesses to {root}: {exc.strerror or exc}; "
                              "give a new or empty directory you can write") from exc
        except BaseException:
            self.close()
            raise

    def _open(self, root: Path, rates: dict[str, float]) -> None:
        if root.exists() and not root.is_dir():
            raise ConfigError(f"record_accesses={str(root)!r} is a file; give a directory for "
                              "the access log (new, empty, or a log to append to)")
        existing = is_access_log(root)
        if not existing and root.exists() and any(root.iterdir()):
            raise ConfigError(f"{root} holds files but no {HEADER_NAME}: it is not an access "
                              "log; give a new or empty directory")
        if not root.exists():
            make_dirs(root, DIR_MODE)  # each new directory's entry synced in its parent
        self._lock = os.open(root / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                             FILE_MODE)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(f"the access log {root} is being written by another store; "
                                   "close it or record to another directory") from None
        known: dict[str, Any] = _read_header(root)["tables"] if existing else {}
        if existing:  # a new table's files are emptied below: never over unlisted batches
            _check_unlisted(root, known)
        for name, rate in rates.items():
            if name in known and known[name]["threshold"] != threshold_of(rate):
                raise ConfigError(
                    f"the access log {root} records table {name!r} at rate "
                    f"{known[name]['threshold'] / (1 << HASH_BITS)}, not {rate}; record at "
                    "that rate or to another directory")
        for name, rate in rates.items():
            self._logs[name] = _TableLog(root, name, threshold_of(rate), fresh=name not in known)
        if set(rates) - set(known):  # the header lists a table only once its files exist
            for log in self._logs.values():
                os.fsync(log.ids_fd)
                os.fsync(log.off_fd)
            tables = {**known, **{n: {"rate": r, "threshold": threshold_of(r)}
                                  for n, r in rates.items() if n not in known}}
            header = {"format": FORMAT, "version": VERSION, "byte_order": "little",
                      "dtype": "int64", "sampling": _sampling(), "tables": tables}
            write_atomic(root / HEADER_NAME, (json.dumps(header, indent=1) + "\n").encode())

    @property
    def rates(self) -> dict[str, float]:
        """Each recorded table's sampling rate."""
        return {n: log.threshold / (1 << HASH_BITS) for n, log in self._logs.items()}

    def lookup(self, table: str, ids: np.ndarray, looked_up: np.ndarray | None = None
               ) -> None:
        """Log `ids` (C-contiguous int64) as a batch of `table`.

        `looked_up`: the ids the store was asked for, where `ids` is the batch as the caller
        used it (repeats included); the step's write is matched against them.
        """
        log = self._logs[table]
        self._append(log, ids)
        log.unwritten.append((ids if looked_up is None else looked_up).copy())

    def lookup_many(self, batches: Sequence[tuple[TableSpec, np.ndarray]],
                    accessed: Mapping[str, Any] | None) -> None:
        """Log checked distinct ids per table, or the batch as used where `accessed` gives it.

        Every table's `accessed` ids are checked before any batch is logged: a call refused
        for one table's logs none (it reads nothing).

        Raises:
            InvalidIdsError: ids of `accessed` that `lookup` would refuse.
        """
        used = accessed or {}
        logged = [(spec.name, as_ids(used[spec.name], spec) if spec.name in used else None, ids)
                  for spec, ids in batches]
        for name, as_used, ids in logged:
            self.lookup(name, ids if as_used is None else as_used, ids)

    @contextlib.contextmanager
    def writing(self, table: str, ids: np.ndarray) -> Iterator[None]:
        """Log a write as `write` does, and take it back where the write then raises.

        A write refused in the store (a non-finite step: nothing written) is no access: its
        lookup stays unwritten for the step retried, and a batch it logged is cut off again.
        """
        log = self._logs[table]
        unwritten, mark = list(log.unwritten), (log.end, log.batches)
        self.write(table, ids)
        try:
            yield
        except BaseException:
            log.unwritten.clear()
            log.unwritten.extend(unwritten)
            if (log.end, log.batches) != mark:
                with contextlib.suppress(OSError):  # the write's own error is the one to see
                    log.truncate(*mark)
            raise

    def write(self, table: str, ids: np.ndarray) -> None:
        """Log a write (`apply_gradients`, `update`) unless it is a logged lookup's step."""
        log = self._logs[table]
        for k, looked_up in enumerate(log.unwritten):
            if _holds(looked_up, ids):
                for _ in range(k + 1):  # those before it were never written: evaluations
                    log.unwritten.popleft()
                return
        self._append(log, ids)

    def _append(self, log: _TableLog, ids: np.ndarray) -> None:
        try:
            log.append(ids)
        except OSError as exc:
            raise StorageIOError(exc.errno, f"recording accesses to {self.path}: "
                                 f"{exc.strerror or exc}; the log keeps every batch before "
                                 "this one") from exc

    def flush(self) -> None:
        """Make every logged batch durable."""
        try:
            for log in self._logs.values():
                os.fsync(log.ids_fd)
                os.fsync(log.off_fd)
        except OSError as exc:
            raise StorageIOError(exc.errno, f"syncing the access log {self.path}: "
                                 f"{exc.strerror or exc}") from exc

    def close(self) -> None:
        """Flush and close the log (idempotent).

        Raises:
            StorageIOError: a sync failed (the files are closed all the same).
        """
        logs, self._logs = self._logs, {}
        failed: OSError | None = None
        for log in logs.values():
            try:
                os.fsync(log.ids_fd)
                os.fsync(log.off_fd)
            except OSError as exc:
                failed = failed or exc
            finally:
                log.close()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if failed is not None:
            raise StorageIOError(failed.errno, f"syncing the access log {self.path}: "
                                 f"{failed.strerror or failed}") from failed
