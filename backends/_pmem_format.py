"""The pmem backend's file format: byte offsets, sequence words, and the slot index.

File layout (little-endian). Header, one page:

    offset  size  field
    0       8     magic b"EMBSPMEM"
    8       4     format version (1)
    12      4     dim (elements per row)
    16      8     dtype string, NUL-padded (numpy `dtype.str`, e.g. b"<f4")
    24      4     record size in bytes (24 + row bytes, rounded up to 8)
    28      4     payload offset within a record (24)
    32      28    reserved (zero)
    60      4     CRC-32C of bytes 0..60
    512     32    state block A: gen u64, watermark u64, seq reserve u64, CRC-32C u32 of the
                  first 24 bytes, 4 bytes zero
    1024    32    state block B (same); the valid block with the higher gen is current
    4096    ...   records, slot i at 4096 + i * record size; the slot count is
                  (file size - 4096) // record size

Record (one slot):

    offset  size  field
    0       8     id, int64
    8       4     CRC-32C of the id's 8 bytes followed by record bytes 12..24+row bytes
                  (`embstore.checksum.row_checksums(id, record[12:24 + row_bytes])`)
    12      4     kind (1 = row)
    16      8     seq word, uint64: counter << 8 | CRC-8 (poly 0x07) of the counter's 7 low
                  bytes; 0 marks a free slot (`seq_words` encodes, `seq_counters` decodes)
    24      r     payload: dim elements of dtype (r = row bytes)
    24+r    pad   zero up to the record size

The watermark is the highest seq counter made durable by a flush, and every counter handed out
is at most the durable reserve. A record with a nonzero seq word whose CRC fails is a write cut
short by a crash when its seq word is intact (its CRC-8 holds; the word is stored with one
8-byte store) and its counter lies in (watermark, reserve]: it is ignored. Otherwise the record
was damaged at rest and opening raises `CorruptStoreError`. So any single-byte change of a
stored record is reported: of id, kind, CRC or payload by the record CRC (also on every read),
of the seq word by the record CRC plus its own CRC-8.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from embstore._kernels import _pmem_records
from embstore.checksum import crc32c
from embstore.index import HashTable

ffi, lib = _pmem_records.ffi, _pmem_records.lib

MAGIC = b"EMBSPMEM"
VERSION = 1
PAGE_SIZE = mmap.PAGESIZE
DATA_OFFSET = 4096
HEADER = struct.Struct("<8sII8sII28xI")
HEADER_CRC_OFFSET = 60
assert HEADER.size == 64
STATE = struct.Struct("<QQQI4x")
STATE_OFFSETS = (512, 1024)
assert STATE.size == 32

REC_ID = 0
REC_CRC = 8
REC_KIND = 12
REC_SEQ = 16
REC_PAYLOAD = 24
KIND_ROW = 1
CACHE_LINE = 64

def seq_words(counters: np.ndarray) -> np.ndarray:
    """uint64 seq words for counters (uint64, each in [1, 2**56)): counter << 8 | CRC-8.

    The CRC-8 (poly 0x07) of the counter's 7 low bytes detects every burst of up to 8 bits,
    so any one changed byte of the word, which is what tells a damaged record from a
    cut-short write. Computed by the same C code that writes records.
    """
    counters = np.ascontiguousarray(counters, dtype=np.uint64)
    out = np.empty(len(counters), dtype=np.uint64)
    lib.rec_seq_words(_ptr("uint64_t *", counters), len(counters), _ptr("uint64_t *", out))
    return out


def seq_counters(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counters, intact) of uint64 seq words; intact is False where the CRC-8 fails."""
    words = np.asarray(words, dtype=np.uint64)
    counters = words >> np.uint64(8)
    return counters, seq_words(counters) == words


SEGMENT_SLOTS = 1024  # allocation unit: see PmemBackend._alloc
SCAN_SLOTS = 1 << 20  # slots per chunk of the open-time scan
MAX_SLOTS = 2**31 - 1

# per-slot states, in memory only
_FREE, _LIVE, _DIRTY, _RETIRE = 0, 1, 2, 3


READER_SCANS = 8
"""Scans a reader beside a writer tries before giving up on a writer that flushes during each."""
READER_SCAN_SLOTS = 1 << 16  # slots per chunk of a reader's scan (which copies each chunk)
GATHER_GROUP = 4  # records rec_gather checks at once (GROUP in pmem_records.c): its scratch


def current_state(head: bytes) -> tuple[int, int, int] | None:
    """(gen, watermark, reserve) of the valid state block with the higher gen; None if neither."""
    best = None
    for off in STATE_OFFSETS:
        gen, wm, reserve, scrc = STATE.unpack_from(head, off)
        if gen and crc32c(head[off : off + 24]) == scrc and (best is None or gen > best[0]):
            best = (gen, wm, reserve)
    return best


def record_size(row_bytes: int) -> int:
    """Bytes of one slot record holding `row_bytes` of payload."""
    return (REC_PAYLOAD + row_bytes + 7) // 8 * 8


def _merge_ranges(starts: np.ndarray, ends: np.ndarray, grain: int) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    """Byte ranges [start, end) widened to `grain` and merged where they touch or overlap."""
    lo = starts // grain
    hi = (ends + grain - 1) // grain
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    first = np.ones(len(lo), dtype=bool)
    first[1:] = lo[1:] > reach[:-1]
    last = np.ones(len(lo), dtype=bool)
    last[:-1] = first[1:]
    return lo[first] * grain, reach[last] * grain


def _ptr(ctype: str, arr: np.ndarray) -> Any:
    return ffi.cast(ctype, arr.ctypes.data)


class _SlotIndex(HashTable):
    """Map int64 ids to int32 record slots chosen by the caller.

    IdIndex hands out its own dense slots, where an out-of-place update must point an id at
    a new record slot; this uses the same table and probing code and sets the values itself.
    """

    def upsert(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Point distinct `ids` at `slots` (int32); returns their previous slots (-1: new)."""
        self._reserve(len(ids))
        old = np.empty(len(ids), dtype=np.int32)
        self._count += lib.rec_index_upsert(*self.pointers(), _ptr("int64_t *", ids),
                                            _ptr("int32_t *", slots), len(ids),
                                            _ptr("int32_t *", old))
        return old

    def ids(self) -> np.ndarray:
        """Every id in the table."""
        return self.items()[0]
