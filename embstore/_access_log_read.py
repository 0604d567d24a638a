"""Reading an access log back (`read_access_log`), and its header and files checked.

A log is what `embstore._access_log.AccessRecorder` writes: a header (``ACCESS_LOG.json``)
and per table ``<table>.ids`` and ``<table>.offsets``. Reading checks every field of the
header and every table's offsets, so a damaged log is refused by name rather than read with a
table, or batches, left out; the one state a killed writer or a power cut leaves (ids or
offsets past the last complete batch) is cut off and counted: ids in `AccessLog.left_out`,
batch ends past the ids in `AccessLog.lost_batches`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._kernels._policy_kernels import ffi as _ffi
from ._kernels._policy_kernels import lib as _kernels
from .errors import ConfigError, CorruptStoreError, StorageIOError
from .errors import brief as _show
from .manifest import read_bytes_nofollow
from .spec import is_table_name

__all__ = ["FORMAT", "HASH_BITS", "HASH_SEED", "HEADER_NAME", "VERSION", "AccessLog",
           "is_access_log", "read_access_log", "sample_mask", "threshold_of"]

HEADER_NAME = "ACCESS_LOG.json"
FORMAT = "embstore.access_log"
VERSION = 1
HASH_BITS = 24
"""Bits of the hash compared with the rate: rates are multiples of 2**-24."""
HASH_SEED = 0
_MAX_HEADER_BYTES = 1 << 20




@dataclass
class AccessLog:
    """A log read back: per table its ids, batch offsets and sampling rate."""

    ids: dict[str, np.ndarray]
    """Logged ids per table (int64)."""
    offsets: dict[str, np.ndarray]
    """Per table: 0, then the end of each complete batch in `ids` (int64)."""
    rates: dict[str, float]
    """Per table: the share of ids (by hash) the log kept; 1.0 is every id."""
    left_out: dict[str, int] = field(default_factory=dict)
    """Per table with a torn tail: ids its file holds past its last complete batch, not read
    (a writer killed mid-batch, or an offsets file cut short, which look alike)."""
    lost_batches: dict[str, int] = field(default_factory=dict)
    """Per table with any: ends of batches past the ids its file holds (a power cut kept
    offsets whose ids it lost). Their sizes are not trusted: a damaged record reads alike."""

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
    left_out: dict[str, int] = {}
    lost: dict[str, int] = {}
    for log in logs:
        for name, n in log.left_out.items():
            left_out[name] = left_out.get(name, 0) + n
        for name, n in log.lost_batches.items():
            lost[name] = lost.get(name, 0) + n
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
    return AccessLog(ids, offsets, rates, left_out, lost)


_DAMAGED = "the log is damaged: record a new one (embstore.open(..., record_accesses=NEW_DIR))"


def _json_type(value: object) -> str:
    """The JSON name of `value`'s type, as a reader of the header file would call it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {_show(value)}"
    if isinstance(value, str):
        return f"the string {_show(value)}"
    return "an array" if isinstance(value, list) else "an object"


def _header_field(doc: dict[str, Any], where: Path, key: str, want: object) -> None:
    """Check that header field `key` is `want` (a version 1 header has no other value).

    Raises:
        CorruptStoreError: the field is missing or holds something else.
    """
    if key not in doc:
        raise CorruptStoreError(f"{where}: field {key!r} is missing (it must be {want!r}); "
                                f"{_DAMAGED}")
    if doc[key] != want or type(doc[key]) is not type(want):
        raise CorruptStoreError(f"{where}: field {key!r} is {_json_type(doc[key])}, not "
                                f"{want!r}; {_DAMAGED}")


