"""W-TinyLFU: frequency decides between window candidates and main's victims; the window adapts."""

from __future__ import annotations

import numpy as np
import pytest

from embstore import TableSpec, TierSpec, registry
from embstore._build import build_chain
from embstore.errors import ConfigError
from embstore.policies._hashing import positions, sketch_count, sketch_estimate, sketch_halve
from embstore.policies.wtinylfu import WTinyLFUEviction
from embstore.tools.simulator import Trace, belady, parse_policy, run_policies
from embstore.tools.traces import synthesize


def ids_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_frequent_main_ids_survive_a_scan_of_new_ids() -> None:
    policy = registry.load_policy("wtinylfu")(climb=False, window_share=0.0)
    hot = np.arange(10, dtype=np.int64)
    policy.record_insert(hot, 0)
    for now in range(1, 6):  # hot ids read in five batches: frequency 6
        policy.record_access(hot, now)
    victims = []
    for now in range(6, 26):  # one-hit wonders, one batch each, into a 10-id cache
        new = np.arange(100 + 3 * now, 103 + 3 * now, dtype=np.int64)
        policy.record_insert(new, now)
        victims.append(policy.choose_victims(3, now))
    gone = np.concatenate(victims)
    assert not np.isin(hot, gone).any()  # the scan never displaced a frequent id
    assert len(policy) == 10


def test_a_candidate_more_frequent_than_mains_victim_replaces_it() -> None:
    policy = registry.load_policy("wtinylfu")(climb=False, window_share=0.0)
    policy.record_insert(ids_of(1, 2, 3, 4), 0)
    assert policy.choose_victims(1, 0).tolist() == [1]  # all equal: the oldest goes
    policy.record_insert(ids_of(9), 1)  # 9 and probation's oldest, 2, both count 1
    assert policy.choose_victims(1, 1).tolist() == [9]  # a tie goes against the candidate
    policy.record_insert(ids_of(9), 2)  # the sketch remembers the rejected 9: it counts 2
    assert policy.choose_victims(1, 2).tolist() == [2]
    assert len(policy) == 3


def test_hits_in_probation_protect_an_id() -> None:
    policy = registry.load_policy("wtinylfu")(climb=False, window_share=0.0)
    policy.record_insert(ids_of(1, 2, 3, 4, 5), 0)
    policy.choose_victims(1, 0)  # 1 goes; 2..5 in probation
    policy.record_access(ids_of(2), 1)  # 2 moves to protected
    policy.record_insert(ids_of(6), 2)
    assert sorted(policy.choose_victims(2, 2).tolist()) == [3, 6]


def _final_window_share(trace: Trace) -> float:
    return _replayed(trace, round(0.05 * trace.distinct)).current_window_share


def _replayed(trace: Trace, capacity: int) -> WTinyLFUEviction:
    # a real bounded DRAM tier over a DRAM store of record, as the simulator builds it
    tiers = [TierSpec("dram", capacity=capacity, eviction="wtinylfu"), TierSpec("dram")]
    chain = build_chain(TableSpec("t", dim=1), tiers, None, read_only=False,
                        background_writes=False)
    chain.tiers[-1].backend.put(trace.ids, np.zeros((trace.distinct, 1), np.float32))
    for dense in trace.unique:
        if len(dense):
            chain.get(np.ascontiguousarray(trace.ids[dense]))
    policy = chain.tiers[0].eviction
    chain.close()
    assert isinstance(policy, WTinyLFUEviction)
    return policy


def test_the_climber_grows_the_window_on_a_drifting_trace_and_not_on_a_stationary_one() -> None:
    # a climber that compares each sample with the one before kept the window at 1-7% on
    # the drifting trace: its hit ratio fell from sample to sample whatever the window did
    stationary = _final_window_share(Trace(list(synthesize(batches=384, seed=1, lookups=4096))))
    drifting = _final_window_share(Trace(list(synthesize(batches=512, seed=1, lookups=4096,
                                                         drift=0.01))))
    assert stationary < 0.1 and drifting > 0.3, (stationary, drifting)


