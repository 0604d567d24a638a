"""Replay an id trace through eviction x admission policies and compare with Belady's MIN.

The replay is a store's own code: `run_policies` builds a real two-tier chain (a bounded DRAM
tier run by the two policies, over an unbounded DRAM tier that holds every id of the trace)
with the store's chain builder and looks up each batch's distinct ids in it, ascending, as
`apply_gradients` does. So a simulated tier admits, promotes, inserts and evicts exactly as a
store's tier does (tests/test_simulate.py replays traces through a store and compares). A
lookup of an id not resident at the start of the batch is a miss (one fetch from below), so
`miss_ratio = misses / lookups`; `access_miss_ratio = misses / accesses` charges the same
fetches to every access, duplicates included.

Belady's MIN is computed for the same batched model: the cache after batch b may hold any
`capacity` ids among those it held and those batch b touched, and keeping the ones whose next
use comes soonest is optimal (the usual exchange argument, checked against brute force in the
tests). That makes it an upper bound for every policy pair above. Next uses come from one
stable sort of (id, batch) records, and each batch is one `argpartition`, so MIN costs
O(total distinct-per-batch + batches x capacity) numpy work. The infinite cache misses only
each id's first batch.

Example::

    batches = embstore.tools.traces.synthesize(batches=20, seed=1)
    report = simulate_trace(batches, ["lru", "s3fifo"], ["always", "frequency"], [0.05])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from embstore import registry
from embstore._build import build_chain
from embstore._unique import unique_sorted
from embstore.errors import ConfigError
from embstore.policy import AdmissionPolicy, EvictionPolicy
from embstore.spec import TableSpec, TierSpec

from ._trace_files import read_arrays

if TYPE_CHECKING:
    from .traces import SynthStream

__all__ = [
    "SimResult",
    "Trace",
    "belady",
    "check_batches",
    "infinite",
    "int64_ids",
    "load_trace",
    "parse_capacities",
    "parse_policy",
    "popularity_oracle",
    "read_arrays",
    "run_policies",
    "simulate_trace",
]

_NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class SimResult:
    """Outcome of one replay."""

    eviction: str
    """Eviction policy spec, or "belady" / "infinite" for the references."""
    admission: str
    """Admission policy spec ("-" for the references)."""
    capacity: int
    """Cache size in ids."""
    accesses: int
    """Ids in the trace, duplicates included."""
    lookups: int
    """Distinct ids per batch, summed over the batches: what the tier is asked for."""
    misses: int
    """Lookups of ids not resident at the start of their batch."""
    seconds: float
    """Wall time of the replay."""

    @property
    def miss_ratio(self) -> float:
        """Misses / lookups."""
        return self.misses / self.lookups if self.lookups else 0.0

    @property
    def hit_ratio(self) -> float:
        """1 - misses / lookups."""
        return 1.0 - self.miss_ratio

    @property
    def access_miss_ratio(self) -> float:
        """Misses / accesses: fetches per access, duplicates included."""
        return self.misses / self.accesses if self.accesses else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Fields plus the ratios, JSON-ready."""
        return {**asdict(self), "hit_ratio": self.hit_ratio, "miss_ratio": self.miss_ratio,
                "access_miss_ratio": self.access_miss_ratio}


