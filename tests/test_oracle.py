"""The popularity oracle: true read probabilities of a synthetic trace, and the cache using them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from embstore.errors import ConfigError
from embstore.tools.cli import main
from embstore.tools.simulator import (
    Trace,
    belady,
    infinite,
    load_trace,
    parse_capacities,
    parse_policy,
    popularity_oracle,
    run_policies,
)
from embstore.tools.traces import SynthStream, synthesize


def test_read_probability_matches_how_often_ids_are_read() -> None:
    # 2022 has two uniform heavy-hitter rows in the last table: read by every batch
    params = {"seed": 5, "profile": "2022", "lookups": 2048}
    stream = SynthStream(**params)
    batches = [stream.next_batch() for _ in range(400)]
    ids, counts = np.unique(np.concatenate([np.unique(b) for b in batches]),
                            return_counts=True)
    chance = SynthStream(**params).read_probability(ids)
    assert (chance > 0).all() and (chance <= 1).all()
    seen = counts / len(batches)
    # rows read often enough for a tight estimate: within 5 standard errors of their rate
    often = chance > 0.2
    assert often.sum() > 20
    sd = np.sqrt(chance[often] * (1 - chance[often]) / len(batches))
    assert (np.abs(seen[often] - chance[often]) <= 5 * sd + 1e-9).all()
    assert np.isclose(chance.max(), 1.0)  # the heavy hitters
    # ids the stream never makes: past the last table, a negative one (whose table bits
    # would index from the end), a key that is no row's in this epoch
    tables = len(stream.params.table_rows())
    strangers = np.array([tables << 40, 999 << 40, -1, -(1 << 40) + 5, 12345], dtype=np.int64)
    assert (stream.read_probability(strangers) == 0.0).all()
    # a profile cut to fewer lookups than its tables leaves the one-row table unread: chance 0
    few = SynthStream(seed=1, lookups=16)
    last = (len(few.params.table_rows()) - 1) << 40
    assert few.params.table_lookups()[-1] == 0
    assert few.read_probability(np.array([last], dtype=np.int64)).tolist() == [0.0]


def test_read_probability_forgets_ids_that_drift_retires() -> None:
    stream = SynthStream(seed=2, lookups=1024, drift=1.0)  # every key renewed after a batch
    first = np.unique(stream.next_batch())
    assert (stream.read_probability(first) == 0).all()
    second = np.unique(stream.next_batch())
    fresh = SynthStream(seed=2, lookups=1024, drift=1.0)
    fresh.next_batch()  # the same state as `stream` before its second batch
    assert (fresh.read_probability(second) > 0).all()


def test_synthesize_is_the_stream_and_draws_what_it_always_drew() -> None:
    a = list(synthesize(5, seed=8, lookups=2048, drift=0.01))
    stream = SynthStream(seed=8, lookups=2048, drift=0.01)
    assert all(np.array_equal(x, stream.next_batch()) for x in a)
    # the README's figures replay these streams: pinned to what they were before the
    # generator became a class (a numpy that changed Generator's streams would show here)
    pinned = {"0c1466c155956eb7": {"seed": 11, "lookups": 4096, "drift": 0.01, "profile": "2022"},
              "f718663b2d703d32": {"seed": 3, "lookups": 2048}}
    for digest, kwargs in pinned.items():
        got = np.concatenate(list(synthesize(6, **kwargs)))  # type: ignore[arg-type]
        assert hashlib.sha256(got.tobytes()).hexdigest()[:16] == digest, kwargs


def plain_oracle_misses(trace: Trace, capacity: int) -> int:
    """The oracle's definition, one id at a time with Python sets."""
    stream = trace.popularity()  # type: ignore[misc]
    cache: set[int] = set()
    misses = 0
    for batch in trace.batches:
        stream.next_batch()
        touched = set(batch.tolist())
        misses += len(touched - cache)
        pool = sorted(cache | touched)
        chance = dict(zip(pool, stream.read_probability(np.array(pool, dtype=np.int64)),
                          strict=True))
        ranked = sorted((i for i in pool if chance[i] > 0), key=lambda i: -chance[i])
        cache = set(ranked[:capacity])
    return misses


@pytest.mark.parametrize("drift", [0.0, 0.05])
def test_oracle_replay_is_its_definition(drift: float) -> None:
    trace = load_trace(f"synth:seed=4,batches=40,lookups=512,drift={drift}")
    for capacity in (50, 300):
        assert popularity_oracle(trace, capacity).misses == plain_oracle_misses(trace, capacity)


@pytest.mark.parametrize("drift", [0.0, 0.002])
def test_oracle_sits_between_belady_and_the_policies(drift: float) -> None:
    trace = load_trace(f"synth:seed=3,batches=96,lookups=4096,profile=2021,drift={drift}")
    capacity = parse_capacities("0.05", trace.distinct)[0]
    oracle = popularity_oracle(trace, capacity).misses
    assert belady(trace, capacity).misses < oracle
    for name in ("lfu", "lru", "wtinylfu", "s3fifo"):
        policy = run_policies(trace, parse_policy(name, "eviction"),
                              parse_policy("always", "admission"), capacity)
        assert oracle < policy.misses, name
    # a cache for every id misses only first reads: retired ids never come back
    assert popularity_oracle(trace, trace.distinct).misses == infinite(trace).misses


def test_oracle_needs_an_unmodified_synthetic_trace() -> None:
    with pytest.raises(ConfigError, match="synthetic trace"):
        popularity_oracle(Trace([np.arange(10)]), 5)
    trace = load_trace("synth:seed=1,batches=3,lookups=256")
    changed = Trace([b[::-1] for b in trace.batches], popularity=trace.popularity)
    with pytest.raises(ConfigError, match="not what its generator draws"):
        popularity_oracle(changed, 10)
    with pytest.raises(ConfigError, match="capacity"):
        popularity_oracle(trace, 0)


def test_cli_simulate_shows_the_oracle_for_synthetic_traces(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = "synth:seed=1,batches=20,lookups=1024"
    assert main(["simulate", spec, "--policy", "lru", "--capacity", "0.05", "--json"]) == 0
    cap = json.loads(capsys.readouterr().out)["capacities"][0]
    assert cap["belady"]["misses"] <= cap["oracle"]["misses"]
    assert cap["oracle"]["miss_vs_belady"] >= 1.0
    assert main(["simulate", spec, "--policy", "lru", "--capacity", "0.05"]) == 0
    assert "(popularity)" in capsys.readouterr().out
    # a trace from a file has no generator to ask
    np.save(str(tmp_path / "t.npy"), np.stack(list(synthesize(3, seed=1, lookups=512))))
    assert main(["simulate", str(tmp_path / "t.npy"), "--capacity", "0.05", "--json"]) == 0
    assert "oracle" not in json.loads(capsys.readouterr().out)["capacities"][0]