def test_wtinylfu_stays_near_the_best_fixed_policy_on_a_drifting_trace() -> None:
    # 1.035x of S3-FIFO's misses with the symmetric probes; 1.107x with the climber that
    # compared consecutive samples
    trace = Trace(list(synthesize(batches=512, seed=1, lookups=4096, drift=0.01)))
    capacity = round(0.05 * trace.distinct)
    misses = {name: run_policies(trace, parse_policy(name, "eviction"),  # type: ignore[arg-type]
                                 parse_policy("always", "admission"),  # type: ignore[arg-type]
                                 capacity).misses
              for name in ("wtinylfu", "s3fifo", "clock")}
    assert misses["wtinylfu"] <= 1.05 * min(misses["s3fifo"], misses["clock"]), misses


def test_wtinylfu_is_close_to_the_best_fixed_policy_on_the_calibrated_trace() -> None:
    # the climber needs a few hundred batches: at 256 it is still 2.3% behind LFU
    trace = Trace(list(synthesize(batches=384, seed=1, lookups=4096)))
    capacity = round(0.05 * trace.distinct)
    best = belady(trace, capacity).misses
    ratio = {}
    for name in ("wtinylfu", "lfu", "s3fifo"):
        result = run_policies(trace, parse_policy(name, "eviction"),  # type: ignore[arg-type]
                              parse_policy("always", "admission"), capacity)  # type: ignore[arg-type]
        ratio[name] = result.misses / best
    assert ratio["wtinylfu"] <= 1.02 * min(ratio["lfu"], ratio["s3fifo"]), ratio


def _sliding_window(batches: int, seed: int) -> Trace:
    # ids drawn uniformly from a window of 50,000 that moves on 2,000 ids a batch: reuse
    # follows recency alone, so LRU (a window of the whole capacity) is what pays
    rng = np.random.default_rng(seed)
    return Trace([k * 2_000 + rng.integers(0, 50_000, 4_096) for k in range(batches)])


