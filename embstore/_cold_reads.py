"""Point reads of many rows split over threads while they wait on the device, not the CPU.

A multi-get of rows whose pages the OS has not cached reads them one page fault (or `pread`)
after another: on this project's 2-core VM, 250 rows of a cold 1M-row RocksDB table took
58-64 us a row on one thread and 22-23 us split over 16 (`embstore bench cold`), as the
device serves many reads at once while each thread waits on its own. A read the page cache
serves is CPU work instead, and more threads would only take turns on the cores. So a read
is split only while the table's reads go to the device: every read counts the blocks its
threads fetched from it (the kernel's per-thread `ru_inblock`, in 512-byte units), and the
next read of the table is split when the last one fetched at least `COLD_BLOCKS_PER_ROW` a
row (the first read of a table splits). A read split on a warm cache finds no blocks
fetched, so the one after runs on the calling thread again.

The split changes nothing read: each chunk is a contiguous run of the sorted keys, read by the
same call; the caller gets the values in key order. Where the OS keeps no per-thread block
counts (off Linux), reads are never split.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from ._parallel import ThreadPool, run_split

try:
    import resource

    _RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # not on POSIX
    _RUSAGE_THREAD = None

__all__ = ["COLD_BLOCKS_PER_ROW", "MAX_THREADS", "MIN_ROWS_PER_CHUNK", "ColdReads"]

COLD_BLOCKS_PER_ROW: Final = 0.5
"""512-byte blocks fetched from the device per row read that make the next read split: a page
cache miss fetches 8 or more, so this is about one row in 16 or more read from the device."""
MIN_ROWS_PER_CHUNK: Final = 16
"""Fewest rows one thread of a split read gets, so a hand-off to a thread stays a small share
of the chunk's work even when its rows turn out to be cached."""
MAX_THREADS: Final = 256
"""Most threads one read may be split over (the caller and 255 of the pool's)."""

_READERS = ThreadPool("embstore-cold-read")


def _executor() -> ThreadPoolExecutor:
    """The process's pool of reading threads, as many as a read may hand off (started lazily)."""
    return _READERS.executor(MAX_THREADS - 1)


def _blocks_fetched() -> int:
    """512-byte blocks the calling thread has read from block devices so far."""
    assert _RUSAGE_THREAD is not None
    return resource.getrusage(_RUSAGE_THREAD).ru_inblock


def _counted(get: Callable[[list[bytes]], list[Any]], keys: list[bytes]
             ) -> tuple[list[Any], int]:
    """`get(keys)` and the blocks this thread fetched from the device meanwhile."""
    before = _blocks_fetched()
    values = get(keys)
    return values, _blocks_fetched() - before


class ColdReads:
    """The reads of one table, split over up to `threads` threads while they are cold.

    Args:
        threads: most threads one read is split over (1: always the calling thread).
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.split_next = True
        """Whether the next read splits: the last one fetched enough from the device (a table
        just opened is taken as cold; its first read tells)."""

    def read(self, keys: list[bytes], get: Callable[[list[bytes]], list[Any]]) -> list[Any]:
        """`get(keys)`: the values of `keys` in their order, read in chunks if cold.

        `get` must release the GIL while it waits (rocksdict's multi-get does) and may be
        called from any thread. Any chunk's exception is raised once every chunk has ended,
        so no read outlives the call.
        """
        if _RUSAGE_THREAD is None or self.threads <= 1 or not keys:
            return get(keys)
        parts = min(self.threads, len(keys) // MIN_ROWS_PER_CHUNK) if self.split_next else 1
        if parts <= 1:
            values, fetched = _counted(get, keys)
        else:
            bounds = [len(keys) * k // parts for k in range(parts + 1)]
            chunks = run_split(bounds, lambda start, stop: _counted(get, keys[start:stop]),
                               _executor())
            values = list(itertools.chain.from_iterable(v for v, _ in chunks))
            fetched = sum(n for _, n in chunks)
        self.split_next = fetched >= COLD_BLOCKS_PER_ROW * len(keys)
        return values
