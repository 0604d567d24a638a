"""fsck of a pmem table file: header, state blocks, size, preallocation and every record.

Read with `pread` in chunks after checking the file's length, never mapped, so a truncated or
foreign file cannot fault the checker. The record checks mirror what the backend does on
open (`backends/pmem.py`, `_scan_chunk`), but every damaged record is listed instead of the
first raising. The format is `backends/_pmem_format.py`'s.
"""

from __future__ import annotations

import importlib
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from ._fileinfo import read_at
from ._fsck_common import MAX_DETAILED, Finding, RowDump, TableScan, check_rows, original_ids
from .checksum import crc32c, row_checksums
from .spec import TableSpec

__all__ = ["SPEC_MISMATCH", "scan_pmem"]

SPEC_MISMATCH = "does not match the table spec"
"""How a finding says a file's header disagrees with the manifest's spec of its table."""

_CHUNK_SLOTS = 1 << 16


def _fmt() -> Any:
    return importlib.import_module("embstore.backends._pmem_format")


def _header(fmt: Any, head: bytes, spec: TableSpec, rec: int, file: str
            ) -> tuple[list[Finding], tuple[int, int, int] | None]:
    """Findings of the header page, and the current (gen, watermark, reserve)."""
    out: list[Finding] = []
    t = spec.name
    magic, version, dim, dtype_s, rec_size, payload, crc = fmt.HEADER.unpack_from(head)
    if magic != fmt.MAGIC:
        out.append(Finding(t, "not a pmem table file (bad magic)", file=file, offset=0,
                           expected=repr(fmt.MAGIC), found=repr(magic)))
    if crc32c(head[:fmt.HEADER_CRC_OFFSET]) != crc:
        out.append(Finding(t, "header checksum mismatch: the header is damaged", file=file,
                           offset=fmt.HEADER_CRC_OFFSET,
                           expected=f"{crc32c(head[:fmt.HEADER_CRC_OFFSET]):#010x}",
                           found=f"{crc:#010x}"))
    want = (fmt.VERSION, spec.storage_width,
            spec.storage_dtype.str.encode().ljust(8, b"\0"), rec, fmt.REC_PAYLOAD)
    got = (version, dim, dtype_s, rec_size, payload)
    for name, off, w, g in zip(("format version", "dim", "dtype", "record size",
                                "payload offset"), (8, 12, 16, 24, 28), want, got,
                               strict=True):
        if w != g:
            out.append(Finding(t, f"header field {name} {SPEC_MISMATCH}",
                               file=file, offset=off, expected=repr(w), found=repr(g)))
    best = None
    for off in fmt.STATE_OFFSETS:
        gen, wm, reserve, scrc = fmt.STATE.unpack_from(head, off)
        if crc32c(head[off:off + 24]) != scrc or not gen or head[off + 28:off + 32] != bytes(4):
            out.append(Finding(t, "a header state block is damaged (the other one still "
                               "serves)", file=file, offset=off, expected="valid CRC-32C",
                               found=f"gen {gen}, CRC {scrc:#010x}"))
        elif best is None or gen > best[0]:
            best = (gen, wm, reserve)
    if best is None:
        out.append(Finding(t, "both header state blocks are damaged", file=file,
                           offset=fmt.STATE_OFFSETS[0]))
    # everything else of the header page is reserved and zero
    used = [(0, fmt.HEADER.size)] + [(o, o + fmt.STATE.size) for o in fmt.STATE_OFFSETS]
    mask = np.ones(fmt.DATA_OFFSET, dtype=bool)
    for a, b in used:
        mask[a:b] = False
    mask[32:60] = True  # the header's reserved bytes
    nz = np.flatnonzero(mask & (np.frombuffer(head, dtype=np.uint8) != 0))
    if len(nz):
        out.append(Finding(t, f"{len(nz)} reserved header byte(s) are not zero", file=file,
                           offset=int(nz[0]), expected="0", found=f"{head[nz[0]]:#04x}"))
    return out, best


def scan_pmem(file: Path, spec: TableSpec, dump: RowDump | None, *, live: bool = False
              ) -> tuple[list[Finding], TableScan]:
    """Check the pmem table file `file` of `spec`; dump its good rows when repairing.

    `live`: a writer has the file open. The file is scanned until its header page (the state
    blocks) reads the same before and after a scan: the writer retires flushed records only
    after writing a new state (`PmemBackend._flush`), so such a scan saw the file as of its
    last flush, and records it was writing meanwhile were cut-short writes (ignored).
    """
    fmt = _fmt()
    t, where = spec.name, str(file)
    try:
        # O_NONBLOCK: a named pipe in the file's place would block the open for a writer
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        return [Finding(t, f"cannot open the table file: {exc.strerror}", file=where)], \
            TableScan()
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return [Finding(t, "the table file is not a regular file (a pipe or a device was put "
                        "in its place)", file=where)], TableScan()
    try:
        for _ in range(fmt.READER_SCANS if live else 1):
            findings, scan, head = _scan_fd(fd, fmt, spec, where, dump)
            if not live or head == read_at(fd, 0, fmt.DATA_OFFSET):
                return findings, scan
        return [Finding(t, f"its writer changed the file during each of {fmt.READER_SCANS} "
                        "scans; run fsck again when it flushes less often", file=where)], \
            TableScan()
    finally:
        os.close(fd)