def _read_header(root: Path) -> dict[str, Any]:
    """The header of the log at `root`, every field checked.

    Raises:
        ConfigError: no header, one that cannot be read (permissions), or one of a version
            this embstore does not read.
        CorruptStoreError: a header that is no JSON object, or a field that is missing or
            not what a version 1 log holds.
    """
    where = root / HEADER_NAME
    try:
        # a link, a special file or one too large raises CorruptStoreError naming the file
        raw = read_bytes_nofollow(where, _MAX_HEADER_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"{root} is not an access log (no {HEADER_NAME})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the access log header {where}: "
                          f"{exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptStoreError(f"{where} is not UTF-8 text (byte {exc.start} is not): "
                                f"{_DAMAGED}") from None
    if not text.strip():
        raise CorruptStoreError(f"{where} is empty: {_DAMAGED}")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:  # json's own words stay out of the message
        raise CorruptStoreError(f"{where} is not valid JSON (cut short or garbled at line "
                                f"{exc.lineno}, column {exc.colno}): {_DAMAGED}") from None
    except (ValueError, RecursionError):  # a number of too many digits, nesting too deep
        raise CorruptStoreError(f"{where} is not JSON this embstore can read: "
                                f"{_DAMAGED}") from None
    if not isinstance(doc, dict):
        raise CorruptStoreError(f"{where} holds {_json_type(doc)}, not a JSON object: "
                                f"{_DAMAGED}")
    _header_field(doc, where, "format", FORMAT)
    version = doc.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version != VERSION:
        raise ConfigError(f"{where}: {FORMAT} version {version} is not supported (this "
                          f"embstore reads version {VERSION})")
    _header_field(doc, where, "version", VERSION)
    _header_field(doc, where, "byte_order", "little")
    _header_field(doc, where, "dtype", "int64")
    _header_field(doc, where, "sampling", _sampling())
    tables = doc.get("tables")
    if not isinstance(tables, dict):
        got = "missing" if "tables" not in doc else _json_type(tables)
        raise CorruptStoreError(f"{where}: field 'tables' is {got}, not an object of table "
                                f"name to {{'rate', 'threshold'}}; {_DAMAGED}")
    for name, t in tables.items():
        # the name makes file names: one that is no table name could reach outside the log
        if not is_table_name(name):
            raise CorruptStoreError(f"{where}: field 'tables' lists {_show(name)}, which is "
                                    f"not a table name; {_DAMAGED}")
        field = f"tables.{name}"
        if not isinstance(t, dict):
            raise CorruptStoreError(f"{where}: field {field!r} is {_json_type(t)}, not an "
                                    f"object {{'rate', 'threshold'}}; {_DAMAGED}")
        threshold = t.get("threshold")
        if isinstance(threshold, bool) or not isinstance(threshold, int) or not (
                1 <= threshold <= 1 << HASH_BITS):
            got = "missing" if "threshold" not in t else _json_type(threshold)
            raise CorruptStoreError(f"{where}: field '{field}.threshold' is {got}, not an "
                                    f"integer in [1, 2**{HASH_BITS}]; {_DAMAGED}")
        rate = t.get("rate")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or (
                rate != threshold / (1 << HASH_BITS)):
            # which of the two is right cannot be told: the ids kept are the threshold's
            got = "missing" if "rate" not in t else _json_type(rate)
            raise CorruptStoreError(
                f"{where}: field '{field}.rate' is {got}, not the rate of its threshold "
                f"({threshold / (1 << HASH_BITS)!r}); {_DAMAGED}")
    return doc


def _sampling() -> dict[str, Any]:
    return {"method": "shards", "hash": "splitmix64", "seed": HASH_SEED, "bits": HASH_BITS}


def _complete_batches(name: str, ids_count: int, offsets: np.ndarray
                      ) -> tuple[np.ndarray, str | None]:
    """A table's offset records up to its last complete batch, and what is wrong, if anything.

    A writer killed mid-batch leaves ids past the last offset, or a last offset record cut
    short (not a whole record: the caller reads whole ones); a power cut may also keep
    offsets written since the last flush whose ids it lost (the flush syncs the ids first,
    so only records past the last flush's). That torn tail, records past the ids that never
    fall, is cut off: it is no damage. Anything else is: the records must start at 0, never
    fall, and stay within the ids up to the tail.
    """
    if not len(offsets):
        return offsets, f"{name}.offsets is empty (a log's tables start with offset 0)"
    if offsets[0] != 0:
        return offsets, f"{name}.offsets starts at {int(offsets[0])}, not 0"
    falls = np.flatnonzero(offsets[1:] < offsets[:-1])
    if len(falls):
        k = int(falls[0])  # the first bad record ends batch k
        return offsets, (f"{name}.offsets: batch {k} ends at id {int(offsets[k + 1])}, before "
                         f"it starts ({int(offsets[k])})")
    past = np.flatnonzero(offsets > ids_count)
    return (offsets[: int(past[0])] if len(past) else offsets), None


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


def _check_sampled(root: Path, name: str, ids: np.ndarray, threshold: int) -> None:
    """Refuse a sampled table holding ids its rate does not keep (changed ids or header).

    Every logged id's hash falls below the header's threshold; a flipped bit in an id, or
    a rate edited lower in the header, breaks that for most ids. An unsampled log, or a
    rate edited higher, cannot be told this way.
    """
    if threshold >= 1 << HASH_BITS or not len(ids):
        return
    outside = int(len(ids) - np.count_nonzero(sample_mask(ids, threshold / (1 << HASH_BITS))))
    if outside:
        raise CorruptStoreError(
            f"access log {root}: table {name!r}: {outside} of its {len(ids)} logged ids are not "
            f"among those its rate ({threshold / (1 << HASH_BITS):g}, in {HEADER_NAME}) keeps: "
            f"{name}.ids or the header was changed; {_DAMAGED}")


