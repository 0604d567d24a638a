"""LMDB's structure, walked by hand: every page of every B-tree from the current meta page.

LMDB keeps no checksums, and its own code trusts page numbers and node offsets, so fsck walks
the file in plain Python with every bound checked (`pread` of one page at a time, nothing
mapped): page headers (page number, flags, lower/upper bounds), node offsets and sizes,
children within the file and visited once, leaves all at the recorded depth, and per
database the branch, leaf and overflow page counts, entry count and depth that the meta page
(or, for a named database, its record in the main database) says. Finally every page up to
the last one used must be in a tree or on the free list.

Page layout (64-bit build): page number u64, pad u16, flags u16 (1 branch, 2 leaf, 4 overflow,
8 meta), lower u16, upper u16 (an overflow page: its page count u32 at 12), then u16 node
offsets. Node: lo u16, hi u16, flags u16, key size u16, key, data. A branch node's child page
is lo | hi << 16 | flags << 32; a leaf node's data size is lo | hi << 16, its flags 1 (data on
overflow pages: the page number), 2 (a named database: its 48-byte record).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ._fileinfo import LMDBMeta, lmdb_metas, open_regular, read_at

__all__ = ["newest_meta", "walk"]

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_LEAF2 = 1, 2, 4, 8, 0x10, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 1, 2, 4
P_INVALID = 0xFFFFFFFFFFFFFFFF
_HEAD = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")
_DB = struct.Struct("<IHHQQQQQ")
_MAX_PROBLEMS = 50


class _Walker:
    def __init__(self, fd: int, psize: int, last_pg: int) -> None:
        self.fd, self.psize, self.last = fd, psize, last_pg
        # a byte per page, not a set: a 100 GiB file has 25M pages (a set of them ~1.5 GiB)
        self.seen = bytearray(last_pg + 1)
        self.problems: list[tuple[int, str]] = []

    def bad(self, pgno: int, message: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append((pgno * self.psize, message))

    def claim(self, pgno: int, what: str) -> bool:
        if not 2 <= pgno <= self.last:
            self.bad(0, f"{what} points at page {pgno}, outside pages 2..{self.last}")
            return False
        if self.seen[pgno]:
            self.bad(pgno, f"page {pgno} is used twice ({what})")
            return False
        self.seen[pgno] = 1
        return True

    def page(self, pgno: int) -> bytes:
        return read_at(self.fd, pgno * self.psize, self.psize)

    def tree(self, name: str, record: tuple[int, ...]) -> list[bytes]:
        """Walk one database; returns the data of its leaf nodes that name sub-databases."""
        _, _, depth, branch_n, leaf_n, over_n, entries_n, root = record
        counts = {"branch": 0, "leaf": 0, "overflow": 0, "entries": 0}
        subs: list[bytes] = []
        if root == P_INVALID:
            if entries_n or depth:
                self.bad(0, f"database {name}: no root page but {entries_n} entries recorded")
            return subs
        stack = [(root, 1)]
        while stack:
            pgno, level = stack.pop()
            if not self.claim(pgno, f"database {name}"):
                continue
            raw = self.page(pgno)
            if len(raw) < self.psize:
                self.bad(pgno, f"page {pgno} of database {name} lies past the file's end")
                continue
            own, _, flags, lower, upper = _HEAD.unpack_from(raw)
            kind = flags & ~P_DIRTY
            if own != pgno or kind not in (P_BRANCH, P_LEAF):
                self.bad(pgno, f"page {pgno} of database {name}: header says page {own}, "
                         f"flags {flags:#x}")
                continue
            if not (16 <= lower <= upper <= self.psize) or lower % 2:
                self.bad(pgno, f"page {pgno}: bounds {lower}/{upper} are impossible")
                continue
            n = (lower - 16) // 2
            if n == 0:
                self.bad(pgno, f"page {pgno} of database {name} is empty")
                continue
            counts["branch" if kind == P_BRANCH else "leaf"] += 1
            if kind == P_LEAF and level != depth:
                self.bad(pgno, f"leaf page {pgno} of database {name} at depth {level}, the "
                         f"database records depth {depth}")
            ptrs = struct.unpack_from(f"<{n}H", raw, 16)
            for i, ptr in enumerate(ptrs):
                if not upper <= ptr <= self.psize - 8 or ptr % 2:
                    self.bad(pgno, f"page {pgno}: node {i} at offset {ptr} lies outside "
                             f"{upper}..{self.psize}")
                    break
                lo, hi, nflags, ksize = _NODE.unpack_from(raw, ptr)
                end = ptr + 8 + ksize
                if kind == P_BRANCH:
                    if end > self.psize:
                        self.bad(pgno, f"page {pgno}: branch node {i} overruns the page")
                        break
                    stack.append((lo | hi << 16 | nflags << 32, level + 1))
                    continue
                size = lo | hi << 16
                counts["entries"] += 1
                stored = 8 if nflags & F_BIGDATA else size
                if nflags & ~(F_BIGDATA | F_SUBDATA | F_DUPDATA) or end + stored > self.psize:
                    self.bad(pgno, f"page {pgno}: leaf node {i} (flags {nflags:#x}, key "
                             f"{ksize} bytes, data {size} bytes) overruns the page")
                    break
                if nflags & F_BIGDATA:
                    counts["overflow"] += self.overflow(struct.unpack_from("<Q", raw, end)[0],
                                                        size, name)
                elif nflags & F_SUBDATA:
                    subs.append(raw[ptr + 8:end] + b"\0" + raw[end:end + size])
        found = (counts["branch"], counts["leaf"], counts["overflow"], counts["entries"])
        if found != (branch_n, leaf_n, over_n, entries_n):
            self.bad(0, f"database {name}: the walk finds {found[0]} branch, {found[1]} leaf, "
                     f"{found[2]} overflow pages and {found[3]} entries; its record says "
                     f"{branch_n}, {leaf_n}, {over_n} and {entries_n}")
        return subs

    def overflow(self, pgno: int, size: int, name: str) -> int:
        need = -(-(size + 16) // self.psize)
        if not self.claim(pgno, f"an overflow value of database {name}"):
            return 0
        raw = self.page(pgno)
        own, _, flags = struct.unpack_from("<QHH", raw)
        pages: int = struct.unpack_from("<I", raw, 12)[0]
        if own != pgno or flags & ~P_DIRTY != P_OVERFLOW or pages != need:
            self.bad(pgno, f"overflow page {pgno}: header says page {own}, flags {flags:#x}, "
                     f"{pages} pages for {size} bytes")
            return 0
        for extra in range(pgno + 1, pgno + pages):
            self.claim(extra, f"an overflow value of database {name}")
        return pages


def newest_meta(file: Path) -> LMDBMeta:
    """The meta page LMDB opens `file` with: the newest transaction's, faults and all.

    Raises:
        OSError: the file cannot be opened.
    """
    return max(lmdb_metas(file, os.stat(file, follow_symlinks=False).st_size),
               key=lambda m: m.txnid)


def walk(file: Path, meta: LMDBMeta, raw_meta: bytes | None = None) -> list[tuple[int, str]]:
    """(offset, problem) of the LMDB data file `file` walked from its current meta page.

    `raw_meta`: the meta page's first 152 bytes as read when a reader pinned its snapshot
    (beside a writer, which may have rewritten the page since); read from the file if None.
    """
    fd = open_regular(file)
    try:
        w = _Walker(fd, meta.page_size, meta.last_page)
        raw = raw_meta if raw_meta is not None else read_at(fd, meta.page * meta.page_size, 152)
        free = _DB.unpack_from(raw, 40)
        main = _DB.unpack_from(raw, 88)
        freed: list[int] = []
        for record in w.tree("free-list", free):
            del record  # the free list has no named databases
        # the free list's leaves hold page lists: count u64, then page numbers
        freed = _free_pages(w, free)
        for sub in w.tree("main", main):
            name, _, record = sub.partition(b"\0")
            if len(record) != _DB.size:
                w.bad(0, f"named database {name!r}: its record has {len(record)} bytes")
                continue
            w.tree(repr(name), _DB.unpack(record))
        for pgno in freed:
            if not 2 <= pgno <= w.last:
                w.bad(0, f"the free list holds page {pgno}, outside pages 2..{w.last}")
            elif w.seen[pgno]:
                w.bad(pgno, f"page {pgno} is both in use and on the free list")
            else:
                w.seen[pgno] = 1
        lost = np.flatnonzero(np.frombuffer(w.seen, dtype=np.uint8)[2:] == 0) + 2
        if len(lost) and not w.problems:
            w.bad(int(lost[0]), f"{len(lost)} page(s) are neither in a tree nor free, e.g. "
                  f"page {int(lost[0])}")
        return w.problems
    finally:
        os.close(fd)


def _free_pages(w: _Walker, record: tuple[int, ...]) -> list[int]:
    """Page numbers on the free list (its leaves' data: count u64, then page numbers)."""
    out: list[int] = []
    root = record[7]
    if root == P_INVALID:
        return out
    stack = [root]
    visited: set[int] = set()
    while stack:
        pgno = stack.pop()
        if pgno in visited or not 2 <= pgno <= w.last:
            continue
        visited.add(pgno)
        raw = w.page(pgno)
        if len(raw) < w.psize:
            continue
        _, _, flags, lower, upper = _HEAD.unpack_from(raw)
        if not (16 <= lower <= upper <= w.psize):
            continue
        for ptr in struct.unpack_from(f"<{(lower - 16) // 2}H", raw, 16):
            if not upper <= ptr <= w.psize - 8:
                break
            lo, hi, nflags, ksize = _NODE.unpack_from(raw, ptr)
            end = ptr + 8 + ksize
            if flags & P_BRANCH:
                stack.append(lo | hi << 16 | nflags << 32)
                continue
            size = lo | hi << 16
            if nflags & F_BIGDATA:
                opg = struct.unpack_from("<Q", raw, end)[0]
                data = read_at(w.fd, opg * w.psize + 16, size) if 2 <= opg <= w.last else b""
            else:
                data = raw[end:end + size]
            if len(data) >= 8:
                n = min(struct.unpack_from("<Q", data)[0], (len(data) - 8) // 8)
                out.extend(struct.unpack_from(f"<{n}Q", data, 8))
    return out
