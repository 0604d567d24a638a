"""Embedding-access traces: production reuse statistics, their histograms, a calibrated generator.

Meta's dlrm_datasets publish, for each batch of their production-like embedding traces, two
histograms over log2 bins of per-batch reuse (`load_locality_stats`): the share of the rows a
batch touches whose access count falls in each bin, and the share of the accesses that go to
rows in each bin. `reuse_histograms` computes the same two from a batch of ids.

`synthesize` draws batches from 16 tables of sizes spread from a few rows to ~10**5 (the small
ones are the heavy hitters), each Zipf-Mandelbrot, plus a few uniform heavy-hitter rows, with
parameters (`PROFILES`) fitted by `calibrate` so that a batch's two histograms match the mean
production ones of 2021 or 2022 (total variation < 0.1 each). The histograms depend on the
lookups per batch (a row's count grows with it), so a profile is calibrated at its `lookups`
(2**20); at other sizes the same popularity is seen through a different window.

Caveats: the statistics describe reuse within a batch only, so how popularity moves between
batches (`drift`, default none) is not calibrated, and the default stream is stationary,
which favours frequency-based policies. The published batches are ~500x larger than ours, so
the top bins are matched by fewer, hotter rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from embstore.errors import ConfigError

__all__ = [
    "BIN_LABELS",
    "MAX_LOOKUPS",
    "MAX_TRACE_LOOKUPS",
    "PROFILES",
    "LocalityStats",
    "SynthParams",
    "SynthStream",
    "calibrate",
    "is_whole_number",
    "load_locality_stats",
    "mean_histograms",
    "reuse_histograms",
    "synthesize",
    "total_variation",
]

N_BINS = 17
BIN_LABELS = ["(0, 1]"] + [f"({1 << (j - 1)}, {1 << j}]" for j in range(1, 16)] + ["(32768+"]
_TABLE_SHIFT = 40  # id = table << 40 | row key: tables never share ids


@dataclass(frozen=True)
class LocalityStats:
    """One block of a dlrm_datasets `locality_stats.txt`: the reuse of one batch."""

    name: str
    """Trace file the block describes, e.g. ``fbgemm_t856_bs65536_0.pt``."""
    tables: int
    """Embedding tables in the trace."""
    batch_size: int
    """Samples per batch."""
    indices: int
    """Lookups in the batch, all tables together."""
    unique: int
    """Distinct (table, row) pairs touched by the batch."""
    rows_hist: np.ndarray
    """float64[17]: share of touched rows whose access count is in each log2 bin."""
    access_hist: np.ndarray
    """float64[17]: share of lookups going to rows whose count is in each bin."""


_NUMBER = r"\d+(?:\.\d+)?"
"""A value of a locality-stats file: digits, perhaps a point and more digits."""


def load_locality_stats(path: str | Path) -> list[LocalityStats]:
    """Parse a dlrm_datasets ``locality_stats.txt`` into one `LocalityStats` per block.

    Blocks are separated by blank lines. The per-bin values are printed with three decimals,
    so each histogram is renormalised to sum to 1.

    Raises:
        ConfigError: the file is missing or a block lacks a field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read locality stats {str(path)!r}: {exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"{str(path)!r} is not a locality-stats text file (it is not "
                          "UTF-8 text)") from None
    if not text.strip():
        raise ConfigError(f"{str(path)!r} holds no locality-stats block")
    out = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.strip().splitlines()
        name = lines[0].strip()
        m = re.search(r"_t(\d+)_bs(\d+)", name)
        fields = {k: re.search(rf"{k}:\s*({_NUMBER})(?![\d.])", block) for k in
                  ("Avg # of indices", "Avg # of unique cols")}
        bins = re.findall(rf"^\((?:\d+, \d+\]|32768\+):\s*({_NUMBER})\s*$", block,
                          flags=re.M)
        if m is None or None in fields.values() or len(bins) != 2 * N_BINS:
            raise ConfigError(f"{str(path)!r}: block {name!r} is not a locality-stats block "
                              f"(expected a name, averages and two {N_BINS}-bin histograms)")
        values = np.array(bins, dtype=np.float64).reshape(2, N_BINS)
        sums = values.sum(axis=1, keepdims=True)
        if not (sums > 0).all():
            raise ConfigError(f"{str(path)!r}: block {name!r} has a histogram of zeros")
        values /= sums
        out.append(LocalityStats(
            name=name, tables=int(m.group(1)), batch_size=int(m.group(2)),
            indices=int(float(fields["Avg # of indices"].group(1))),  # type: ignore[union-attr]
            unique=int(float(fields["Avg # of unique cols"].group(1))),  # type: ignore[union-attr]
            rows_hist=values[0], access_hist=values[1]))
    return out