def _whole_records(data: bytes) -> np.ndarray:
    """The whole int64 little-endian records of `data` (a torn last one left out)."""
    return np.frombuffer(data, dtype="<i8", count=len(data) // 8).astype(np.int64)


def _read_file(root: Path, name: str, suffix: str) -> bytes:
    """The bytes of table `name`'s file `suffix` in the log at `root`.

    Raises:
        CorruptStoreError: the file is missing, a link or not a regular file.
        ConfigError: it cannot be read (permissions).
        StorageIOError: the medium failed the read.
    """
    file = root / f"{name}{suffix}"
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CorruptStoreError(f"access log {root}: table {name!r} is listed in {HEADER_NAME} "
                                f"but its file {file.name} is missing; {_DAMAGED}") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link, a socket or FIFO
            raise CorruptStoreError(f"access log {root}: {file.name} of table {name!r} is a "
                                    f"link or special file, not the log's own; "
                                    f"{_DAMAGED}") from None
        if isinstance(exc, PermissionError):
            raise ConfigError(f"access log {root}: cannot read {file.name} of table {name!r}: "
                              f"{exc.strerror}") from exc
        raise StorageIOError(exc.errno, f"access log {root}: reading {file.name}: "
                             f"{exc.strerror or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptStoreError(f"access log {root}: {file.name} of table {name!r} is not a "
                                    f"regular file; {_DAMAGED}")
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise StorageIOError(exc.errno, f"access log {root}: reading {file.name}: "
                             f"{exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def _check_unlisted(root: Path, listed: Iterable[str]) -> None:
    """Refuse table files holding batches of a table the header does not list.

    Their batches would be left out of the profile unseen. A writer killed before its header
    listed a new table leaves that table's files holding no batch (at most the offset 0):
    those are no loss and are passed over (a store recording that table rewrites them).

    Raises:
        CorruptStoreError: such a file holds ids or batch ends.
    """
    known = {f"{n}{s}" for n in listed for s in (".ids", ".offsets")}
    with os.scandir(root) as entries:
        found = list(entries)
    for entry in found:
        suffix = next((s for s in (".ids", ".offsets") if entry.name.endswith(s)), None)
        if (suffix is None or entry.name in known
                or not is_table_name(entry.name[: -len(suffix)])
                or not entry.is_file(follow_symlinks=False)):
            continue
        try:
            with open(entry.path, "rb") as fh:
                head = fh.read(9)
        except OSError as exc:
            raise ConfigError(f"access log {root}: cannot read {entry.name}: "
                              f"{exc.strerror or exc}") from exc
        empty = not head or (suffix == ".offsets" and len(head) <= 8 and not any(head))
        if not empty:
            table = entry.name[: -len(suffix)]
            raise CorruptStoreError(f"access log {root}: {entry.name} holds batches of table "
                                    f"{table!r}, which {HEADER_NAME} does not list; {_DAMAGED}")


def read_access_log(path: str | os.PathLike[str]) -> AccessLog:
    """Read the access log at `path`, up to each table's last complete batch.

    A sharded store's directory of per-rank logs reads as one log (`_merge_ranks`).

    Raises:
        ConfigError: no access log there, or one this embstore cannot read (permissions, a
            newer version, ranks recorded at different rates).
        CorruptStoreError: the log is damaged: its header, a table's file missing or not a
            regular file, offsets that fall or point past the ids, or a table's files that
            the header does not list. Never a log with a table left out.
        StorageIOError: the medium failed a read.
    """
    root = Path(path)
    if not is_access_log(root):
        raise ConfigError(f"{root} is not an access log (no {HEADER_NAME}); record one with "
                          "embstore.open(..., record_accesses=PATH)")
    if not (root / HEADER_NAME).is_file():
        return _merge_ranks(root, [read_access_log(r) for r in _rank_logs(root)])
    doc = _read_header(root)
    _check_unlisted(root, doc["tables"])
    ids, offsets, rates = {}, {}, {}
    left_out: dict[str, int] = {}
    lost: dict[str, int] = {}
    for name, t in doc["tables"].items():
        raw = _whole_records(_read_file(root, name, ".ids"))
        off = _whole_records(_read_file(root, name, ".offsets"))
        kept, problem = _complete_batches(name, len(raw), off)
        if problem is not None:
            raise CorruptStoreError(f"access log {root}: table {name!r}: {problem}; {_DAMAGED}")
        ids[name], offsets[name] = raw[: int(kept[-1])], kept
        _check_sampled(root, name, ids[name], t["threshold"])
        rates[name] = t["threshold"] / (1 << HASH_BITS)
        if len(raw) > kept[-1]:
            left_out[name] = len(raw) - int(kept[-1])
        if len(kept) < len(off):
            lost[name] = len(off) - len(kept)
    return AccessLog(ids, offsets, rates, left_out, lost)