def _scan_fd(fd: int, fmt: Any, spec: TableSpec, where: str, dump: RowDump | None
             ) -> tuple[list[Finding], TableScan, bytes]:
    """One scan of the open table file: findings, rows, and the header page it went by."""
    t = spec.name
    scan = TableScan()
    row_bytes = spec.storage_width * spec.storage_dtype.itemsize
    rec = fmt.record_size(row_bytes)
    findings: list[Finding] = []
    st = os.fstat(fd)
    size = st.st_size
    if size < fmt.DATA_OFFSET:
        return [Finding(t, "the file is shorter than its header page", file=where,
                        expected=f">= {fmt.DATA_OFFSET} bytes", found=f"{size} bytes")], \
            scan, b""
    head = read_at(fd, 0, fmt.DATA_OFFSET)
    found, state = _header(fmt, head, spec, rec, where)
    findings += found
    if any(f.offset in (0, fmt.HEADER_CRC_OFFSET, 12, 16, 24, 28) for f in found) \
            or state is None:
        return findings, scan, head  # records cannot be read with a header like this
    _, watermark, reserve = state
    if (size - fmt.DATA_OFFSET) // rec > fmt.MAX_SLOTS:
        # never written so (the slot index is 32-bit): grown by damage, e.g. a truncate out
        # to a terabyte, which the table's open refuses too; a scan would read it all
        findings.append(Finding(t, f"the file holds more than the {fmt.MAX_SLOTS} slots a "
                                "table file has at most (grown by damage or not embstore's)",
                                file=where, expected=f"<= {fmt.DATA_OFFSET} + "
                                f"{fmt.MAX_SLOTS} * {rec} bytes", found=f"{size} bytes"))
        return findings, scan, head
    extra = (size - fmt.DATA_OFFSET) % rec
    if extra:
        findings.append(Finding(t, "the file ends inside a record (cut short or grown "
                                "by hand)", file=where, offset=size - extra,
                                expected=f"{fmt.DATA_OFFSET} + k * {rec} bytes",
                                found=f"{size} bytes"))
    if st.st_blocks * 512 < size - extra:
        findings.append(Finding(t, "the file is sparse: its slots are not preallocated, "
                                "and a write into a hole can kill the process (SIGBUS)",
                                file=where, expected=f">= {size - extra} bytes allocated",
                                found=f"{st.st_blocks * 512} bytes allocated"))
    _records(fd, fmt, spec, rec, row_bytes, (size - fmt.DATA_OFFSET) // rec, watermark,
             reserve, where, findings, scan, dump)
    return findings, scan, head


