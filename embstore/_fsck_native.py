"""fsck of the LMDB and RocksDB tiers, run in a child process (`python -m embstore._fsck_native`).

The native libraries read damaged files without checks of their own in places (an LMDB page
number pointing anywhere), so fsck runs these scanners in a child: a crash there becomes a
finding of the parent, not a dead fsck. The child reads one JSON request on stdin
(`backend`, `dir`, `tables` as manifest entries, `options`, `dump`, `clean`, `live`: a
writer has the tier open) and writes one JSON answer on stdout (`findings`, and per table
`rows`, `dropped` ids and their count).

LMDB: both meta pages by hand (`_fileinfo`), the main database's names, each table's metadata
record, then every row in key order: key length and order, value length, CRC-32C (which
covers the id, so a row under a key that is not its own fails it; the id it belongs to is
searched one byte away), id range, finiteness and optimizer state, that a lookup by key finds
the same row, and the entry count LMDB records. RocksDB: every write-ahead log and MANIFEST
record's checksum (read by hand: RocksDB's own recovery stops silently at the first bad
record), then the database opened read-only with paranoid checks, every row read with block
checksums verified, and read again by multi-get (index and bloom filter blocks).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ._fileinfo import lmdb_map_size_ok, lmdb_metas, open_regular, read_at
from ._fsck_common import MAX_DETAILED, Finding, RowDump, TableScan, check_rows, original_ids
from ._lmdb_walk import walk as walk_lmdb
from .checksum import crc32c, row_checksums
from .errors import CorruptStoreError
from .spec import TableSpec

__all__ = ["check_log", "main", "scan"]

PAGE = 65536
_LIVE_TRIES = 8
_SIGN = np.uint64(1 << 63)


def _decode(keys: list[bytes]) -> np.ndarray:
    return (np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64) ^ _SIGN).view(np.int64)


class _Rows:
    """Checks pages of (keys, values) of one table in key order."""

    def __init__(self, spec: TableSpec, file: str, findings: list[Finding],
                 dump: RowDump | None) -> None:
        self.spec, self.file, self.findings, self.dump = spec, file, findings, dump
        self.rec = np.dtype([("crc", "<u4"), ("row", spec.storage_dtype, (spec.storage_width,))])
        self.scan = TableScan()
        self.counts: dict[str, int] = {}
        self.last: int | None = None

    def _note(self, kind: str, finding: Finding) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.counts[kind] <= MAX_DETAILED:
            self.findings.append(finding)

    def page(self, keys: list[bytes], values: list[bytes]) -> np.ndarray:
        """Check one page; returns the ids of its good rows."""
        t, f = self.spec.name, self.file
        klen = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
        vlen = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        for i in np.flatnonzero(klen != 8).tolist():
            self._note("key", Finding(t, "a key is not 8 bytes long", file=f,
                                      expected="8 bytes", found=f"{klen[i]} bytes: "
                                      f"{keys[i][:16].hex()}"))
        ok_key = klen == 8
        ids = np.zeros(len(keys), dtype=np.int64)
        if ok_key.any():
            ids[ok_key] = _decode([k for k, ok in zip(keys, ok_key.tolist(), strict=True)
                                   if ok])
        prev = np.concatenate([[self.last if self.last is not None else np.iinfo(np.int64).min],
                               ids[:-1]])
        disorder = ok_key & (ids <= prev)
        disorder[0] &= self.last is not None
        for i in np.flatnonzero(disorder).tolist():
            self._note("order", Finding(t, f"key of id {int(ids[i])} comes after id "
                                        f"{int(prev[i])}: the keys are out of order (a damaged "
                                        "key or page)", file=f, id=int(ids[i])))
        if len(ids):
            self.last = int(ids[ok_key][-1]) if ok_key.any() else self.last
        ok_len = vlen == self.rec.itemsize
        for i in np.flatnonzero(ok_key & ~ok_len).tolist():
            self._note("len", Finding(t, f"value of id {int(ids[i])} has the wrong length",
                                      file=f, id=int(ids[i]),
                                      expected=f"{self.rec.itemsize} bytes",
                                      found=f"{vlen[i]} bytes"))
        good = ok_key & ok_len
        sel = np.flatnonzero(good)
        packed = np.frombuffer(b"".join(values[i] for i in sel.tolist()), dtype=self.rec)
        sel_ids = ids[sel]
        crc_bad = row_checksums(sel_ids, packed["row"]) != packed["crc"]
        rows, rids = packed["row"][~crc_bad], sel_ids[~crc_bad]
        if crc_bad.any():
            b = np.flatnonzero(crc_bad)
            # a row under a damaged key is intact under its own id: found one byte away
            head = b[:max(0, 1000 - self.counts.get("crc", 0))]
            guess = original_ids(sel_ids[head], packed["row"][head], packed["crc"][head])
            for j, i in enumerate(b.tolist()):
                rid = int(sel_ids[i])
                note = (f"; it is the row of id {int(guess[j])}, under a damaged key (a repair "
                        "puts it back under its own id)"
                        if j < len(guess) and guess[j] >= 0 else
                        " (a damaged value, or a value under a key that is not its own id)")
                self._note("crc", Finding(t, f"row stored under the key of id {rid} fails "
                                          f"its checksum{note}", file=f, id=rid,
                                          expected=f"CRC-32C of id {rid} and the row",
                                          found=f"stored CRC-32C {int(packed['crc'][i]):#010x}"))
            back = guess >= 0
            self.scan.drop(np.concatenate([sel_ids[b[len(head):]], sel_ids[head][~back]]))
            rows = np.concatenate([rows, packed["row"][head][back]])
            rids = np.concatenate([rids, guess[back]])
        bad_spec = check_rows(self.spec, rids, rows, f, self.counts, self.findings)
        keep = ~bad_spec
        self.scan.drop(ids[~good])
        self.scan.drop(rids[bad_spec])
        self.scan.rows += int(np.count_nonzero(keep))
        if self.dump is not None:
            self.dump.append(self.spec.name, rids[keep], rows[keep])
        good_ids: np.ndarray = rids
        return good_ids

    def finish(self) -> None:
        """Sum up what was not listed one by one."""
        for kind, n in self.counts.items():
            if n > MAX_DETAILED:
                self.findings.append(Finding(self.spec.name, f"{n - MAX_DETAILED} more "
                                             f"findings of this kind ({kind})", file=self.file))


def _scan_lmdb(d: Path, specs: list[TableSpec], options: dict[str, Any],
               dump: RowDump | None, live: bool) -> tuple[list[Finding], dict[str, TableScan]]:
    """Check an LMDB tier: meta pages, then every table's rows in one read transaction.

    `live`: a writer has the environment open. The scan registers as a reader (LMDB's lock
    file: the writer then reuses none of its pages) and checks the snapshot it pins: the meta
    page of that transaction, the B-trees walked from it (`_lmdb_walk`), and its rows. The
    other meta page may be the writer's next commit, half written: it is not judged.
    """
    import lmdb

    file = d / "data.mdb"
    where = str(file)
    env = None
    try:
        if live:
            env = lmdb.open(str(d), readonly=True, lock=True, subdir=True,
                            max_dbs=max(int(options.get("max_tables", 64)), len(specs) + 1),
                            readahead=False)
            for _ in range(_LIVE_TRIES):
                txn = env.begin()
                metas = lmdb_metas(file, os.stat(file, follow_symlinks=False).st_size)
                ours = [m for m in metas if m.txnid == txn.id()]
                raw = read_at_path(file, ours[0].page * ours[0].page_size, 152) if ours \
                    else b""
                if ours and _META_TXNID.unpack_from(raw, 144)[0] == txn.id():
                    break
                txn.abort()  # the writer committed twice meanwhile: pin a newer snapshot
            else:
                return [Finding(None, "the writer committed faster than fsck could pin a "
                                "snapshot; run fsck again", file=where)], {}
            findings = _lmdb_metas_findings(ours, options, where)
            if ours[0].problems:
                txn.abort()
                return findings, {}
            findings += [Finding(None, f"LMDB structure: {problem}", file=where, offset=offset)
                         for offset, problem in walk_lmdb(file, ours[0], raw)]
        else:
            size = os.stat(file, follow_symlinks=False).st_size
            metas = lmdb_metas(file, size)
            findings = _lmdb_metas_findings(metas, options, where)
            if size % metas[0].page_size:
                findings.append(Finding(None, "the LMDB data file ends inside a page",
                                        file=where, expected=f"a multiple of "
                                        f"{metas[0].page_size} bytes", found=f"{size} bytes"))
            if max(metas, key=lambda m: m.txnid).problems:
                return findings, {}  # LMDB would read through a damaged meta page
            env = lmdb.open(str(d), readonly=True, lock=False, subdir=True,
                            max_dbs=max(int(options.get("max_tables", 64)), len(specs) + 1),
                            readahead=False)
            txn = env.begin()
        try:
            scans = _lmdb_tables(env, txn, specs, where, findings, dump)
        finally:
            txn.abort()
    finally:
        if env is not None:
            env.close()
    return findings, scans


_META_TXNID = struct.Struct("<Q")


def read_at_path(file: Path, offset: int, size: int) -> bytes:
    """Up to `size` bytes of `file` at `offset`."""
    fd = open_regular(file)
    try:
        return read_at(fd, offset, size)
    finally:
        os.close(fd)


def _lmdb_metas_findings(metas: list[Any], options: dict[str, Any], where: str
                         ) -> list[Finding]:
    findings = []
    for m in metas:
        for p in m.problems:
            findings.append(Finding(None, f"LMDB {p}", file=where, offset=m.page * m.page_size))
        if m.txnid and not lmdb_map_size_ok(m.map_size, options):
            findings.append(Finding(None, f"LMDB meta page {m.page} records a map size the "
                                    "tier's options never set", file=where,
                                    offset=m.page * m.page_size + 32,
                                    expected="map_size_bytes doubled up to max_map_size_bytes",
                                    found=str(m.map_size)))
    return findings


def _lmdb_tables(env: Any, txn: Any, specs: list[TableSpec], where: str,
                 findings: list[Finding], dump: RowDump | None) -> dict[str, TableScan]:
    """Every table's metadata record and rows, read in the one transaction `txn`."""
    scans: dict[str, TableScan] = {}
    names = [k for k, _ in txn.cursor()]
    expected = {b"embstore:meta"} | {b"t:" + s.name.encode() for s in specs}
    for name in names:
        if name not in expected:
            findings.append(Finding(None, f"unknown LMDB database {name!r} (damaged or "
                                    "foreign)", file=where))
    if b"embstore:meta" not in names:
        findings.append(Finding(None, "the LMDB metadata database is missing", file=where))
        meta_db = None
    else:
        meta_db = env.open_db(b"embstore:meta", txn=txn, create=False)
    for spec in specs:
        rows = _Rows(spec, where, findings, dump)
        scans[spec.name] = rows.scan
        if meta_db is not None:
            _check_meta(spec, txn.get(spec.name.encode(), db=meta_db), where, findings)
        if b"t:" + spec.name.encode() not in names:
            findings.append(Finding(spec.name, "the table's LMDB database is missing",
                                    file=where))
            continue
        db = env.open_db(b"t:" + spec.name.encode(), txn=txn, create=False)
        entries = txn.stat(db)["entries"]
        seen = 0
        cur = txn.cursor(db=db)
        ok = cur.first()
        while ok:
            keys: list[bytes] = []
            vals: list[bytes] = []
            while ok and len(keys) < PAGE:
                keys.append(cur.key())
                vals.append(cur.value())
                ok = cur.next()
            seen += len(keys)
            rows.page(keys, vals)
            for k, v in zip(keys, vals, strict=True):  # a lookup finds each row
                if txn.get(k, db=db) != v:
                    kid = _decode([k])[0] if len(k) == 8 else None
                    rows._note("reach", Finding(
                        spec.name, "a row the scan finds is not found by a lookup "
                        "of its key (the B-tree order is damaged)", file=where,
                        id=None if kid is None else int(kid)))
        if seen != entries:
            findings.append(Finding(spec.name, "LMDB's entry count disagrees with a "
                                    "scan", file=where, expected=f"{entries} rows "
                                    "(recorded)", found=f"{seen} rows (scanned)"))
        rows.finish()
    return scans