class Trace:
    """A trace as batches of int64 ids, with each id's dense index precomputed.

    Args:
        batches: the batches, in order (each a 1-D integer array; empty ones are allowed).
        popularity: for a synthetic trace, makes a fresh `SynthStream` that draws the same
            batches and knows each id's true popularity (`popularity_oracle` replays it).

    Raises:
        ConfigError: a batch holds an id int64 cannot hold (an unsigned one past 2**63 - 1).
    """

    def __init__(self, batches: Sequence[np.ndarray],
                 popularity: Callable[[], SynthStream] | None = None) -> None:
        self.popularity = popularity
        self.batches = [np.ascontiguousarray(int64_ids(np.asarray(b), "a trace batch"))
                        .reshape(-1) for b in batches]
        flat = np.concatenate(self.batches) if self.batches else np.zeros(0, np.int64)
        # dense ids 0..distinct-1 let the simulator keep residency in one bool array
        self.ids, dense = np.unique(flat, return_inverse=True)
        bounds = np.cumsum([0] + [len(b) for b in self.batches])
        self.dense = [dense[bounds[i]:bounds[i + 1]] for i in range(len(self.batches))]
        self.unique = [unique_sorted(d) for d in self.dense]
        self.accesses = int(len(flat))
        self.lookups = int(sum(len(u) for u in self.unique))

    @property
    def distinct(self) -> int:
        """Distinct ids in the whole trace."""
        return int(len(self.ids))


def load_trace(spec: str, batch_size: int = 4096) -> Trace:
    """Read a trace from a file or a ``synth:`` spec.

    A .npy (2-D: one batch per row; 1-D: cut into `batch_size`), a .npz with `ids` and
    `offsets` (batch b is ids[offsets[b]:offsets[b+1]]), or ``synth:key=value,...`` for
    `embstore.tools.traces.synthesize(**kwargs)`.

    Raises:
        ConfigError: the file or spec cannot be read as a trace.
    """
    path = Path(spec)
    if not path.exists() and (spec == "synth" or spec.startswith("synth:")):
        from .traces import SynthStream, synthesize

        kwargs = _synth_kwargs(spec)
        stream = {k: v for k, v in kwargs.items() if k != "batches"}
        try:
            return Trace(list(synthesize(**kwargs)), popularity=lambda: SynthStream(**stream))
        except (TypeError, ValueError, OverflowError) as exc:  # a value of the wrong kind
            raise ConfigError(
                f"trace spec {spec!r}: {exc}; see embstore.tools.traces.synthesize") from exc
    if not path.exists():
        raise ConfigError(f"trace {spec!r} does not exist; give a .npy/.npz file or "
                          "synth:seed=1,batches=50")
    data = read_arrays(path)
    if isinstance(data, dict):
        if "ids" not in data or "offsets" not in data:
            raise ConfigError(f"trace {spec!r}: a .npz trace needs arrays 'ids' and 'offsets', "
                              f"found {sorted(data)}")
        ids, offsets = data["ids"], data["offsets"]
        check_batches(spec, ids, offsets)
        ids = int64_ids(ids, f"trace {spec!r}")
        return Trace([ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)])
    if not np.issubdtype(data.dtype, np.integer):
        raise ConfigError(f"trace {spec!r} holds {data.dtype} values, expected integer ids")
    data = int64_ids(data, f"trace {spec!r}")
    if data.ndim == 2:
        return Trace(list(data))
    if data.ndim == 1:
        return Trace([data[i:i + batch_size] for i in range(0, len(data), batch_size)])
    raise ConfigError(f"trace {spec!r} has {data.ndim} dimensions, expected 1 or 2")


def check_batches(spec: str, ids: np.ndarray, offsets: np.ndarray) -> None:
    """Raise unless `ids` are integers and `offsets` rise from 0 to len(ids) (1-D, integer).

    Raises:
        ConfigError: naming the trace `spec`.
    """
    if (not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1
            or not np.issubdtype(offsets.dtype, np.integer) or offsets.ndim != 1
            or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(ids)
            or (offsets[1:] < offsets[:-1]).any()):  # np.diff wraps round unsigned ones
        raise ConfigError(f"trace {spec!r}: needs 1-D integer ids and integer offsets rising "
                          "from 0 to len(ids) (batch b is ids[offsets[b]:offsets[b + 1]])")


def int64_ids(ids: np.ndarray, what: str) -> np.ndarray:
    """`ids` (an integer array) as int64, refusing values int64 cannot hold.

    A uint64 id past 2**63 - 1 would otherwise wrap around to a negative id.

    Raises:
        ConfigError: naming `what`.
    """
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise ConfigError(f"{what} holds id {int(ids.max())}, past the largest int64 id "
                          "(2**63 - 1): ids are int64")
    return ids.astype(np.int64, copy=False)


