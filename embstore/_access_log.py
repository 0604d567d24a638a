"""Access logs: the ids a store's tables are called with, batch by batch, for `embstore profile`.

``embstore.open(..., record_accesses=PATH, record_sample=RATE)`` makes the store append, per
table, the ids of each batch to an access log at PATH; ``embstore profile PATH`` reads it as
it reads a trace. A batch is one `lookup` call. `apply_gradients` and `update` calls that
follow a lookup of the same table are that step's writes of the rows just looked up, which
the profile already models (``--step-calls``): they are not logged again. A write with no
lookup of its own (a table trained by `apply_gradients` alone) is logged as a batch. Writes
are matched to lookups by count, so a pipeline that looks up the next batch before it writes
this one is logged right too.

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
leaves a log whose complete batches read back whole: `read_access_log` takes the longest
prefix of offsets that rise and stay within the ids, and a store opened on the log again
cuts the torn tail off before it appends. `flush` fsyncs the files (the store's `flush` and
`close` call it).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _crash
from ._kernels._policy_kernels import ffi as _ffi
from ._kernels._policy_kernels import lib as _kernels
from ._validate import as_ids
from .errors import ConfigError, StorageIOError, StoreLockedError
from .manifest import DIR_MODE, FILE_MODE, make_dirs, read_bytes_nofollow, write_atomic
from .spec import TableSpec

__all__ = ["HEADER_NAME", "AccessLog", "AccessRecorder", "check_rates", "is_access_log",
           "read_access_log", "sample_mask"]

HEADER_NAME = "ACCESS_LOG.json"
FORMAT = "embstore.access_log"
VERSION = 1
HASH_BITS = 24
"""Bits of the hash compared with the rate: rates are multiples of 2**-24."""
HASH_SEED = 0
_LOCK_NAME = "LOCK"
_MAX_HEADER_BYTES = 1 << 20


def threshold_of(rate: float) -> int:
    """The hash threshold of sampling rate `rate` (kept: top bits below it)."""
    return int(rate * (1 << HASH_BITS))


def seed_key(seed: int) -> int:
    """The xor key of splitmix64 with `seed` (embstore.policies._hashing's hashes use it too)."""
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64


def sample_mask(ids: np.ndarray, rate: float, seed: int = HASH_SEED) -> np.ndarray:
    """Which of `ids` spatial sampling at `rate` keeps (bool[N]); the recorder's with seed 0."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    keep = np.empty(len(ids), dtype=np.uint8)
    _sampled(ids, threshold_of(rate), seed, keep)
    return keep.view(bool)


def _sampled(ids: np.ndarray, threshold: int, seed: int = HASH_SEED,
             keep: np.ndarray | None = None) -> np.ndarray:
    """The ids whose hash falls below `threshold`, in order (C kernel: one pass).

    `keep` (uint8[N]), if given, receives whether each id is kept.
    """
    if threshold >= 1 << HASH_BITS and keep is None:
        return ids
    out = np.empty(len(ids), dtype=np.int64)
    kept = _kernels.shards_keep(
        _ffi.cast("int64_t *", ids.ctypes.data), len(ids), seed_key(seed), HASH_BITS,
        threshold, _ffi.cast("int64_t *", out.ctypes.data),
        _ffi.NULL if keep is None else _ffi.cast("uint8_t *", keep.ctypes.data))
    return out[:kept]


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
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (
                0 < rate <= 1) or threshold_of(rate) < 1:
            raise ConfigError(f"record_sample for table {name!r} must be a rate in "
                              f"[2**-{HASH_BITS}, 1], got {rate!r}; e.g. 0.01 keeps 1% of ids")
        out[name] = threshold_of(rate) / (1 << HASH_BITS)
    return out


@dataclass
class AccessLog:
    """A log read back: per table its ids, batch offsets and sampling rate."""

    ids: dict[str, np.ndarray]
    """Logged ids per table (int64)."""
    offsets: dict[str, np.ndarray]
    """Per table: 0, then the end of each complete batch in `ids` (int64)."""
    rates: dict[str, float]
    """Per table: the share of ids (by hash) the log kept; 1.0 is every id."""

    def batches(self, table: str) -> list[np.ndarray]:
        """The batches of `table`, in order (views of `ids`)."""
        off = self.offsets[table]
        return np.split(self.ids[table], off[1:-1]) if len(off) > 1 else []


def is_access_log(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is an access log (a directory holding its header) or a sharded store's.

    A sharded store's is a directory of per-rank logs ``rank0``, ``rank1``, ...
    """
    root = Path(path)
    return (root / HEADER_NAME).is_file() or (root / "rank0" / HEADER_NAME).is_file()


def _rank_logs(root: Path) -> list[Path]:
    """The per-rank logs ``rank0`` .. ``rank<W-1>`` of a sharded store's log directory."""
    ranks: list[Path] = []
    while (root / f"rank{len(ranks)}" / HEADER_NAME).is_file():
        ranks.append(root / f"rank{len(ranks)}")
    strays = sorted(p.name for p in root.glob("rank*")
                    if p.name not in {r.name for r in ranks})
    if strays:
        raise ConfigError(f"{root}: the per-rank access logs must be rank0 .. rank"
                          f"{len(ranks) - 1} with no gap; {', '.join(strays)} is not among them")
    return ranks


def _merge_ranks(root: Path, logs: list[AccessLog]) -> AccessLog:
    """One log of the ranks' logs: per table, batch k of rank 0, 1, ... then batch k + 1.

    That is the order in which a sharded store applies its ranks' calls (one store fed the
    ranks' inputs in rank order); a rank killed early contributes only its complete batches.
    """
    names = sorted({n for log in logs for n in log.ids})
    ids, offsets, rates = {}, {}, {}
    for name in names:
        found = {log.rates[name] for log in logs if name in log.rates}
        if len(found) != 1:
            raise ConfigError(f"{root}: the ranks recorded table {name!r} at different "
                              f"rates {sorted(found)}; record every rank at one rate")
        per_rank = [log.batches(name) if name in log.ids else [] for log in logs]
        order = [b for k in range(max(len(p) for p in per_rank))
                 for p in per_rank if k < len(p) for b in (p[k],)]
        ids[name] = np.concatenate(order) if order else np.empty(0, np.int64)
        offsets[name] = np.concatenate([[0], np.cumsum([len(b) for b in order])]
                                       ).astype(np.int64)
        rates[name] = found.pop()
    return AccessLog(ids, offsets, rates)


def _read_header(root: Path) -> dict[str, Any]:
    where = root / HEADER_NAME
    try:
        doc = json.loads(read_bytes_nofollow(where, _MAX_HEADER_BYTES))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read access log header {where}: {exc}") from exc
    except Exception as exc:  # a header that is a link or too large (CorruptStoreError)
        raise ConfigError(f"access log header {where}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{where} is not an {FORMAT} header")
    if doc.get("version") != VERSION:
        raise ConfigError(f"{where}: {FORMAT} version {doc.get('version')!r} is not supported "
                          f"(this embstore reads version {VERSION})")
    sampling = doc.get("sampling")
    if sampling != _sampling() or doc.get("byte_order") != "little" or not isinstance(
            doc.get("tables"), dict):
        raise ConfigError(f"{where}: unknown sampling {sampling!r} or layout; this embstore "
                          f"writes and reads {_sampling()}, int64 little-endian")
    for name, t in doc["tables"].items():
        if not isinstance(t, dict) or not isinstance(t.get("threshold"), int) or not (
                1 <= t["threshold"] <= 1 << HASH_BITS):
            raise ConfigError(f"{where}: table {name!r} has no valid sampling threshold")
    return doc


def _sampling() -> dict[str, Any]:
    return {"method": "shards", "hash": "splitmix64", "seed": HASH_SEED, "bits": HASH_BITS}


def _complete(ids_count: int, offsets: np.ndarray) -> np.ndarray:
    """The longest prefix of `offsets` that describes complete batches of `ids_count` ids."""
    if not len(offsets) or offsets[0] != 0:
        return np.zeros(1, dtype=np.int64)
    bad = np.flatnonzero((np.diff(offsets) < 0) | (offsets[1:] > ids_count))
    return offsets[: int(bad[0]) + 1] if len(bad) else offsets


def _read_array(file: Path) -> np.ndarray:
    with open(file, "rb") as fh:
        data = fh.read()
    return np.frombuffer(data, dtype="<i8", count=len(data) // 8).astype(np.int64)


def read_access_log(path: str | os.PathLike[str]) -> AccessLog:
    """Read the access log at `path`, up to each table's last complete batch.

    A sharded store's directory of per-rank logs reads as one log (`_merge_ranks`).

    Raises:
        ConfigError: no access log there, or one this embstore cannot read.
    """
    root = Path(path)
    if not is_access_log(root):
        raise ConfigError(f"{root} is not an access log (no {HEADER_NAME}); record one with "
                          "embstore.open(..., record_accesses=PATH)")
    if not (root / HEADER_NAME).is_file():
        return _merge_ranks(root, [read_access_log(r) for r in _rank_logs(root)])
    doc = _read_header(root)
    ids, offsets, rates = {}, {}, {}
    for name, t in doc["tables"].items():
        try:
            raw = _read_array(root / f"{name}.ids")
            off = _complete(len(raw), _read_array(root / f"{name}.offsets"))
        except OSError as exc:
            raise ConfigError(f"access log {root}: cannot read table {name!r}: "
                              f"{exc.strerror or exc}") from exc
        ids[name], offsets[name] = raw[: int(off[-1])], off
        rates[name] = t["threshold"] / (1 << HASH_BITS)
    return AccessLog(ids, offsets, rates)


class _TableLog:
    """One table's two files and where its next batch goes."""

    def __init__(self, root: Path, name: str, threshold: int, *, fresh: bool) -> None:
        self.threshold = threshold
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if fresh else 0)
        self.ids_fd = os.open(root / f"{name}.ids", flags, FILE_MODE)
        try:
            self.off_fd = os.open(root / f"{name}.offsets", flags, FILE_MODE)
        except BaseException:
            os.close(self.ids_fd)
            raise
        self.pending_writes = 0
        # continue after the last complete batch: a killed writer's torn tail is cut off
        off = _complete(os.fstat(self.ids_fd).st_size // 8, np.frombuffer(
            os.pread(self.off_fd, os.fstat(self.off_fd).st_size, 0), dtype="<i8",
            count=os.fstat(self.off_fd).st_size // 8).astype(np.int64))
        self.batches, self.end = len(off) - 1, int(off[-1])
        os.ftruncate(self.ids_fd, self.end * 8)
        os.ftruncate(self.off_fd, (self.batches + 1) * 8)
        if self.batches == 0:
            os.pwrite(self.off_fd, np.zeros(1, dtype="<i8").tobytes(), 0)

    def append(self, ids: np.ndarray) -> None:
        kept = _sampled(ids, self.threshold)
        data = kept.astype("<i8", copy=False) if sys.byteorder != "little" else kept
        _pwrite_all(self.ids_fd, np.ascontiguousarray(data).view(np.uint8).data, self.end * 8)
        _crash.point("access_log.after_ids")
        end = self.end + len(kept)
        _pwrite_all(self.off_fd, np.array([end], dtype="<i8").view(np.uint8).data,
                    (self.batches + 1) * 8)
        self.end, self.batches = end, self.batches + 1

    def close(self) -> None:
        try:
            os.close(self.ids_fd)
        finally:
            os.close(self.off_fd)


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while data:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


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

    def lookup(self, table: str, ids: np.ndarray) -> None:
        """Log a lookup of `ids` (C-contiguous int64) as a batch of `table`."""
        log = self._logs[table]
        self._append(log, ids)
        log.pending_writes += 1

    def lookup_many(self, batches: Sequence[tuple[TableSpec, np.ndarray]],
                    accessed: Mapping[str, Any] | None) -> None:
        """Log checked distinct ids per table, or the batch as used where `accessed` gives it."""
        used = accessed or {}
        for spec, ids in batches:
            self.lookup(spec.name, ids if spec.name not in used
                        else as_ids(used[spec.name], spec))

    def write(self, table: str, ids: np.ndarray) -> None:
        """Log a write (`apply_gradients`, `update`) unless it is a logged lookup's step."""
        log = self._logs[table]
        if log.pending_writes:
            log.pending_writes -= 1
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
