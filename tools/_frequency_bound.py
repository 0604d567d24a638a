"""A cache that counts every id exactly: how far a frequency policy's estimate could take it.

LFU and W-TinyLFU rank ids by how often they were read, estimated in a sketch of small
counters that is halved now and then so that old reads count less. `exact_lfu` counts
instead: every id ever read (resident or not) has an exact count of the batches it was read
in, each read weighing half as much every `half_life` batches, and after each batch the cache
keeps the `capacity` ids, of those it held and those the batch read, with the highest counts
(the most recently read first among equal counts). It can only learn of an id by reading it,
as any cache that does not see the future.

`best_exact_lfu` replays several half-lives and keeps the best, chosen knowing the whole
trace. So it shows what a better frequency estimate or better aging could win for a
frequency policy: a policy close to it has little left there. It is a reference, not a bound
on every policy (a recency window can win on streams where the last read says more than the
count). Beside the popularity oracle, which knows a new id's chance before the id is read,
the gap between the two is the cost of learning popularity from reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from embstore.errors import ConfigError

from .simulator import SimResult, Trace

__all__ = ["HALF_LIVES", "add_exact_lfu", "best_exact_lfu", "exact_lfu"]

HALF_LIVES = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, math.inf)
"""Half-lives in batches that `best_exact_lfu` tries (inf: reads never age)."""

# counts are kept in units of the latest read's weight, which grows instead of every count
# decaying; past this they are rescaled before float64 could overflow
_RESCALE = 1e150


def exact_lfu(trace: Trace, capacity: int, half_life: float) -> SimResult:
    """Replay `trace` through a cache of `capacity` ids ranked by exact decayed counts.

    Args:
        trace: the trace.
        capacity: ids kept after each batch, >= 1.
        half_life: batches after which a read counts half as much, > 0 (inf: never ages).

    Raises:
        ConfigError: `capacity` or `half_life` is out of range.
    """
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1 id, got {capacity}")
    if not half_life > 0:  # also NaN
        raise ConfigError(f"half_life must be > 0 batches (inf: no aging), got {half_life}")
    start = time.perf_counter()
    growth = 2.0 ** (1.0 / half_life)
    counts = np.zeros(trace.distinct, dtype=np.float64)
    last_read = np.full(trace.distinct, -1, dtype=np.int64)
    resident = np.zeros(trace.distinct, dtype=bool)
    cache = np.zeros(0, dtype=np.int64)  # dense ids
    weight, misses = 1.0, 0
    for b, dense in enumerate(trace.unique):
        misses += len(dense) - int(np.count_nonzero(resident[dense]))
        counts[dense] += weight
        last_read[dense] = b
        weight *= growth
        if weight > _RESCALE:
            counts /= weight
            weight = 1.0
        cand = np.union1d(cache, dense)
        if len(cand) > capacity:
            # lexsort's last key is its first: highest count, then latest read
            cand = cand[np.lexsort((-last_read[cand], -counts[cand]))[:capacity]]
        resident[cache] = False
        resident[cand] = True
        cache = cand
    return SimResult("exact-lfu", f"half-life {half_life:g}", capacity, trace.accesses,
                     trace.lookups, misses, time.perf_counter() - start)


def best_exact_lfu(trace: Trace, capacity: int,
                   half_lives: Sequence[float] = HALF_LIVES) -> tuple[SimResult, float]:
    """The `exact_lfu` replay with the fewest misses over `half_lives`, and its half-life.

    The first of equally good half-lives wins. The result's seconds are those of all the
    replays together.

    Raises:
        ConfigError: no half-life is given, or one is out of range (see `exact_lfu`).
    """
    if not half_lives:
        raise ConfigError("best_exact_lfu needs at least one half-life")
    results = [(exact_lfu(trace, capacity, h), h) for h in half_lives]
    best, half_life = min(results, key=lambda r: r[0].misses)
    seconds = sum(r.seconds for r, _ in results)
    return SimResult(best.eviction, best.admission, best.capacity, best.accesses,
                     best.lookups, best.misses, seconds), half_life


def add_exact_lfu(report: dict[str, Any], trace: Trace) -> None:
    """Give each capacity of a `simulate_trace` report of `trace` its "exact_lfu" entry.

    A result dict with "miss_vs_belady" and "half_life" (batches; None where reads never
    age: JSON has no infinity).
    """
    for entry in report["capacities"]:
        counted, half_life = best_exact_lfu(trace, entry["capacity"])
        belady = entry["belady"]["misses"]
        row = counted.as_dict()
        row["miss_vs_belady"] = (counted.misses / belady if belady
                                 else float("inf") if counted.misses else 1.0)
        row["half_life"] = half_life if math.isfinite(half_life) else None
        entry["exact_lfu"] = row