def _records(fd: int, fmt: Any, spec: TableSpec, rec: int, row_bytes: int, slots: int,
             watermark: int, reserve: int, where: str, findings: list[Finding],
             scan: TableScan, dump: RowDump | None) -> None:
    """Check every record; winners (newest valid version per id) are the table's rows."""
    t = spec.name
    counts: dict[str, int] = {}
    live_slots, live_ids, live_seq = [], [], []
    for lo in range(0, slots, _CHUNK_SLOTS):
        n = min(_CHUNK_SLOTS, slots - lo)
        raw = read_at(fd, fmt.DATA_OFFSET + lo * rec, n * rec)
        recs = np.frombuffer(raw, dtype=np.uint8).reshape(n, rec)
        seq_word = recs[:, fmt.REC_SEQ:fmt.REC_SEQ + 8].copy().view("<u8")[:, 0]
        ids = recs[:, fmt.REC_ID:fmt.REC_ID + 8].copy().view("<i8")[:, 0]
        stored = recs[:, fmt.REC_CRC:fmt.REC_CRC + 4].copy().view("<u4")[:, 0]
        kind = recs[:, fmt.REC_KIND:fmt.REC_KIND + 4].copy().view("<u4")[:, 0]
        covered = recs[:, fmt.REC_KIND:fmt.REC_PAYLOAD + row_bytes]
        calc = row_checksums(ids, covered)
        seq, intact = fmt.seq_counters(seq_word)
        used = seq_word != 0
        valid = used & (calc == stored) & (kind == fmt.KIND_ROW)
        bad = np.flatnonzero(used & ~valid)
        torn = intact[bad] & (seq[bad] > watermark) & (seq[bad] <= reserve)
        damaged = bad[~torn]
        if len(damaged):
            guess = original_ids(ids[damaged[:MAX_DETAILED]], covered[damaged[:MAX_DETAILED]],
                                 stored[damaged[:MAX_DETAILED]])
            for j, s in enumerate(damaged.tolist()):
                counts["crc"] = counts.get("crc", 0) + 1
                if counts["crc"] > MAX_DETAILED:
                    continue
                note = (f" (it is the row of id {int(guess[j])} under a damaged id field)"
                        if j < len(guess) and guess[j] >= 0 else "")
                findings.append(Finding(
                    t, f"record in slot {lo + s} fails its checksum{note}", file=where,
                    id=int(ids[s]), offset=fmt.DATA_OFFSET + (lo + s) * rec,
                    expected=f"CRC-32C {int(calc[s]):#010x}, kind {fmt.KIND_ROW}",
                    found=f"CRC-32C {int(stored[s]):#010x}, kind {int(kind[s])}"))
            scan.drop(ids[damaged])
        pad = recs[:, fmt.REC_PAYLOAD + row_bytes:]
        if pad.shape[1]:
            for s in np.flatnonzero(valid & pad.any(axis=1)).tolist():
                counts["pad"] = counts.get("pad", 0) + 1
                if counts["pad"] <= MAX_DETAILED:
                    findings.append(Finding(t, f"padding of the record in slot {lo + s} is "
                                            "not zero", file=where, id=int(ids[s]),
                                            offset=fmt.DATA_OFFSET + (lo + s) * rec
                                            + fmt.REC_PAYLOAD + row_bytes))
        live = np.flatnonzero(valid)
        live_slots.append(live + lo)
        live_ids.append(ids[live])
        live_seq.append(seq[live])
    _sum_up(counts, (("crc", "damaged records"), ("pad", "records with dirty padding")), t,
            where, findings)
    all_slots = np.concatenate(live_slots) if live_slots else np.zeros(0, np.int64)
    all_ids = np.concatenate(live_ids) if live_ids else np.zeros(0, np.int64)
    all_seq = np.concatenate(live_seq) if live_seq else np.zeros(0, np.uint64)
    order = np.lexsort((all_seq, all_ids))
    all_slots, all_ids, all_seq = all_slots[order], all_ids[order], all_seq[order]
    newest = np.ones(len(all_ids), dtype=bool)
    newest[:-1] = all_ids[1:] != all_ids[:-1]
    same = np.flatnonzero(~newest[:-1] & (all_seq[1:] == all_seq[:-1])) if len(all_ids) > 1 \
        else np.zeros(0, np.int64)
    for i in same[:MAX_DETAILED].tolist():
        findings.append(Finding(t, f"two records of id {int(all_ids[i])} carry the same "
                                f"sequence number {int(all_seq[i])}", file=where,
                                id=int(all_ids[i])))
    winners, win_ids = all_slots[newest], all_ids[newest]
    _rows(fd, fmt, spec, rec, row_bytes, winners, win_ids, where, findings, scan, dump)


def _rows(fd: int, fmt: Any, spec: TableSpec, rec: int, row_bytes: int, slots: np.ndarray,
          ids: np.ndarray, where: str, findings: list[Finding], scan: TableScan,
          dump: RowDump | None) -> None:
    """Check the table's rows (the winning records) against the spec; dump the good ones."""
    counts: dict[str, int] = {}
    order = np.argsort(slots, kind="stable")
    slots, ids = slots[order], ids[order]
    for start in range(0, len(slots), _CHUNK_SLOTS):
        s, i = slots[start:start + _CHUNK_SLOTS], ids[start:start + _CHUNK_SLOTS]
        lo, hi = int(s[0]), int(s[-1]) + 1
        raw = np.frombuffer(read_at(fd, fmt.DATA_OFFSET + lo * rec, (hi - lo) * rec),
                            dtype=np.uint8).reshape(hi - lo, rec)
        payload = raw[s - lo, fmt.REC_PAYLOAD:fmt.REC_PAYLOAD + row_bytes].copy()
        dtype = spec.storage_dtype
        rows = payload.view(dtype.newbyteorder("<")).astype(dtype, copy=False)
        bad = check_rows(spec, i, rows, where, counts, findings)
        scan.drop(i[bad])
        scan.rows += int(len(i) - np.count_nonzero(bad))
        if dump is not None:
            dump.append(spec.name, i[~bad], rows[~bad])
    _sum_up(counts, (("range", "rows with ids out of range"),
                     ("finite", "rows holding NaN or infinity"),
                     ("state", "rows holding a state no step reaches")), spec.name, where,
            findings)


def _sum_up(counts: dict[str, int], kinds: tuple[tuple[str, str], ...], table: str, where: str,
            findings: list[Finding]) -> None:
    """One finding for the rows of each kind past the MAX_DETAILED listed one by one."""
    for kind, what in kinds:
        if counts.get(kind, 0) > MAX_DETAILED:
            findings.append(Finding(table, f"{counts[kind] - MAX_DETAILED} more {what}",
                                    file=where))

