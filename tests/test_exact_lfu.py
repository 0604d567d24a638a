"""The exact decayed-count cache of `embstore simulate --exact-lfu`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from embstore.errors import ConfigError
from embstore.tools._frequency_bound import best_exact_lfu, exact_lfu
from embstore.tools.cli import main
from embstore.tools.simulator import Trace, belady, infinite


def plain_replay(batches: list[list[int]], capacity: int, half_life: float) -> int:
    """Misses of the same cache, written the plain way: every count decays every batch."""
    decay = 0.5 ** (1.0 / half_life)
    counts: dict[int, float] = {}
    last: dict[int, int] = {}
    cache: set[int] = set()
    misses = 0
    for b, batch in enumerate(batches):
        distinct = sorted(set(batch))
        misses += sum(i not in cache for i in distinct)
        counts = {i: c * decay for i, c in counts.items()}
        for i in distinct:
            counts[i] = counts.get(i, 0.0) + 1.0
            last[i] = b
        ranked = sorted(cache | set(distinct), key=lambda i: (-counts[i], -last[i], i))
        cache = set(ranked[:capacity])
    return misses


def random_batches(seed: int, batches: int = 30, ids: int = 25) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, ids + 1)
    return [list(rng.choice(ids, size=rng.integers(0, 10), p=weights / weights.sum()) * 3)
            for _ in range(batches)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("half_life", [0.5, 1.0, math.inf])
def test_the_replay_equals_a_plain_one_that_decays_every_count(seed: int,
                                                               half_life: float) -> None:
    # half-lives whose weights are powers of two, so both ways count exactly alike
    batches = random_batches(seed)
    trace = Trace([np.asarray(b, dtype=np.int64) for b in batches])
    for capacity in (1, 3, 8):
        assert exact_lfu(trace, capacity, half_life).misses == \
            plain_replay(batches, capacity, half_life)


def test_counts_rescaled_before_they_overflow_rank_as_before() -> None:
    # reads 4x heavier each batch pass 1e150 after 250 batches and float64 after 512
    batches = random_batches(11, batches=600)
    trace = Trace([np.asarray(b, dtype=np.int64) for b in batches])
    assert exact_lfu(trace, 3, 0.5).misses == plain_replay(batches, 3, 0.5)


def test_aging_lets_a_new_id_displace_an_old_frequent_one() -> None:
    trace = Trace([np.array([1]), np.array([1]), np.array([2]), np.array([2]), np.array([1])])
    # no aging: id 1 (2 reads) keeps the one place against 2 (1 read), then 2 ties at 2 reads
    # and wins as the later read; the last batch misses
    assert exact_lfu(trace, 1, math.inf).misses == 4
    # reads four times as heavy each batch: 2 displaces 1 at its first read
    assert exact_lfu(trace, 1, 0.5).misses == 3


def test_a_cache_of_every_id_misses_only_first_reads_and_none_beats_belady() -> None:
    batches = random_batches(7, batches=60)
    trace = Trace([np.asarray(b, dtype=np.int64) for b in batches])
    assert exact_lfu(trace, trace.distinct, 10.0).misses == infinite(trace).misses
    for capacity in (1, 4, 10):
        best, half_life = best_exact_lfu(trace, capacity)
        assert best.misses >= belady(trace, capacity).misses
        assert best.misses == min(exact_lfu(trace, capacity, h).misses
                                  for h in (5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                                            math.inf))
        assert best.misses == exact_lfu(trace, capacity, half_life).misses


@pytest.mark.parametrize("capacity, half_life", [(0, 1.0), (1, 0.0), (1, -1.0),
                                                 (1, math.nan)])
def test_bad_settings_are_config_errors(capacity: int, half_life: float) -> None:
    with pytest.raises(ConfigError):
        exact_lfu(Trace([np.array([1, 2])]), capacity, half_life)


def test_best_needs_a_half_life() -> None:
    with pytest.raises(ConfigError, match="at least one half-life"):
        best_exact_lfu(Trace([np.array([1, 2])]), 1, ())


def test_simulate_prints_the_exact_counts_line_and_strict_json(
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = "synth:seed=1,batches=24,lookups=512"
    assert main(["simulate", spec, "--capacity", "0.05", "--exact-lfu"]) == 0
    assert "exact-lfu" in capsys.readouterr().out
    assert main(["simulate", spec, "--capacity", "0.05", "--exact-lfu", "--json"]) == 0

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    report = json.loads(capsys.readouterr().out, parse_constant=refuse)
    counted = report["capacities"][0]["exact_lfu"]
    assert counted["eviction"] == "exact-lfu"
    assert counted["half_life"] is None or counted["half_life"] > 0
    assert counted["miss_vs_belady"] >= 1.0
    assert main(["simulate", spec, "--capacity", "0.05"]) == 0
    assert "exact-lfu" not in capsys.readouterr().out  # only when asked: it costs seconds
