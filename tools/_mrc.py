"""Reuse distances and miss-ratio curves of batched id traces: exact, SHARDS-sampled, simulated.

The model is the simulator's (`embstore.simulate`): a batch makes one lookup per distinct id,
and a lookup misses when the id is not resident at the start of its batch. For LRU the stack
distance of a lookup of x in batch b, last looked up in batch p < b, is the number of other
ids LRU keeps more recently than x at the end of batch b-1: every distinct id looked up in
batches p+1..b-1, plus the ids of batch p that come after x within it. The first part is
exact (one cumulative sum per batch over per-batch "last access" counters, O(batches^2 +
lookups) numpy work). The second is not: the order inside a batch depends on which of its ids
hit, so on the capacity, and batched LRU has no exact stack distances. The k ids of batch b
last looked up in batch p take ranks spread evenly over the m ids still last looked up there
(`_ranks_within`): exact where all m come back, as in a loop over a working set, and the
mean, (m - 1) / 2, for one alone. LRU at capacity C then hits the lookups whose distance is
below C, which gives the whole curve at once; `tests/test_profile.py` bounds its error
against the simulator's replay (`LRU_CURVE_ERROR_BOUND`).

SHARDS (Waldspurger et al., FAST 2015) keeps only the ids whose hash falls below a rate R,
computes distances on that sub-trace and scales them by 1/R; other policies have no stack
property and are replayed at a few capacities (miniature simulation: the sampled trace
through a cache of R x C ids). The error of a sampled curve shrinks with the number of
sampled ids, so a table is sampled only when at least `MIN_SAMPLED_IDS` of its ids would be
kept; `tests/test_profile.py` bounds the error against the exact curve (`SHARDS_ERROR_BOUND`).

`plot_profile` draws a profile's curves with matplotlib (the `plot` extra).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from embstore._access_log import sample_mask
from embstore._private_dir import temporary_beside
from embstore.errors import ConfigError
from embstore.policy import EvictionPolicy
from embstore.tools.simulator import Trace, parse_policy, run_policies

__all__ = ["LRU_CURVE_ERROR_BOUND", "MIN_SAMPLED_IDS", "SHARDS_ERROR_BOUND", "capacity_grid",
           "check_plot_path", "lru_curve", "plot_profile", "policy_curve", "sample_trace",
           "stack_distances"]

MIN_SAMPLED_IDS = 2000
"""A table is sampled only if about this many of its ids survive the sampling."""
LRU_CURVE_ERROR_BOUND = 0.02
"""Largest absolute miss-ratio error of the exact LRU curve against the simulator's replay in
the tests (calibrated tables, caches at least two batches wide; a loop over a working set: 0)."""
SHARDS_ERROR_BOUND = 0.03
"""Largest absolute miss-ratio error of a sampled curve against the exact one in the tests
(calibrated trace, at least `MIN_SAMPLED_IDS` sampled ids)."""


def sample_trace(trace: Trace, rate: float, seed: int = 0) -> Trace:
    """The sub-trace of the ids whose hash falls below `rate` (spatial sampling).

    With seed 0 it keeps what an access log recorded at `rate` keeps (embstore._access_log),
    and sampling at a rate below keeps a subset of that.
    """
    if rate >= 1:
        return trace
    keep = sample_mask(trace.ids, rate, seed)
    return Trace([b[keep[d]] for b, d in zip(trace.batches, trace.dense, strict=True)])


def stack_distances(trace: Trace, warmup: int = 0) -> tuple[np.ndarray, int, int]:
    """Compute the LRU stack distances of the trace's lookups.

    Returns the distances (float64, cold lookups left out), the number of cold lookups
    (first lookups of an id) and of all lookups, counting only the batches from `warmup` on
    (the earlier ones only fill the cache).
    """
    n_batches = len(trace.unique)
    last = np.full(trace.distinct, -1, dtype=np.int64)
    marker = np.zeros(n_batches + 1, dtype=np.int64)  # ids whose last lookup is batch j
    out: list[np.ndarray] = []
    cold = counted = 0
    for b, u in enumerate(trace.unique):
        if not len(u):
            continue
        p = last[u]
        seen = p >= 0
        p = p[seen]
        if b >= warmup:
            cold += int(len(u) - len(p))
            counted += len(u)
            if len(p):
                before = np.concatenate([[0], np.cumsum(marker[:b])])  # sum of marker[:j]
                out.append(before[b] - before[p + 1] + _ranks_within(p, marker))
        if len(p):
            np.subtract.at(marker, p, 1)
        marker[b] = len(u)
        last[u] = b
    dist = np.concatenate(out) if out else np.zeros(0)
    return dist, cold, counted


def _ranks_within(p: np.ndarray, marker: np.ndarray) -> np.ndarray:
    """Each lookup's count of ids kept after it within its last batch `p` (float64).

    The k lookups of this batch whose last batch is p share the m = marker[p] ids still last
    looked up there; their ranks are spread evenly over 0..m-1, (i + 1/2) m / k - 1/2 for the
    i-th. When all m come back (a loop over a working set) the ranks are 0..m-1, as LRU's
    order of them is; one alone gets (m - 1) / 2, the mean.
    """
    order = np.argsort(p, kind="stable")
    sorted_p = p[order]
    starts = np.flatnonzero(np.r_[True, sorted_p[1:] != sorted_p[:-1]])
    counts = np.diff(np.r_[starts, len(p)])
    within = np.arange(len(p)) - np.repeat(starts, counts)  # i within its group
    spread = (within + 0.5) * marker[sorted_p] / np.repeat(counts, counts) - 0.5
    ranks = np.empty(len(p), dtype=np.float64)
    ranks[order] = spread
    return ranks


def capacity_grid(rows: int, points: int = 24) -> np.ndarray:
    """Capacities (ids, int64, increasing, distinct) from 1 to `rows`, log-spaced."""
    grid = np.unique(np.round(np.geomspace(1, max(rows, 1), points)).astype(np.int64))
    return grid


def lru_curve(trace: Trace, capacities: np.ndarray, rate: float = 1.0,
              warmup: int = 0) -> np.ndarray:
    """LRU miss ratios (per lookup) at `capacities` (ids of the full trace).

    From stack distances of the trace sampled at `rate` (1: exact), batches from `warmup` on.
    """
    sub = sample_trace(trace, rate)
    dist, cold, counted = stack_distances(sub, warmup)
    if not counted:
        return np.zeros(len(capacities))
    dist = np.sort(dist / rate)
    beyond = len(dist) - np.searchsorted(dist, np.asarray(capacities, dtype=np.float64),
                                         side="left")
    return (cold + beyond) / counted


def reuse_histogram(trace: Trace, rate: float = 1.0, warmup: int = 0) -> dict[str, Any]:
    """Reuse distances in log2 bins.

    Returns {"edges": bin upper edges (ids), "lookups": share of lookups per bin, "cold":
    share of first lookups}.
    """
    sub = sample_trace(trace, rate)
    dist, cold, counted = stack_distances(sub, warmup)
    dist = dist / rate
    top = max(1, int(np.ceil(np.log2(max(float(dist.max()) if len(dist) else 1.0, 1.0)))) + 1)
    edges = 2.0 ** np.arange(top + 1)
    counts = np.histogram(dist, bins=np.concatenate([[0.0], edges]))[0]
    total = max(counted, 1)
    return {"edges": edges.tolist(), "lookups": (counts / total).tolist(),
            "cold": cold / total}


def policy_curve(trace: Trace, policy: str, capacities: Sequence[int], rate: float = 1.0,
                 seed: int = 0, warmup: int = 0, step_calls: int = 1) -> np.ndarray:
    """Miss ratios of eviction `policy` (spec, admission "always") at `capacities`.

    Replayed on the trace sampled at `rate` through caches of rate x capacity ids, counting the
    batches from `warmup` on (a replay of the warm-up prefix alone is subtracted: the
    policies are deterministic, so it is the same prefix). `step_calls` > 1 replays each
    batch as a store's training step (see `_training_misses`); 1 is `embstore simulate`.
    """
    sub = sample_trace(trace, rate)
    prefix = Trace(sub.batches[:warmup]) if warmup else None
    out = np.zeros(len(capacities))
    counted = sub.lookups - (prefix.lookups if prefix else 0)
    if not counted:
        return out
    for i, cap in enumerate(capacities):
        scaled = max(1, int(round(cap * rate)))
        if scaled >= sub.distinct:  # everything fits: only cold misses
            out[i] = (sub.distinct - (prefix.distinct if prefix else 0)) / counted
            continue
        misses = 0
        for part, sign in ((sub, 1), (prefix, -1)):
            if part is not None and part.lookups:
                eviction = parse_policy(policy, "eviction", seed)
                if step_calls == 1:
                    misses += sign * run_policies(
                        part, eviction, parse_policy("always", "admission", seed),  # type: ignore[arg-type]
                        scaled).misses
                else:
                    misses += sign * _training_misses(part, eviction, scaled,  # type: ignore[arg-type]
                                                      step_calls)
        out[i] = misses / counted
    return out


def _training_misses(trace: Trace, eviction: EvictionPolicy, capacity: int,
                     step_calls: int) -> int:
    """Misses of `eviction` when each batch is a training step of a store.

    The lookup, then `step_calls - 1` more calls on the same rows (the optimizer's read and
    write), each at its own time, as a tier sees them. Every call touches the resident rows,
    brings in the others (the update needs every row of the step: one evicted by this step's
    own inserts comes back) and evicts down to `capacity`; only the lookup's misses count.
    """
    resident = np.zeros(trace.distinct, dtype=bool)
    size = misses = 0
    for b, u in enumerate(trace.unique):
        if not len(u):
            continue
        for k in range(step_calls):
            now = b * step_calls + k
            hit = resident[u]
            if k == 0:
                misses += int(len(u) - np.count_nonzero(hit))
            eviction.record_access(trace.ids[u[hit]], now)
            new = u[~hit]
            eviction.record_insert(trace.ids[new], now)
            resident[new] = True
            size += len(new)
            if size > capacity:
                victims = eviction.choose_victims(size - capacity, now)
                resident[np.searchsorted(trace.ids, victims)] = False
                size -= len(victims)
    return misses


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'embstore[plot]'") from None
    return plt


def check_plot_path(path: str | Path, inputs: Sequence[str | Path] = ()) -> str:
    """The image format of `path` (its extension), refused before any work if unwritable.

    Raises:
        ConfigError: matplotlib is missing, the extension is not a format it writes, or the
            path is empty, a directory, in a missing folder, or one of `inputs` or inside
            one of them.
    """
    from ._args import check_output

    check_output(path, "--plot", inputs)
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    ext = Path(path).suffix[1:].lower()
    if ext not in formats:
        got = f"a .{ext} file" if ext else "a file without an extension"
        raise ConfigError(f"--plot {str(path)!r}: matplotlib cannot draw {got}; end the name "
                          f"in .png, .pdf or .svg (it writes {', '.join(formats)})")
    return ext


def plot_profile(profile: dict[str, Any], path: str | Path) -> None:
    """Draw each table's miss-ratio curves (one line per table, a panel per policy).

    The image goes to a temporary file renamed over `path`, so a failed drawing leaves
    neither a partial image nor a stray file.

    Raises:
        ConfigError: matplotlib is not installed, cannot write this format, or failed.
    """
    ext = check_plot_path(path)
    plt = _pyplot()
    policies = profile["policies"]
    fig, axes = plt.subplots(1, len(policies), figsize=(5 * len(policies), 4), squeeze=False,
                             sharey=True)
    for ax, policy in zip(axes[0], policies, strict=True):
        for name, t in profile["tables"].items():
            ax.plot(t["mrc"]["capacities"], t["mrc"][policy], marker=".", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("cache size (rows)")
        ax.set_title(f"{policy} miss ratio")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("misses per lookup")
    axes[0][-1].legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    path = Path(path)
    tmp = temporary_beside(path)
    try:
        fig.savefig(tmp, dpi=120, format=ext)  # the format named: the temporary name has none
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # no partial image, no stray file
            tmp.unlink()
        if not isinstance(exc, Exception):
            raise
        if isinstance(exc, OSError):  # of the path asked for, not of our temporary file
            raise ConfigError(f"--plot {str(path)!r}: cannot write it: "
                              f"{exc.strerror or exc}") from None
        # e.g. pgf without LaTeX: say so in our words, not matplotlib's
        raise ConfigError(f"--plot {str(path)!r}: matplotlib could not write a .{ext} image "
                          f"({type(exc).__name__}); try .png, .pdf or .svg") from exc
    finally:
        plt.close(fig)