_SYNTH_KEYS = {"batches": "a whole number", "seed": "a whole number", "lookups":
               "a whole number", "drift": "a number", "profile": "a year"}


def _synth_kwargs(spec: str) -> dict[str, Any]:
    """The keyword arguments of `synthesize` a ``synth:key=value,...`` spec gives.

    Raises:
        ConfigError: an item is no key=value, the key is not one `synthesize` takes, or its
            value is of the wrong kind (true/false, or a fraction where a count is meant).
    """
    _, _, args = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, args.split(",")):
        key, eq, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise ConfigError(f"trace spec {spec!r}: expected key=value, got {item!r}")
        if key in kwargs:  # which of the two was meant is a guess
            raise ConfigError(f"trace spec {spec!r}: {key} is given twice; give it once")
        if key not in _SYNTH_KEYS:
            raise ConfigError(f"trace spec {spec!r}: unknown key {key!r}; known: "
                              f"{', '.join(sorted(_SYNTH_KEYS))} (see "
                              "embstore.tools.traces.synthesize)")
        value = _number(text.strip())
        want = _SYNTH_KEYS[key]
        if key != "profile" and (isinstance(value, (bool, str)) or value is None or (
                want == "a whole number" and not isinstance(value, int))):
            raise ConfigError(f"trace spec {spec!r}: {key} must be {want}, got {text.strip()!r}")
        if want == "a whole number" and value < 0:  # numpy's own words otherwise
            raise ConfigError(f"trace spec {spec!r}: {key} must be a whole number >= 0, got "
                              f"{value}")
        kwargs[key] = value
    return kwargs


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    words = {"none": None, "true": True, "false": False}
    return words.get(text.lower(), text)


def parse_capacities(text: str | Sequence[float], distinct: int) -> list[int]:
    """Cache sizes in ids: values below 1 are fractions of `distinct`, others are counts.

    Raises:
        ConfigError: a value is not positive, or a fraction of `distinct` under one id.
    """
    try:
        values = [float(v) for v in text.split(",")] if isinstance(text, str) else list(text)
    except ValueError as exc:
        raise ConfigError(f"capacities {text!r}: expected numbers, e.g. 0.01,0.05,1000") from exc
    out = []
    for v in values:
        if not v > 0 or not np.isfinite(v):
            raise ConfigError(f"capacity {v!r} must be > 0 (a fraction < 1 or a count)")
        # a fraction of a small trace's ids is at least one row (the report shows the count),
        # so the default fractions run on any trace; a cache of every distinct id misses
        # each once: larger ones behave the same
        out.append(max(1, round(v * distinct)) if v < 1 else int(min(v, max(distinct, 1))))
    return out


def parse_policy(spec: str, kind: str, seed: int = 0) -> EvictionPolicy | AdmissionPolicy:
    """Build a policy from ``name`` or ``name:key=value:key=value``.

    Raises:
        ConfigError: unknown name, wrong family or bad setting.
    """
    name, *items = spec.split(":")
    cls = registry.load_policy(name)
    if cls.kind != kind:
        raise ConfigError(f"policy {name!r} is an {cls.kind} policy, expected {kind}")
    kwargs: dict[str, Any] = {"seed": seed}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        kwargs[key] = _number(value)
    try:
        return cls.from_options(kwargs)  # type: ignore[no-any-return]
    except ConfigError as exc:
        raise ConfigError(f"policy spec {spec!r}: {exc}") from exc