def mean_histograms(stats: list[LocalityStats]) -> tuple[np.ndarray, np.ndarray]:
    """Mean rows and access histograms of the numbered batches (``..._<k>.pt``).

    The unnumbered 2021 block covers a different, larger trace, so it is left out when
    numbered ones exist.
    """
    numbered = [s for s in stats if re.search(r"_\d+\.pt$", s.name)] or stats
    return (np.mean([s.rows_hist for s in numbered], axis=0),
            np.mean([s.access_hist for s in numbered], axis=0))


def reuse_histograms(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two locality histograms of one batch of ids (float64[17] each).

    Bin j >= 1 holds counts in (2**(j-1), 2**j], bin 0 count 1, bin 16 counts above 32768.
    """
    _, counts = np.unique(np.asarray(ids).reshape(-1), return_counts=True)
    if not len(counts):
        return np.zeros(N_BINS), np.zeros(N_BINS)
    # frexp's exponent of c - 1 is its bit length: 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3
    bins = np.minimum(np.frexp((counts - 1).astype(np.float64))[1], N_BINS - 1)
    rows = np.bincount(bins, minlength=N_BINS) / len(counts)
    access = np.bincount(bins, weights=counts, minlength=N_BINS) / counts.sum()
    return rows.astype(np.float64), access


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    """Total variation distance between two histograms: half the L1 distance."""
    return 0.5 * float(np.abs(np.asarray(p) - np.asarray(q)).sum())


@dataclass(frozen=True)
class SynthParams:
    """Shape of the synthetic tables; `calibrate` fits all but the last two.

    Production models mix tables of every size: a table of a few rows read by most samples
    gives a handful of heavy hitters with huge per-batch counts, a table of millions of rows a
    long tail read once or twice. So table t of `tables` has a row count spread log-evenly from
    `rows_min` to `rows_max`, draws a share of the batch's lookups proportional to
    rows**`share_exp`, and picks its rows by Zipf-Mandelbrot, weight (rank + `head` x rows)
    ** -alpha, with alpha spread evenly from `alpha_large` (largest table) to `alpha_small`
    (smallest). A positive `head` flattens the top ranks, as for features whose popular
    values are all about equally common. On top, `hot` heavy-hitter rows (one more table,
    read uniformly, like a default id most samples carry) take `hot_share` of the lookups.
    """

    rows_min: float
    """Rows of the smallest table (rounded, at least 1)."""
    rows_max: float
    """Rows of the largest table."""
    alpha_large: float
    """Zipf exponent of the largest table."""
    alpha_small: float
    """Zipf exponent of the smallest table."""
    share_exp: float
    """Lookup share of a table grows as rows**share_exp."""
    head: float = 0.0
    """Flat head of each table's popularity, as a share of its rows (0: plain Zipf)."""
    hot_share: float = 0.0
    """Share of all lookups that go to the heavy hitters."""
    hot: int = 0
    """Heavy-hitter rows (0: none)."""
    tables: int = 16
    """Tables in a batch."""
    lookups: int = 1 << 20
    """Lookups per batch, all tables together (the scale the profile is calibrated at)."""

    def table_rows(self) -> np.ndarray:
        """Rows of each table, largest first, then the heavy-hitter table if `hot`."""
        rows = np.geomspace(self.rows_max, max(self.rows_min, 1.0), self.tables)
        rows = np.maximum(np.round(rows), 1).astype(np.int64)
        return np.append(rows, self.hot) if self.hot else rows

    def table_lookups(self) -> np.ndarray:
        """Lookups of each table per batch (order of `table_rows`), summing to `lookups`."""
        share = np.geomspace(self.rows_max, max(self.rows_min, 1.0), self.tables)
        share = share ** self.share_exp
        share *= (1.0 - self.hot_share if self.hot else 1.0) / share.sum()
        if self.hot:
            share = np.append(share, self.hot_share)
        exact = share * self.lookups
        out = np.floor(exact).astype(np.int64)
        out[np.argsort(out - exact)[: self.lookups - out.sum()]] += 1
        return out


# Fitted to the mean histograms of the numbered batches of each year: a random search over
# the parameter ranges (150 draws at 2**19 lookups) picked a start, then `calibrate(rows,
# access, seed=0, start=...)` refined it; both profiles are fixed points of `calibrate`. Loss
# (max of the two TV distances, seed 0): 2021 0.085, 2022 0.072. tests/test_traces.py checks a
# fresh seed against the shipped stats files. For cache simulations cut the same stream into
# smaller batches (`lookups=4096`): popularity does not depend on the batch size, and a batch
# wider than the cache would leave eviction nothing to decide.
PROFILES: dict[str, SynthParams] = {
    "2021": SynthParams(rows_min=2.95, rows_max=120_000, alpha_large=0.611, alpha_small=1.065,
                        share_exp=0.107, head=0.005625, hot_share=0.032, hot=1),
    "2022": SynthParams(rows_min=1.38, rows_max=66_250, alpha_large=1.516, alpha_small=1.124,
                        share_exp=0.187, head=0.0587, hot_share=0.075, hot=2),
}


def _table_cdfs(params: SynthParams) -> list[np.ndarray]:
    cdfs = []
    alphas = np.linspace(params.alpha_large, params.alpha_small, params.tables)
    if params.hot:
        alphas = np.append(alphas, 0.0)  # heavy hitters are read uniformly
    for rows, alpha in zip(params.table_rows(), alphas, strict=True):
        ranks = np.arange(1, rows + 1, dtype=np.float64)
        cdf = np.cumsum((ranks + params.head * rows) ** -alpha)
        cdfs.append(cdf / cdf[-1])
    return cdfs


MAX_LOOKUPS = 1 << 28
"""The most lookups a synthetic batch may have (256 times the calibrated scale): a batch is
drawn in memory, and a count past int64 overflowed the generator's arithmetic."""
MAX_TRACE_LOOKUPS = 1 << 30
"""The most lookups a synthetic trace may have, all batches together: the simulator and
`embstore trace synth` hold the whole trace in memory, 8 bytes a lookup (8 GiB here) and
several times that to replay it. The README's runs and the tests draw at most ~50M (50
batches at the calibrated 2**20); a count past this one only grows memory until the
process is killed."""

_KEY_MULT = 0x9E3779B97F4B  # odd: a bijection on row keys mod 2**40
_KEY_MASK = (1 << _TABLE_SHIFT) - 1
_KEY_MULT_INV = pow(_KEY_MULT, -1, 1 << _TABLE_SHIFT)


def _row_keys(ranks: np.ndarray, epochs: np.ndarray, rows: int) -> np.ndarray:
    # an odd multiplier is a bijection mod 2**40: popular rows get scattered, distinct keys
    raw = ranks.astype(np.uint64) + np.uint64(rows) * epochs[ranks].astype(np.uint64)
    return ((raw * np.uint64(_KEY_MULT)) & np.uint64(_KEY_MASK)).astype(np.int64)


class SynthStream:
    """The generator behind `synthesize`, which also knows every id's true popularity.

    `next_batch` draws a batch, then lets the hot set drift; `read_probability` then gives
    the chance that each id is read by the next batch (0 for an id whose rank drift has
    given a new id). That is what a cache that knew the true popularity would rank ids by:
    `embstore.tools.simulator.popularity_oracle`, about the best an online policy can hope
    for on these traces.

    Args: those of `synthesize`, less `batches`.

    Raises:
        ConfigError: unknown profile or bad value.
    """

    def __init__(self, seed: int = 0, profile: str = "2021", lookups: int | None = None,
                 drift: float = 0.0, params: SynthParams | None = None) -> None:
        if params is None:
            profile = str(profile)  # "synth:profile=2021" parses the year as a number
            if profile not in PROFILES:
                raise ConfigError(f"unknown trace profile {profile!r}; known: {sorted(PROFILES)}")
            params = PROFILES[profile]
        if lookups is not None:
            if not is_whole_number(lookups):  # int() would cut 2.5 to 2 and read True as 1
                raise ConfigError(f"synthetic trace: lookups must be a whole number, got "
                                  f"{lookups!r}")
            params = replace(params, lookups=int(lookups))
        if isinstance(drift, bool) or not isinstance(drift, (int, float)):
            raise ConfigError(f"synthetic trace: drift must be a number in [0, 1], got {drift!r}")
        if not 0 <= drift <= 1 or not params.tables <= params.lookups <= MAX_LOOKUPS:
            raise ConfigError(f"synthetic trace: need 0 <= drift <= 1 and tables <= lookups "
                              f"<= {MAX_LOOKUPS:,}, got drift={drift}, lookups={params.lookups}")
        self.params = params
        self.drift = float(drift)
        self._rng = np.random.default_rng(seed)
        self._cdfs = _table_cdfs(params)
        # chance of each rank per lookup: `next_batch` draws rank r where cdf[r-1] <= u < cdf[r]
        self._pmfs = [np.diff(cdf, prepend=0.0) for cdf in self._cdfs]
        self._per_table = params.table_lookups()
        self._rows = params.table_rows()
        self._epochs = [np.zeros(r, dtype=np.int64) for r in self._rows]

    def next_batch(self) -> np.ndarray:
        """The next batch: int64 ids, table in the bits above 40, row key below."""
        rng = self._rng
        parts = []
        for t, cdf in enumerate(self._cdfs):
            ranks = np.searchsorted(cdf, rng.random(self._per_table[t]), side="right")
            ranks = np.minimum(ranks, self._rows[t] - 1)
            parts.append((t << _TABLE_SHIFT) | _row_keys(ranks, self._epochs[t],
                                                         int(self._rows[t])))
        # samples interleave tables in a real batch; a consumer may cut batches into pieces
        batch = rng.permutation(np.concatenate(parts))
        if self.drift:
            for e in self._epochs:
                e[rng.random(len(e)) < self.drift] += 1
        return batch

    def read_probability(self, ids: np.ndarray) -> np.ndarray:
        """float64[N] chance that each of `ids` (int64[N]) is read by the next batch.

        0 for ids this stream never makes (another table, an epoch drift has retired) and for
        rows of a table the batch does not read.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        table = ids >> _TABLE_SHIFT
        raw = ((ids & _KEY_MASK).astype(np.uint64) * np.uint64(_KEY_MULT_INV)) & np.uint64(
            _KEY_MASK)
        out = np.zeros(len(ids))
        for t in np.unique(table[(table >= 0) & (table < len(self._rows))]):
            if not self._per_table[t]:
                continue  # no lookups (a profile at very few lookups): never read
            sel = np.flatnonzero(table == t)
            rows = int(self._rows[t])
            rank = (raw[sel] % np.uint64(rows)).astype(np.int64)
            epoch = (raw[sel] // np.uint64(rows)).astype(np.int64)
            p = self._pmfs[t][rank]
            with np.errstate(divide="ignore"):  # p == 1: a one-row table, read every batch
                read = -np.expm1(self._per_table[t] * np.log1p(-np.minimum(p, 1.0)))
            out[sel] = np.where(self._epochs[t][rank] == epoch, read, 0.0)
        return out


def synthesize(batches: int = 20, seed: int = 0, profile: str = "2021",
               lookups: int | None = None, drift: float = 0.0,
               params: SynthParams | None = None) -> Iterator[np.ndarray]:
    """Yield `batches` batches of int64 ids (table in the bits above 40, row key below).

    Args:
        batches: number of batches.
        seed: seeds the numpy Generator; the same arguments give the same trace.
        profile: key of `PROFILES` ("2021" or "2022").
        lookups: lookups per batch; None keeps the profile's (the calibrated scale).
        drift: share of each table's rows whose key is replaced after every batch (new
            features taking over a rank); 0 keeps popularity fixed. Not calibrated.
        params: explicit parameters instead of a profile.

    Raises:
        ConfigError: unknown profile or bad value.
    """
    if not is_whole_number(batches) or batches < 0:
        raise ConfigError(f"synthesize: batches must be a whole number >= 0, got {batches!r}")
    stream = SynthStream(seed=seed, profile=profile, lookups=lookups, drift=drift,
                         params=params)
    total = int(batches) * stream.params.lookups
    if total > MAX_TRACE_LOOKUPS:
        raise ConfigError(
            f"synthetic trace: {batches:,} batches of {stream.params.lookups:,} lookups is "
            f"{total:,} lookups, more than the {MAX_TRACE_LOOKUPS:,} (2**30) a trace may "
            "have: a trace is held in memory whole, 8 bytes a lookup (8 GiB at the limit) and "
            "several times that to replay it; ask for fewer batches or fewer lookups a batch")
    for _ in range(int(batches)):
        yield stream.next_batch()


def is_whole_number(value: object) -> bool:
    """Whether `value` is an int or numpy integer (a bool is neither here: True is no count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def calibrate(rows_target: np.ndarray, access_target: np.ndarray, seed: int = 0,
              start: SynthParams | None = None, rounds: int = 3) -> tuple[SynthParams, float]:
    """Fit the generator to target histograms by coordinate search.

    The loss is the larger of the two total-variation distances of one synthetic batch
    (fixed seed, so the search is deterministic). Each round tries, for each parameter in
    turn, a few multiplicative steps around the current value and keeps the best.

    Returns:
        The fitted parameters and their loss.
    """
    params = start or PROFILES["2021"]

    def loss(p: SynthParams) -> float:
        batch = next(synthesize(1, seed=seed, params=p))
        r, a = reuse_histograms(batch)
        return max(total_variation(r, rows_target), total_variation(a, access_target))

    best = loss(params)
    steps = {"rows_max": 0.5, "rows_min": 0.5, "alpha_large": 0.15, "alpha_small": 0.15,
             "share_exp": 0.3, "head": 0.5, "hot_share": 0.3}
    for _ in range(rounds):
        for key, step in steps.items():
            for factor in (1 - step, 1 + step, 1 - step / 2, 1 + step / 2):
                value = asdict(params)[key] * factor
                trial = replace(params, **{key: value})
                if not 0 <= trial.hot_share < 1:
                    continue
                score = loss(trial)
                if score < best:
                    params, best = trial, score
    return params, best