def _check_meta(spec: TableSpec, raw: bytes | None, where: str,
                findings: list[Finding]) -> None:
    want = {"dim": spec.storage_width, "dtype": spec.storage_dtype.str}
    try:
        got = json.loads(raw) if raw is not None else None
    except ValueError:
        got = "unreadable"
    if not isinstance(got, dict) or {k: got.get(k) for k in want} != want:
        findings.append(Finding(spec.name, "the table's metadata record does not match its "
                                "spec", file=where, expected=json.dumps(want),
                                found=repr(raw)[:120]))


def _mask(c: int) -> int:
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def check_log(file: Path, *, allow_torn_tail: bool) -> list[tuple[int, str]]:
    """(offset, problem) of each RocksDB log record (WAL or MANIFEST) failing its checks.

    Records: CRC-32C (masked) u32, length u16, type u8 (+ log number u32 for types 5-8),
    payload; in 32 KiB blocks whose last < 7 bytes are zero padding. A last record that runs
    past the file's end is a write cut short by a crash: allowed with `allow_torn_tail`.
    """
    problems: list[tuple[int, str]] = []
    fd = open_regular(file)
    try:
        size = os.fstat(fd).st_size
        for base in range(0, size, 32768):
            block = read_at(fd, base, 32768)
            pos = 0
            while pos < len(block):
                if len(block) - pos < 7:
                    if any(block[pos:]):
                        problems.append((base + pos, "block trailer is not zero"))
                    break
                crc, length, typ = struct.unpack_from("<IHB", block, pos)
                if typ == 0 and length == 0 and crc == 0:
                    if any(block[pos:]):
                        problems.append((base + pos, "a zero record header before data"))
                    break
                head = 11 if typ >= 5 else 7
                end = pos + head + length
                if 1 <= typ <= 8 and end > len(block) and base + len(block) >= size:
                    problems.append((base + pos, "cut short: record runs past the file's end"))
                    break
                if not 1 <= typ <= 8 or end > len(block):
                    problems.append((base + pos, f"record header damaged (type {typ}, "
                                     f"length {length})"))
                    break
                if _mask(crc32c(block[pos + 6:end])) != crc:
                    problems.append((base + pos, "record fails its checksum"))
                pos = end
        if allow_torn_tail and len(problems) == 1 and problems[0][1].startswith("cut short"):
            problems.clear()  # the last write, cut short by a crash
    finally:
        os.close(fd)
    return problems