def run_policies(trace: Trace, eviction: EvictionPolicy, admission: AdmissionPolicy,
                 capacity: int) -> SimResult:
    """Replay `trace` through a store tier of `capacity` ids run by the two policies.

    The tier gets fresh policies of the same names and settings (`config()`); the ones passed
    in are not changed.

    Raises:
        ConfigError: `capacity` is not positive.
    """
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1 id, got {capacity}")
    start = time.perf_counter()
    tiers = [TierSpec("dram", capacity=capacity, eviction=eviction.name,
                      eviction_options=eviction.config(), admission=admission.name,
                      admission_options=admission.config()),
             TierSpec("dram")]
    chain = build_chain(TableSpec("trace", dim=1), tiers, None, read_only=False,
                        background_writes=False)
    try:
        # every id is stored below: a miss is a fetch from the store of record
        chain.tiers[-1].backend.put(trace.ids, np.zeros((trace.distinct, 1), np.float32))
        for dense in trace.unique:
            if len(dense):
                chain.get(np.ascontiguousarray(trace.ids[dense]))
        top = chain.tiers[0].counters
        lookups, misses = top["lookups"], top["misses"]
    finally:
        chain.close()
    assert lookups == trace.lookups
    return SimResult(_spec(eviction), _spec(admission), capacity, trace.accesses,
                     lookups, misses, time.perf_counter() - start)


def _spec(policy: EvictionPolicy | AdmissionPolicy) -> str:
    default = type(policy)(seed=policy.seed).config()
    extra = [f"{k}={v}" for k, v in policy.config().items() if k != "seed" and default[k] != v]
    return ":".join([policy.name, *extra])


def _batch_records(trace: Trace) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per batch: its distinct dense ids and the batch of each one's next use (_NEVER if none)."""
    uniq = trace.unique
    counts = np.array([len(u) for u in uniq], dtype=np.int64)
    did = np.concatenate(uniq) if uniq else np.zeros(0, np.int64)
    bid = np.repeat(np.arange(len(uniq), dtype=np.int64), counts)
    # records are already in batch order, so a stable sort by id leaves each id's uses in time order
    order = np.argsort(did, kind="stable")
    nxt = np.full(len(did), _NEVER, dtype=np.int64)
    same = did[order[1:]] == did[order[:-1]]
    nxt[order[:-1][same]] = bid[order[1:][same]]
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return uniq, [nxt[bounds[i]:bounds[i + 1]] for i in range(len(uniq))]


def belady(trace: Trace, capacity: int) -> SimResult:
    """Belady's MIN for the batched model: the fewest misses any policy pair can reach.

    Raises:
        ConfigError: `capacity` is not positive.
    """
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1 id, got {capacity}")
    start = time.perf_counter()
    uniq, nexts = _batch_records(trace)
    cache_next = np.zeros(0, dtype=np.int64)  # only the next uses matter, not which ids
    misses = 0
    for b, (u, nxt) in enumerate(zip(uniq, nexts, strict=True)):
        used = cache_next == b
        misses += len(u) - int(np.count_nonzero(used))
        cand = np.concatenate([cache_next[~used], nxt])
        cand = cand[cand != _NEVER]  # never used again: keeping it cannot help
        if len(cand) > capacity:
            cand = cand[np.argpartition(cand, capacity - 1)[:capacity]]
        cache_next = cand
    return SimResult("belady", "-", capacity, trace.accesses, trace.lookups, misses,
                     time.perf_counter() - start)


