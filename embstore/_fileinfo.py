"""Reading the fixed headers of a tier's files by hand: LMDB meta pages, pmem state, RocksDB files.

Plain reads with every length checked first, nothing mapped and no native library called, so
these are safe on damaged or foreign files. `fingerprint` combines them into what changes when
a writer touches a tier (an LMDB transaction id, a pmem state generation, RocksDB's set of
files), which tells `fsck` whether a store is still as its last clean close left it.

LMDB meta page (two of them: page 0 and page 1; 64-bit build), byte offsets in the page:

    offset  size  field
    0       8     page number (0 or 1)
    10      2     page flags (0x08 = P_META)
    16      4     magic 0xBEEFC0DE
    20      4     data version (1)
    32      8     map size
    40      48    free-list database record; its first 4 bytes hold the page size
    88      48    main database record: pad u32, flags u16, depth u16, branch, leaf and
                  overflow page counts u64, entries u64, root page u64
    136     8     last page used
    144     8     transaction id; the meta page with the higher one is current
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checksum import crc32c

__all__ = ["LMDB_MAGIC", "LMDBMeta", "fingerprint", "lmdb_map_size_ok", "lmdb_metas",
           "open_regular",
           "pmem_state", "read_at"]

LMDB_MAGIC = 0xBEEFC0DE
LMDB_VERSION = 1
P_META = 0x08
_PAGE_HEAD = struct.Struct("<QHH")
_META_HEAD = struct.Struct("<IIQQ")
_DB = struct.Struct("<IHHQQQQQ")
_META_TAIL = struct.Struct("<QQ")


def read_at(fd: int, offset: int, size: int) -> bytes:
    """Exactly `size` bytes at `offset` of `fd`, or fewer where the file ends."""
    out = bytearray()
    while len(out) < size:
        chunk = os.pread(fd, size - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


@dataclass(frozen=True)
class LMDBMeta:
    """One LMDB meta page, as read."""

    page: int
    problems: tuple[str, ...]
    page_size: int
    map_size: int
    main_entries: int
    main_root: int
    main_depth: int
    last_page: int
    txnid: int


def open_regular(file: Path) -> int:
    """A read-only descriptor of the regular file `file` (not through a symbolic link).

    Opened without waiting: a named pipe put in a file's place would block the open until a
    writer came, and the reads after it for ever.

    Raises:
        OSError: it cannot be opened, or is not a regular file (EINVAL).
    """
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(file))
    return fd


def lmdb_metas(file: Path, file_size: int) -> list[LMDBMeta]:
    """Both meta pages of the LMDB data file `file` with what is wrong with each.

    The page size is read from page 0 (4096 if that is implausible). Raises OSError only
    when the file cannot be opened.
    """
    fd = open_regular(file)
    try:
        first = read_at(fd, 0, 152)
        psize = 4096
        if len(first) >= 44:
            cand = struct.unpack_from("<I", first, 40)[0]
            if cand in (4096, 8192, 16384, 32768, 65536):
                psize = cand
        metas = []
        for page in (0, 1):
            raw = read_at(fd, page * psize, 152)
            problems: list[str] = []
            if len(raw) < 152:
                metas.append(LMDBMeta(page, (f"meta page {page} is cut short "
                                             f"({len(raw)} of 152 bytes)",), psize, 0, 0, 0,
                                      0, 0, 0))
                continue
            pgno, pad, flags = _PAGE_HEAD.unpack_from(raw, 0)
            magic, version, address, map_size = _META_HEAD.unpack_from(raw, 16)
            if pad or raw[12:16] != bytes(4) or address:
                problems.append(f"meta page {page} has nonzero bytes where LMDB writes zeros "
                                "(page pad and bounds, map address)")
            free = _DB.unpack_from(raw, 40)
            main = _DB.unpack_from(raw, 88)
            last_pg, txnid = _META_TAIL.unpack_from(raw, 136)
            if pgno != page:
                problems.append(f"meta page {page} names itself page {pgno}")
            if flags != P_META:
                problems.append(f"meta page {page} has flags {flags:#x}, expected {P_META:#x}")
            if magic != LMDB_MAGIC:
                problems.append(f"meta page {page} has magic {magic:#x}, expected "
                                f"{LMDB_MAGIC:#x}")
            if version != LMDB_VERSION:
                problems.append(f"meta page {page} has version {version}, expected "
                                f"{LMDB_VERSION}")
            if free[0] != psize:
                problems.append(f"meta page {page} records page size {free[0]}, page 0 "
                                f"{psize}")
            pages = file_size // psize
            if not 2 <= last_pg + 1 <= max(pages, 2):
                problems.append(f"meta page {page} ends the data at page {last_pg}, the file "
                                f"has {pages} pages")
            if map_size < file_size or map_size % psize:
                problems.append(f"meta page {page} has map size {map_size} for a file of "
                                f"{file_size} bytes")
            if free[1] != 0x08 or main[0] or main[1]:
                problems.append(f"meta page {page}: database flags {free[1]:#x}/{main[1]:#x} "
                                "(expected 0x8 for the free list, 0 for main) or pad "
                                f"{main[0]}")
            if txnid and txnid % 2 != page:
                problems.append(f"meta page {page} holds transaction {txnid}, which belongs "
                                f"to meta page {txnid % 2}")
            for name, db in (("free-list", free), ("main", main)):
                root = db[7]
                if root != 0xFFFFFFFFFFFFFFFF and not 2 <= root <= last_pg:
                    problems.append(f"meta page {page}: the {name} database's root page "
                                    f"{root} lies outside pages 2..{last_pg}")
                if db[3] + db[4] + db[5] > max(last_pg, 0):
                    problems.append(f"meta page {page}: the {name} database counts more "
                                    f"pages than the file holds")
            metas.append(LMDBMeta(page, tuple(problems), psize, map_size, main[6], main[7],
                                  main[2], last_pg, txnid))
        a, b = metas[0].txnid, metas[1].txnid
        if a and b and abs(a - b) != 1:
            older = metas[0] if a < b else metas[1]
            metas[older.page] = dataclasses.replace(older, problems=older.problems + (
                f"the meta pages hold transactions {a} and {b}, not two consecutive ones",))
        return metas
    finally:
        os.close(fd)


def lmdb_map_size_ok(map_size: int, options: dict[str, Any]) -> bool:
    """Whether an LMDB map size is one the lmdb backend sets with these tier options.

    It opens the map at map_size_bytes and doubles it up to max_map_size_bytes.
    """
    first = int(options.get("map_size_bytes", 1 << 30))
    top = int(options.get("max_map_size_bytes", 1 << 40))
    if first <= 0:  # the backend refuses such a size; doubling it would never reach `top`
        return False
    size = first
    while size < top:
        if map_size == size:
            return True
        size *= 2
    return map_size == top


def pmem_state(file: Path) -> int | None:
    """The current state generation of a pmem table file, None if no state block is valid."""
    fmt = importlib.import_module("embstore.backends._pmem_format")  # the format's owner
    STATE, STATE_OFFSETS = fmt.STATE, fmt.STATE_OFFSETS  # noqa: N806

    # O_NONBLOCK: a named pipe in the file's place would block the open for a writer
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        head = read_at(fd, 0, 4096)
    finally:
        os.close(fd)
    best = None
    for off in STATE_OFFSETS:
        if len(head) < off + STATE.size:
            continue
        gen, _, _, crc = STATE.unpack_from(head, off)
        if gen and crc32c(head[off:off + 24]) == crc and (best is None or gen > best):
            best = gen
    return best


def fingerprint(directory: Path, backend: str, tables: list[str]) -> Any:
    """What a writer changes in tier `directory` of `backend` (None: nothing to go by).

    Never raises: a missing or unreadable file gives a value that matches nothing.
    """
    try:
        if backend == "lmdb":
            file = directory / "data.mdb"
            metas = lmdb_metas(file, os.stat(file, follow_symlinks=False).st_size)
            return max(m.txnid for m in metas)
        if backend == "pmem":
            return {t: pmem_state(directory / f"{t}.pmem") for t in sorted(tables)
                    if (directory / f"{t}.pmem").exists()}
        if backend == "rocksdb":
            # names, not sizes: every writer session starts a new log and MANIFEST, while a
            # file cut short or damaged since must still be compared with the record
            return sorted(e.name for e in os.scandir(directory)
                          if not e.name.startswith(("LOG", "LOCK")))
    except OSError:
        return "unreadable"
    return None