def _scan_rocksdb(d: Path, specs: list[TableSpec], options: dict[str, Any],
                  dump: RowDump | None, clean: bool, live: bool
                  ) -> tuple[list[Finding], dict[str, TableScan]]:
    """Check a RocksDB tier: its log and MANIFEST records, then every table's rows.

    The database is opened read-only (`open_read_only`: nothing is written in the tier
    directory). `live`: a writer has it open; the newest log and the MANIFEST may end in a
    record it is writing, and a log it deletes meanwhile is skipped; the rows are those of
    the snapshot the read-only open took.
    """
    from .backends.rocksdb import (  # type: ignore[import-not-found]
        RocksDBBackend,
        _make_options,
        check_log_framing,
        open_read_only,
    )

    findings: list[Finding] = []
    scans: dict[str, TableScan] = {}
    current = d / "CURRENT"
    try:
        name = current.read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        return [Finding(None, f"RocksDB's CURRENT file is unreadable ({exc})",
                        file=str(current))], scans
    if not name.startswith("MANIFEST-"):
        return [Finding(None, "RocksDB's CURRENT names no MANIFEST file", file=str(current),
                        expected="MANIFEST-<number>", found=repr(name))], scans
    if not (d / name).is_file():
        return [Finding(None, f"RocksDB's CURRENT names {name}, which is missing (files of "
                        "the store were removed): restore the store from a checkpoint",
                        file=str(d / name))], scans
    logs = sorted(d.glob("*.log"))
    for log in [d / name] + logs:
        torn_ok = not clean and (log in (logs[-1:] or [d / name])
                                 or (live and log == d / name))
        try:
            problems = check_log(log, allow_torn_tail=torn_ok)
        except FileNotFoundError:
            if not live:
                raise
            continue  # the writer deleted it (a log whose memtable it flushed)
        for off, problem in problems:
            findings.append(Finding(None, f"RocksDB log {problem}; the rows it holds are "
                                    "lost to RocksDB's recovery", file=str(log), offset=off))
    # even past a damaged log record: RocksDB's recovery reads the rows before it, which is
    # what a repair can keep
    import inspect

    defaults = {p.name: p.default for p in
                inspect.signature(RocksDBBackend.__init__).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    settings = tuple((k, options.get(k, v)) for k, v in defaults.items()
                     if k not in ("sync_writes", "cold_read_threads"))
    import rocksdict

    try:
        check_log_framing(d)
    except CorruptStoreError as exc:  # RocksDB would hang on it: the rows cannot be read
        findings.append(Finding(None, f"{exc}; RocksDB cannot open this tier", file=str(d)))
        return findings, scans
    cache = rocksdict.Cache(8 << 20)
    cfs = rocksdict.Rdict.list_cf(str(d), rocksdict.Options(raw_mode=True))
    opts = _make_options(settings, cache, db=True, column_families=len(cfs))
    opts.create_if_missing(False)
    opts.set_paranoid_checks(True)
    db, cfs = open_read_only(d, opts, lambda: _make_options(settings, cache))
    try:
        expected = {"default"} | {"t:" + s.name for s in specs}
        for cf_name in cfs:
            if cf_name not in expected:
                findings.append(Finding(None, f"unknown RocksDB column family {cf_name!r}",
                                        file=str(d)))
        for spec in specs:
            where = f"{d} (column family 't:{spec.name}')"
            rows = _Rows(spec, where, findings, dump)
            scans[spec.name] = rows.scan
            _check_meta(spec, db.get(b"embstore/table/" + spec.name.encode()), str(d),
                        findings)
            if "t:" + spec.name not in cfs:
                findings.append(Finding(spec.name, "the table's column family is missing",
                                        file=str(d)))
                continue
            cf = db.get_column_family("t:" + spec.name)
            for keys, vals in _rocks_pages(cf, rows, where, d):
                again: Any = cf[keys]
                if list(again) != vals:
                    rows._note("reach", Finding(spec.name, "a multi-get of scanned keys "
                                                "returns other values", file=where))
            rows.finish()
    finally:
        db.close()
    return findings, scans


def _rocks_pages(cf: Any, rows: _Rows, where: str, d: Path
                 ) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """Every page of a column family, forward; after a damaged block, the rest backward.

    The rows in between, in the damaged block(s), are unread: their keys lie strictly
    between the last key read forward and the first key read backward, which
    `rows.scan.lost_range` records.
    """
    import rocksdict

    from .backends.rocksdb import error_text

    ro = rocksdict.ReadOptions()
    ro.set_verify_checksums(True)
    last: bytes | None = None
    keys: list[bytes]
    vals: list[bytes]
    try:
        it = cf.iter(ro)
        it.seek_to_first()
        while it.valid():
            keys, vals = [], []
            while it.valid() and len(keys) < PAGE:
                keys.append(it.key())
                vals.append(it.value())
                it.next()
            if keys:
                rows.page(keys, vals)
                last = keys[-1]
                yield keys, vals
        it.status()
        return
    except Exception as exc:
        rows.scan.unreadable = True
        rows.findings.append(Finding(rows.spec.name, f"RocksDB reports damaged data while "
                                     f"scanning ({' '.join(error_text(exc, d).split())})",
                                     file=where))
    keys, vals = [], []
    try:  # read what lies past the damaged block from the other end
        it = cf.iter(ro)
        it.seek_to_last()
        while it.valid() and (last is None or it.key() > last):
            keys.append(it.key())
            vals.append(it.value())
            it.prev()
    except Exception:
        pass  # a second damaged block: keep what was read up to it
    if keys:
        rows.last = None
        rows.page(keys[::-1], vals[::-1])


def _cross_tiers(request: dict[str, Any]) -> list[Finding]:
    """Rows a persistent cache tier kept at a clean close must equal the store of record's."""
    from . import registry
    from ._rebuild import open_bottom
    from .backend import BackendSpec
    from .errors import EmbstoreError
    from .layout import table_chain, tier_dir
    from .spec import TierSpec

    root = Path(request["dir"])
    tiers = tuple(TierSpec.from_json(t) for t in request["tiers"])
    findings: list[Finding] = []
    for spec in (TableSpec.from_json(t) for t in request["tables"]):
        chain = table_chain(spec, tiers)
        uppers = [(level, ts) for level, ts in enumerate(chain[:-1])
                  if registry.load_backend(ts.backend).supports_persistence
                  and tier_dir(root, level, ts.backend, is_bottom=False).is_dir()]
        if not uppers:
            continue
        with open_bottom(root, spec, tiers, read_only=True) as bottom:
            for level, ts in uppers:
                d = tier_dir(root, level, ts.backend, is_bottom=False)
                try:
                    upper = registry.load_backend(ts.backend).open(BackendSpec(
                        path=d, dim=spec.storage_width, dtype=spec.storage_dtype, table=spec.name,
                        read_only=True), **ts.options)
                except EmbstoreError:
                    continue  # no such table in that tier: nothing cached
                with upper:
                    bad = 0
                    for ids, rows in upper.items(PAGE):
                        below, found = bottom.get(ids)
                        differ = ~found | (below != rows).any(axis=1)
                        for i in np.flatnonzero(differ).tolist():
                            bad += 1
                            if bad <= MAX_DETAILED:
                                findings.append(Finding(
                                    spec.name, f"tier {level} ({ts.backend}) holds a clean copy "
                                    f"of id {int(ids[i])} that "
                                    + ("the store of record lacks" if not found[i] else
                                       "disagrees with the store of record's row"),
                                    file=str(d), id=int(ids[i])))
                    if bad > MAX_DETAILED:
                        findings.append(Finding(spec.name, f"{bad - MAX_DETAILED} more cached "
                                                "rows disagree", file=str(d)))
    return findings


def scan(request: dict[str, Any]) -> dict[str, Any]:
    """Run one scanner as `main` does and return its answer."""
    if request["backend"] == "cross-tier":
        try:
            found = _cross_tiers(request)
        except Exception as exc:
            found = [Finding(None, f"comparing cache tiers failed: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())}", file=request["dir"])]
        return {"findings": [f.to_json() for f in found], "tables": {}}
    d = Path(request["dir"])
    specs = [TableSpec.from_json(t) for t in request["tables"]]
    dump = RowDump(Path(request["dump"])) if request.get("dump") else None
    try:
        live = bool(request.get("live"))
        if request["backend"] == "lmdb":
            findings, scans = _scan_lmdb(d, specs, request.get("options") or {}, dump, live)
        else:
            findings, scans = _scan_rocksdb(d, specs, request.get("options") or {}, dump,
                                            bool(request.get("clean")), live)
    except UnicodeEncodeError:  # the libraries take paths as UTF-8 text
        findings = [Finding(None, f"the {request['backend']} files cannot be read: their path "
                            "is not valid UTF-8; rename the store's directory (or the ones "
                            "above it) to UTF-8 names", file=str(d))]
        scans = {}
    except Exception as exc:
        findings = [Finding(None, f"the {request['backend']} reader failed: "
                            f"{type(exc).__name__}: {' '.join(str(exc).split())}",
                            file=str(d))]
        scans = {}
    out_tables = {}
    for name, s in scans.items():
        dropped = s.dropped_ids()
        out_tables[name] = {"rows": s.rows, "dropped": dropped[:1000].tolist(),
                            "dropped_count": len(dropped), "unreadable": s.unreadable}
    return {"findings": [f.to_json() for f in findings], "tables": out_tables}


def main() -> int:
    """Read a request on stdin, write the answer on stdout."""
    request = json.loads(sys.stdin.read())
    json.dump(scan(request), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
