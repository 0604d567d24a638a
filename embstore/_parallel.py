"""Row ranges of one batch run on several cores: the memory-bound kernels of the DRAM tier.

A probe of the DRAM index, a gather of rows and a fused optimizer step over distinct slots
each touch every row of a batch once and independently of the others, and their cost is the
wait for memory. Split over threads (the cffi kernels release the GIL), a 2-core host runs
them nearly twice as fast, as FBGEMM's CPU kernels run over OpenMP. The split never changes
a result: each row is computed by the same code from the same inputs, whichever thread runs
it, so tables stay bit-identical for every thread count.

The thread count is `EMBSTORE_NUM_THREADS` when set, else the cores this process may run on,
at most 8; `set_num_threads` changes it (1: every kernel on the calling thread). Batches
below `MIN_ROWS_PER_THREAD` rows per thread stay on the calling thread, where a hand-off
would cost more than it saves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

from .errors import ConfigError

__all__ = ["MIN_ROWS_PER_THREAD", "available_cores", "get_num_threads", "run_ranges",
           "set_num_threads"]

MIN_ROWS_PER_THREAD = 8192
_MAX_DEFAULT = 8

T = TypeVar("T")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _default_threads() -> int:
    raw = os.environ.get("EMBSTORE_NUM_THREADS")
    if raw is not None:
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ConfigError(f"EMBSTORE_NUM_THREADS={raw!r}: expected a whole number >= 1")
        return int(raw)
    return max(1, min(available_cores(), _MAX_DEFAULT))


_lock = threading.Lock()
_threads: int | None = None
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0


def get_num_threads() -> int:
    """Threads a large batch's DRAM kernels run on (see the module doc)."""
    global _threads
    if _threads is None:
        _threads = _default_threads()
    return _threads


def set_num_threads(n: int) -> None:
    """Run large batches' DRAM kernels on `n` threads (1: on the calling thread only).

    Raises:
        ConfigError: `n` is not a whole number >= 1.
    """
    global _threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"the thread count must be a whole number >= 1, got {n!r}")
    _threads = n


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_workers
    with _lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)  # a caller may still wait on its ranges there
            _pool = ThreadPoolExecutor(max_workers=workers,
                                       thread_name_prefix="embstore-kernel")
            _pool_workers = workers
        return _pool


def run_ranges(n: int, work: Callable[[int, int], T], *,
               min_rows: int = MIN_ROWS_PER_THREAD) -> list[tuple[int, T]]:
    """`work(start, stop)` over consecutive ranges covering [0, n), in parallel when large.

    Returns (start, result) per range, in range order. `work` must touch only rows
    [start, stop) of its outputs. An exception of any range is raised after all have ended.
    """
    parts = min(get_num_threads(), n // max(min_rows, 1))
    if parts <= 1:
        return [(0, work(0, n))]
    bounds = [n * k // parts for k in range(parts + 1)]
    pool = _executor(parts - 1)
    futures = [pool.submit(work, bounds[k], bounds[k + 1]) for k in range(1, parts)]
    try:
        first = work(bounds[0], bounds[1])
    finally:
        wait(futures)  # no range may still write into the caller's arrays
    return [(0, first)] + [(bounds[k], futures[k - 1].result()) for k in range(1, parts)]
