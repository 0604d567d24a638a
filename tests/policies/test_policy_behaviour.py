"""One behaviour test per policy: what makes each one what it is."""

from __future__ import annotations

import numpy as np
import pytest

from embstore import registry
from embstore.index import IdIndex


def ids_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def sorted_victims(policy, n: int, now: float = 100) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(policy.choose_victims(n, now).tolist())


def test_lru_evicts_least_recently_used_ties_by_first_occurrence() -> None:
    lru = registry.load_policy("lru")()
    lru.record_insert(ids_of(5, 1, 4, 2, 3), 0)  # one call: ties keep the call's order
    lru.record_access(ids_of(2, 1, 2, 1), 1)  # repeats count once, at their first place
    lru.record_access(ids_of(5), 2)
    assert lru.choose_victims(2, 3).tolist() == [4, 3]
    assert lru.choose_victims(3, 3).tolist() == [2, 1, 5]


def test_lfu_keeps_the_frequent_ids() -> None:
    lfu = registry.load_policy("lfu")(aging_period=None)
    lfu.record_insert(np.arange(6, dtype=np.int64), 0)
    lfu.record_access(ids_of(0, 0, 0, 1, 1, 2), 1)  # duplicates count
    lfu.record_access(ids_of(2, 2, 5), 2)
    # counts: 0:4, 1:3, 2:4, 3:1, 4:1, 5:2 -> 3 and 4 first, then 5
    assert sorted_victims(lfu, 2) == [3, 4]
    assert sorted_victims(lfu, 1) == [5]


def test_lfu_aging_lets_new_popularity_win() -> None:
    aged = registry.load_policy("lfu")(aging_period=10, aging_factor=0.5)
    plain = registry.load_policy("lfu")(aging_period=None)
    for lfu in (aged, plain):
        lfu.record_insert(ids_of(1, 2), 0)
        lfu.record_access(np.full(12, 1, dtype=np.int64), 0)  # id 1 was hot long ago
        for now in (40, 50, 60):
            lfu.record_access(ids_of(2, 2), now)  # id 2 is hot now
    # aged: id 1 fell to 13/2**6 ~ 0.2 while id 2 has ~ 3.5; plain: 13 against 7
    assert aged.choose_victims(1, 61).tolist() == [1]
    assert plain.choose_victims(1, 61).tolist() == [2]


def test_lfu_ages_once_per_period_passed_even_without_calls_between() -> None:
    lfu = registry.load_policy("lfu")(aging_period=10, aging_factor=0.5)
    lfu.record_insert(ids_of(1, 2), 0)
    lfu.record_access(np.full(12, 1, dtype=np.int64), 0)  # 1 at 13
    lfu.record_access(ids_of(2, 2), 35)  # three periods on, in one call
    # 1 at 13 / 2**3 ~ 1.6 against 2 at 1 / 2**3 + 2 ~ 2.1; aged once, 6.5 against 2.5
    assert lfu.choose_victims(1, 36).tolist() == [1]


@pytest.mark.parametrize("shared", [False, True], ids=["own index", "shared index"])
def test_clock_gives_accessed_ids_a_second_chance(shared: bool) -> None:
    clock = registry.load_policy("clock")()
    if shared:  # as a DRAM tier drives it: slots from the backend's index, hits by slot
        index = IdIndex()
        clock.share_index(index)
        slots, _ = index.add(ids_of(1, 2, 3, 4))
        clock.record_insert_slots(ids_of(1, 2, 3, 4), slots, 0)
        clock.record_access_slots(slots[[0, 2]], 1)
    else:
        clock.record_insert(ids_of(1, 2, 3, 4), 0)
        clock.record_access(ids_of(1, 3), 1)
    assert clock.choose_victims(1, 2).tolist() == [2]
    # the hand cleared 1's bit on the way and moved it behind 3 and 4
    assert clock.choose_victims(1, 2).tolist() == [4]
    assert clock.choose_victims(1, 2).tolist() == [1]
    assert clock.choose_victims(1, 2).tolist() == [3]


def test_clock_with_every_bit_set_degrades_to_fifo() -> None:
    clock = registry.load_policy("clock")()
    clock.record_insert(ids_of(7, 8, 9), 0)
    clock.record_access(ids_of(9, 8, 7), 1)
    assert clock.choose_victims(2, 2).tolist() == [7, 8]


def test_fifo_evicts_in_insertion_order_whatever_the_accesses() -> None:
    fifo = registry.load_policy("fifo")()
    fifo.record_insert(ids_of(30, 10), 0)
    fifo.record_insert(ids_of(20), 1)
    fifo.record_access(ids_of(10, 10, 10), 2)
    assert fifo.choose_victims(3, 3).tolist() == [10, 30, 20]


def test_random_eviction_is_uniform_and_seeded() -> None:
    counts = np.zeros(10)
    for seed in range(400):
        rand = registry.load_policy("random")(seed=seed)
        rand.record_insert(np.arange(10, dtype=np.int64), 0)
        counts[rand.choose_victims(1, 1)] += 1
    assert counts.min() > 20 and counts.max() < 65  # 40 expected each, 6 sd ~ 36
    a = registry.load_policy("random")(seed=1)
    b = registry.load_policy("random")(seed=2)
    for p in (a, b):
        p.record_insert(np.arange(1000, dtype=np.int64), 0)
    assert not np.array_equal(a.choose_victims(20, 1), b.choose_victims(20, 1))