def _new_hot_sets(batches: int, phases: int, seed: int) -> Trace:
    # Zipf(1.0) over 200,000 ids whose ranks are shuffled anew every batches/phases batches
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, 200_001)
    weights /= weights.sum()
    out = []
    for _ in range(phases):
        ranks = rng.permutation(200_000)
        out += [ranks[rng.choice(200_000, 4_096, p=weights)] for _ in range(batches // phases)]
    return Trace(out)


def _misses(trace: Trace, names: tuple[str, ...]) -> dict[str, int]:
    capacity = round(0.05 * trace.distinct)
    return {name: run_policies(trace, parse_policy(name, "eviction"),  # type: ignore[arg-type]
                               parse_policy("always", "admission"),  # type: ignore[arg-type]
                               capacity).misses
            for name in names}


def test_the_window_climbs_to_the_whole_capacity_where_only_recency_pays() -> None:
    # before the window could pass 80% of the capacity and its step 25%, W-TinyLFU missed
    # 1.20x as often as LRU on this stream (1.04x after)
    trace = _sliding_window(300, seed=3)
    assert _final_window_share(trace) > 0.9
    misses = _misses(trace, ("wtinylfu", "lru"))
    assert misses["wtinylfu"] <= 1.1 * misses["lru"], misses


def test_a_new_hot_set_gets_into_the_main_region_within_a_phase() -> None:
    # each shuffle is a fall in the hit ratio the climber notices: the sketch is aged at
    # once, where before the old set's counts outbid the new ids for a halving period
    trace = _new_hot_sets(300, 3, seed=4)
    misses = _misses(trace, ("wtinylfu", "s3fifo", "lfu"))
    assert misses["wtinylfu"] <= 1.03 * min(misses["s3fifo"], misses["lfu"]), misses
    # both shuffles noticed (a fall spread over two phases is noticed in each)
    assert 2 <= _replayed(trace, round(0.05 * trace.distinct)).hot_set_shifts <= 4


def test_a_steady_stream_is_seldom_taken_for_a_new_hot_set() -> None:
    # small caches' phases are a few hundred to a few thousand requests: when only the new
    # phase's noise was counted, the shift detector fired 3, 4 and 3 times in these 400
    # batches of a steady stream, each time aging the sketch twice and widening the step
    trace = _sliding_window(400, seed=7)
    shifts = [_replayed(trace, capacity).hot_set_shifts for capacity in (400, 1_600, 3_000)]
    assert sum(shifts) <= 1, shifts


@pytest.mark.parametrize("setting", [{"window_share": 1.0}, {"protected_share": -0.1},
                                     {"step": 0.0}, {"sample_factor": 0},
                                     {"sketch_factor": -1}, {"climb": "false"},
                                     {"hold_new": 2}, {"protected_share": True},
                                     {"window_share": "0.1"},
                                     {"sketch_factor": float("inf")}])
def test_bad_settings_are_config_errors(setting: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="WTinyLFUEviction"):
        registry.load_policy("wtinylfu")(**setting)


def test_hold_new_keeps_this_calls_inserts_until_a_later_call() -> None:
    held = registry.load_policy("wtinylfu")(climb=False, window_share=0.0, hold_new=True)
    plain = registry.load_policy("wtinylfu")(climb=False, window_share=0.0)
    for policy in (held, plain):
        policy.record_insert(ids_of(1, 2, 3), 0)
        policy.choose_victims(0, 0)
        policy.record_access(ids_of(1, 2, 3), 1)
        policy.record_insert(ids_of(7, 8), 2)
    # plain: the newcomers lose to the more frequent residents at once
    assert sorted(plain.choose_victims(2, 2).tolist()) == [7, 8]
    # held: they stay for this call; the residents give way (then compete normally)
    assert sorted(held.choose_victims(2, 2).tolist()) == [1, 2]
    assert np.isin([7, 8], held.choose_victims(2, 3)).all()


def _unpacked(sketch: np.ndarray) -> np.ndarray:
    """The 4-bit counters of a packed sketch, [depth, 2**bits] (low nibble first)."""
    return np.stack([sketch & 15, sketch >> 4], axis=-1).reshape(sketch.shape[0], -1)


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_the_sketch_counts_and_estimates_as_the_numpy_hashes_address_it(seed: int) -> None:
    rng = np.random.default_rng(seed % 1000)
    depth, bits = 4, 8
    sketch = rng.integers(0, 256, (depth, 1 << (bits - 1))).astype(np.uint8)
    ids = rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
    ids[:40] = ids[40]  # one id 41 times: its counters saturate
    cells = positions(ids, seed, depth, bits) + (np.arange(depth) << bits)[:, None]
    want = _unpacked(sketch).astype(np.int64).reshape(-1)
    np.add.at(want, cells.ravel(), 1)
    want = np.minimum(want, 15).reshape(depth, -1)
    sketch_count(sketch, ids, seed, 15)
    np.testing.assert_array_equal(_unpacked(sketch), want)
    est = sketch_estimate(sketch, ids, seed)
    np.testing.assert_array_equal(est, want.reshape(-1)[cells].min(axis=0))
    assert est.dtype == np.uint8


def test_halving_halves_each_counter_of_a_byte_on_its_own() -> None:
    sketch = np.array([[0x00, 0x01, 0x10, 0xFF, 0x9A]], dtype=np.uint8)
    want = _unpacked(sketch) >> 1
    sketch_halve(sketch)
    np.testing.assert_array_equal(_unpacked(sketch), want)


def test_a_sketch_of_another_shape_or_type_or_a_top_over_15_is_refused() -> None:
    ids = np.array([1, 2], dtype=np.int64)
    for bad in (np.zeros((4, 12), np.uint8), np.zeros((4, 16), np.uint16),
                np.zeros((4, 32), np.uint8)[:, ::2]):
        with pytest.raises((TypeError, ValueError)):
            sketch_count(bad, ids, 0, 15)
    sketch = np.zeros((4, 16), np.uint8)
    with pytest.raises(ValueError):
        sketch_count(sketch, ids, 0, 16)
    np.testing.assert_array_equal(sketch, 0)
