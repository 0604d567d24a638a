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
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from .errors import ConfigError

__all__ = ["MIN_ROWS_PER_THREAD", "ThreadPool", "available_cores", "get_num_threads",
           "run_ranges", "run_split", "set_num_threads"]

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


_threads: int | None = None


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


class ThreadPool:
    """A process-wide pool of threads, made larger when a caller needs more workers.

    An outgrown pool is dropped, not shut down: a caller that holds it may still submit there,
    and its threads end once it is idle and no longer referenced. A forked child, which
    inherits the pool object but none of its threads (and perhaps a held lock), starts anew.
    """

    def __init__(self, thread_name_prefix: str) -> None:
        self._prefix = thread_name_prefix
        self._forget()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

    def executor(self, workers: int) -> ThreadPoolExecutor:
        """The pool, with at least `workers` threads (started as work needs them)."""
        with self._lock:
            if self._pool is None or self._workers < workers:
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix=self._prefix)
                self._workers = workers
            return self._pool


_KERNELS = ThreadPool("embstore-kernel")


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
    results = run_split(bounds, work, _KERNELS.executor(parts - 1))
    return list(zip(bounds, results, strict=False))  # bounds has one more: the end


def run_split(bounds: list[int], work: Callable[[int, int], T],
              pool: ThreadPoolExecutor) -> list[T]:
    """`work(bounds[k], bounds[k + 1])` for every k, results in that order.

    The first range runs on the calling thread, the others on `pool`'s threads; a range no
    thread could be started for runs on the calling thread. Every range has ended when this
    returns or raises, even through an interrupt (no range still writes into the caller's
    arrays or reads a table it may close); an exception of any range is raised then.
    """
    parts = len(bounds) - 1
    futures: list[Future[T]] = []
    try:
        try:
            for k in range(1, parts):
                futures.append(pool.submit(work, bounds[k], bounds[k + 1]))
        except RuntimeError:  # no thread could be started: the calling thread runs the rest
            pass
        mine = [work(bounds[0], bounds[1])]
        mine += [work(bounds[k], bounds[k + 1]) for k in range(len(futures) + 1, parts)]
    finally:
        _wait_all(futures)
    return [mine[0], *(f.result() for f in futures), *mine[1:]]


def _wait_all(futures: list[Future[T]]) -> None:
    """Wait until every future has ended, even through an interrupt (raised after)."""
    interrupt: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:  # Ctrl-C: the ranges still run; let them end first
            interrupt = interrupt or exc
    if interrupt is not None:
        raise interrupt