def test_s3fifo_keeps_a_reaccessed_id_and_evicts_one_hit_wonders_first() -> None:
    s3 = registry.load_policy("s3fifo")()
    s3.record_insert(np.arange(100, dtype=np.int64), 0)  # all start in the small queue
    s3.record_access(ids_of(0, 1, 2), 1)
    victims = s3.choose_victims(50, 2)
    assert not np.isin(ids_of(0, 1, 2), victims).any()
    assert np.array_equal(np.sort(victims), np.arange(3, 53))


def test_s3fifo_ghost_hit_goes_to_main_and_outlives_the_small_queue() -> None:
    s3 = registry.load_policy("s3fifo")()
    s3.record_insert(np.arange(20, dtype=np.int64), 0)
    assert s3.choose_victims(1, 1).tolist() == [0]  # 0 goes to the ghost queue
    s3.record_insert(ids_of(0), 2)  # remembered: enters main
    s3.record_insert(np.arange(100, 120, dtype=np.int64), 3)
    victims = s3.choose_victims(30, 4)
    assert 0 not in victims.tolist()


def test_ttl_expires_idle_ids_only() -> None:
    ttl = registry.load_policy("ttl")(ttl=10)
    ttl.record_insert(ids_of(1, 2, 3), 0)
    ttl.record_access(ids_of(2), 5)
    ttl.record_insert(ids_of(4), 8)
    assert ttl.expired(9).tolist() == []
    assert sorted(ttl.expired(10).tolist()) == [1, 3]
    assert ttl.expired(15).tolist() == [2]
    assert len(ttl) == 1
    with pytest.raises(ValueError, match="ttl"):
        registry.load_policy("ttl")(ttl=0)


def test_second_hit_admits_only_on_the_second_sighting() -> None:
    second = registry.load_policy("second_hit")(capacity=10_000)
    first = second.admit(ids_of(1, 2, 2, 3), 0)
    assert not first.any()  # duplicates in one call are one sighting
    assert second.admit(ids_of(2, 4), 1).tolist() == [True, False]
    assert second.admit(ids_of(4, 1, 5), 2).tolist() == [True, True, False]
    fresh = np.arange(10**6, 10**6 + 5000, dtype=np.int64)
    assert second.admit(fresh, 3).mean() < 0.03  # false positives near fp_rate 0.01


def test_second_hit_forgets_after_two_generations() -> None:
    second = registry.load_policy("second_hit")(capacity=100)
    second.admit(ids_of(-7), 0)
    second.admit(np.arange(1000, 1100, dtype=np.int64), 1)  # fills a generation
    assert second.admit(ids_of(-7), 2).tolist() == [True]  # the previous one still knows
    second.admit(np.arange(2000, 2100, dtype=np.int64), 3)
    second.admit(np.arange(3000, 3100, dtype=np.int64), 4)
    assert second.admit(ids_of(-7), 5).tolist() == [False]


def test_frequency_admits_at_the_threshold() -> None:
    freq = registry.load_policy("frequency")(threshold=3, width=1 << 12)
    assert freq.admit(ids_of(1, 2, 2), 0).tolist() == [False, False, False]
    assert freq.admit(ids_of(1, 2), 1).tolist() == [False, True]  # 2 has been seen 3 times
    assert freq.admit(ids_of(1, 9), 2).tolist() == [True, False]
    assert freq.estimate(ids_of(1, 2, 9)).tolist() == [3, 3, 1]


def test_frequency_halves_its_counts_after_the_sample() -> None:
    freq = registry.load_policy("frequency")(threshold=4, width=1 << 12, reset_after=100)
    freq.admit(np.full(8, 5, dtype=np.int64), 0)
    freq.admit(np.arange(100, 192, dtype=np.int64), 1)  # 100 additions: reset
    assert freq.estimate(ids_of(5)).tolist() == [4]
    assert freq.admit(ids_of(5), 2).tolist() == [True]


def test_probability_admits_about_p_of_the_ids() -> None:
    prob = registry.load_policy("probability")(p=0.3, seed=11)
    share = prob.admit(np.arange(20_000, dtype=np.int64), 0).mean()
    assert abs(share - 0.3) < 0.02  # sd 0.0032
    assert not registry.load_policy("probability")(p=0.0).admit(ids_of(1, 2), 0).any()
    assert registry.load_policy("probability")(p=1.0).admit(ids_of(1, 2), 0).all()


def test_always_admits_everything() -> None:
    assert registry.load_policy("always")().admit(ids_of(1, 1, 2), 0).all()


def test_lfu_history_restores_an_evicted_ids_count() -> None:
    lfu = registry.load_policy("lfu")(aging_period=None, history_width=1 << 10)
    plain = registry.load_policy("lfu")(aging_period=None, history_width=None)
    for p in (lfu, plain):
        p.record_insert(ids_of(1, 2), 0)
        p.record_access(np.full(9, 1, dtype=np.int64), 1)  # 1 is popular
        p.record_access(ids_of(2, 2), 1)
        assert p.choose_victims(1, 2).tolist() == [2]  # the less read leaves first
        assert p.choose_victims(1, 2).tolist() == [1]  # then 1, with count 10
        p.record_access(np.full(4, 3, dtype=np.int64), 3)  # reads of untracked 3
        p.record_insert(ids_of(1, 2, 3, 4), 4)
    # with history: 1 resumes at 11, 2 at 4, 3 at 5, 4 at 1; without, all start at 1
    assert sorted(lfu.choose_victims(3, 5).tolist()) == [2, 3, 4]
    assert plain.choose_victims(1, 5).tolist() == [1]