def popularity_oracle(trace: Trace, capacity: int) -> SimResult:
    """A cache that knows every id's true popularity, for a synthetic trace.

    After each batch it keeps the `capacity` ids, of those it held and those the batch read,
    most likely to be read by the next batch (the trace's `SynthStream`, which drift updates
    batch by batch: a retired id is worth nothing). No online policy knows that popularity;
    it can only estimate it from the ids it has seen. When ids are drawn independently from
    a fixed popularity, keeping the most probable ones is the optimal policy among those that
    do not see the future (Aho, Denning and Ullman's A0, 1971); with batches and drift this
    is its natural extension. So the oracle's misses are about the fewest an eviction policy
    can reach on these traces, and a target below them is out of reach of any.

    Raises:
        ConfigError: `capacity` is not positive, or the trace is not synthetic.
    """
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1 id, got {capacity}")
    if trace.popularity is None:
        raise ConfigError("the popularity oracle needs a synthetic trace (synth:...): only "
                          "its generator knows each id's popularity")
    start = time.perf_counter()
    stream = trace.popularity()
    resident = np.zeros(trace.distinct, dtype=bool)
    cache = np.zeros(0, dtype=np.int64)  # dense ids
    misses = 0
    for b, dense in enumerate(trace.unique):
        drawn = stream.next_batch()  # the stream's state moves on to the next batch
        if len(drawn) != len(trace.batches[b]) or not np.array_equal(drawn, trace.batches[b]):
            raise ConfigError(f"batch {b} of the trace is not what its generator draws: the "
                              "popularity oracle replays only an unmodified synthetic trace")
        misses += len(dense) - int(np.count_nonzero(resident[dense]))
        cand = np.union1d(cache, dense)
        chance = stream.read_probability(trace.ids[cand])
        live = chance > 0
        cand, chance = cand[live], chance[live]
        if len(cand) > capacity:
            cand = cand[np.argpartition(-chance, capacity - 1)[:capacity]]
        resident[cache] = False
        resident[cand] = True
        cache = cand
    return SimResult("oracle", "-", capacity, trace.accesses, trace.lookups, misses,
                     time.perf_counter() - start)


def infinite(trace: Trace) -> SimResult:
    """An unbounded cache: only each id's first batch misses."""
    return SimResult("infinite", "-", trace.distinct, trace.accesses, trace.lookups,
                     trace.distinct, 0.0)


def _versus(best: SimResult, result: SimResult) -> dict[str, Any]:
    """`result` as a dict, with its misses over Belady's (`best`) as "miss_vs_belady"."""
    row = result.as_dict()
    row["miss_vs_belady"] = (result.misses / best.misses if best.misses
                             else float("inf") if result.misses else 1.0)
    return row


def simulate_trace(trace: Trace | Sequence[np.ndarray], evictions: Sequence[str],
                   admissions: Sequence[str], capacities: Sequence[float],
                   seed: int = 0) -> dict[str, Any]:
    """Every eviction x admission pair at every capacity, with Belady and the infinite cache.

    A synthetic trace (`load_trace("synth:...")`) also gets the popularity oracle: about the
    fewest misses (in expectation) a policy that does not see the future can hope for.

    Args:
        trace: a `Trace` or a sequence of id batches.
        evictions: eviction policy specs (``name[:key=value...]``).
        admissions: admission policy specs.
        capacities: fractions (< 1) of the distinct ids, or counts.
        seed: seed handed to every policy.

    Returns:
        {"accesses", "lookups", "distinct", "batches", "infinite": result dict, "capacities": [
        {"capacity", "belady": result dict, "oracle": result dict (synthetic traces
        only), "policies": [result dicts]}]}; every result but Belady's has "miss_vs_belady".

    Raises:
        ConfigError: a bad policy spec or capacity.
    """
    if not isinstance(trace, Trace):
        trace = Trace(trace)
    report: dict[str, Any] = {
        "accesses": trace.accesses, "lookups": trace.lookups, "distinct": trace.distinct,
        "batches": len(trace.batches),
        "infinite": infinite(trace).as_dict(), "capacities": [],
    }
    for capacity in parse_capacities(capacities, trace.distinct):
        best = belady(trace, capacity)
        rows = []
        for ev in evictions:
            for ad in admissions:
                rows.append(_versus(best, run_policies(
                    trace, parse_policy(ev, "eviction", seed),  # type: ignore[arg-type]
                    parse_policy(ad, "admission", seed), capacity)))  # type: ignore[arg-type]
        entry = {"capacity": capacity, "belady": best.as_dict(), "policies": rows}
        if trace.popularity is not None:
            entry["oracle"] = _versus(best, popularity_oracle(trace, capacity))
        report["capacities"].append(entry)
    return report
