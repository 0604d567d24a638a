"""The contract every registered policy keeps; a new policy module is tested with no edit here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embstore import registry
from embstore.errors import ConfigError
from embstore.index import IdIndex
from embstore.policy import AdmissionPolicy, EvictionPolicy, SupportsSharedIndex

EVICTION = registry.policy_names("eviction")
ADMISSION = registry.policy_names("admission")


def ids_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.fixture(params=EVICTION, ids=str)
def eviction(request: pytest.FixtureRequest) -> EvictionPolicy:
    return registry.load_policy(request.param)(seed=7)


@pytest.fixture(params=ADMISSION, ids=str)
def admission(request: pytest.FixtureRequest) -> AdmissionPolicy:
    return registry.load_policy(request.param)(seed=7)


def run_workload(policy: EvictionPolicy, seed: int, steps: int = 40) -> list[np.ndarray]:
    """Drive `policy` as a 50-id cache over ids 0..299; check the contract after each step."""
    rng = np.random.default_rng(seed)
    tracked: set[int] = set()
    victims_log = []
    for now in range(steps):
        batch = rng.integers(0, 300, size=64)
        policy.record_access(batch, now)
        new = np.setdiff1d(batch, np.fromiter(tracked, dtype=np.int64, count=len(tracked)))
        over = len(tracked) + len(new) - 50
        if over > 0:
            victims = policy.choose_victims(over, now)
            assert victims.dtype == np.int64
            assert len(victims) == min(over, len(tracked))
            assert len(np.unique(victims)) == len(victims)
            assert set(victims.tolist()) <= tracked
            tracked -= set(victims.tolist())
            victims_log.append(victims)
        policy.record_insert(new, now)
        tracked |= set(new.tolist())
        if now % 7 == 3:
            gone = rng.choice(np.array(sorted(tracked)), size=5, replace=False)
            policy.record_remove(gone)
            tracked -= set(gone.tolist())
        expired = policy.expired(now)
        assert set(expired.tolist()) <= tracked
        tracked -= set(expired.tolist())
        assert len(policy) == len(tracked)
    return victims_log


def test_eviction_tracks_inserts_and_removes(eviction: EvictionPolicy) -> None:
    eviction.record_insert(np.arange(100, dtype=np.int64), 0)
    assert len(eviction) == 100
    eviction.record_remove(np.arange(10, dtype=np.int64))
    assert len(eviction) == 90
    eviction.record_remove(ids_of(5, 1000, -3))  # already gone or never tracked
    assert len(eviction) == 90


def test_victims_are_distinct_tracked_ids_and_become_untracked(eviction: EvictionPolicy) -> None:
    ids = np.arange(1000, 1100, dtype=np.int64)
    eviction.record_insert(ids, 0)
    eviction.record_access(ids[::3], 1)
    victims = eviction.choose_victims(30, 2)
    assert len(victims) == 30 and len(np.unique(victims)) == 30
    assert np.isin(victims, ids).all()
    assert len(eviction) == 70
    rest = eviction.choose_victims(500, 3)
    assert len(rest) == 70
    assert not np.isin(rest, victims).any()
    assert len(eviction) == 0
    assert len(eviction.choose_victims(5, 4)) == 0


def test_removed_and_untracked_ids_are_never_chosen(eviction: EvictionPolicy) -> None:
    ids = np.arange(200, dtype=np.int64)
    eviction.record_insert(ids, 0)
    eviction.record_remove(ids[::2])
    eviction.record_access(np.arange(500, 600, dtype=np.int64), 1)  # untracked: ignored
    assert len(eviction) == 100
    victims = eviction.choose_victims(1000, 2)
    assert np.array_equal(np.sort(victims), ids[1::2])


def test_evicted_ids_can_be_inserted_again(eviction: EvictionPolicy) -> None:
    ids = np.arange(50, dtype=np.int64)
    eviction.record_insert(ids, 0)
    victims = eviction.choose_victims(20, 1)
    eviction.record_insert(victims, 2)
    assert len(eviction) == 50
    assert np.array_equal(np.sort(eviction.choose_victims(100, 3)), ids)


def test_random_workload_keeps_the_contract(eviction: EvictionPolicy) -> None:
    run_workload(eviction, seed=1)


def test_same_seed_and_calls_give_same_victims(eviction: EvictionPolicy) -> None:
    twin = type(eviction)(**eviction.config())
    a, b = run_workload(eviction, seed=2), run_workload(twin, seed=2)
    assert len(a) == len(b) > 0
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_eviction_config_round_trips(eviction: EvictionPolicy) -> None:
    config = eviction.config()
    assert json.loads(json.dumps(config)) == config
    again = type(eviction)(**config)
    assert again.config() == config


def test_eviction_accepts_empty_batches(eviction: EvictionPolicy) -> None:
    empty = np.zeros(0, dtype=np.int64)
    eviction.record_access(empty, 0)
    eviction.record_insert(empty, 0)
    eviction.record_remove(empty)
    victims = eviction.choose_victims(3, 0)
    assert victims.dtype == np.int64 and len(victims) == 0
    eviction.record_insert(ids_of(1, 2), 1)
    assert len(eviction.choose_victims(0, 1)) == 0
    assert len(eviction) == 2


def test_eviction_accepts_duplicate_ids_in_a_batch(eviction: EvictionPolicy) -> None:
    eviction.record_insert(np.arange(10, dtype=np.int64), 0)
    eviction.record_access(ids_of(3, 3, 3, 4, 3, 99, 99), 1)
    assert len(eviction) == 10
    victims = eviction.choose_victims(10, 2)
    assert np.array_equal(np.sort(victims), np.arange(10))


def test_admit_answers_every_id_and_duplicates_alike(admission: AdmissionPolicy) -> None:
    rng = np.random.default_rng(0)
    for now in range(5):
        batch = rng.integers(0, 100, size=400)
        out = admission.admit(batch, now)
        assert out.dtype == np.bool_ and out.shape == batch.shape
        for value in np.unique(batch):
            assert len(np.unique(out[batch == value])) == 1


def test_same_seed_and_calls_give_same_admissions(admission: AdmissionPolicy) -> None:
    twin = type(admission)(**admission.config())
    rng = np.random.default_rng(3)
    for now in range(10):
        batch = rng.integers(0, 500, size=200)
        assert np.array_equal(admission.admit(batch, now), twin.admit(batch, now))


def test_admission_config_round_trips(admission: AdmissionPolicy) -> None:
    config = admission.config()
    assert json.loads(json.dumps(config)) == config
    assert type(admission)(**config).config() == config


def test_admission_accepts_empty_batches(admission: AdmissionPolicy) -> None:
    out = admission.admit(np.zeros(0, dtype=np.int64), 0)
    assert out.dtype == np.bool_ and out.shape == (0,)


def test_every_policy_has_its_registry_name() -> None:
    for name in EVICTION + ADMISSION:
        assert registry.load_policy(name).name == name
    assert EVICTION and ADMISSION


def test_victims_chosen_through_a_shared_index_come_with_their_slots(
        eviction: EvictionPolicy) -> None:
    if not isinstance(eviction, SupportsSharedIndex):
        pytest.skip(f"{eviction.name} cannot track ids in a shared index (SupportsSharedIndex)")
    index = IdIndex()
    eviction.share_index(index)
    ids = np.random.default_rng(3).permutation(np.arange(100, 160, dtype=np.int64))
    slots, _ = index.add(ids)  # the backend adds first, then the tier tells the policy
    eviction.record_insert_slots(ids, slots, 0)
    eviction.record_access_slots(slots[::4], 1)
    victims, victim_slots = eviction.choose_victim_slots(25, 2)
    assert len(victims) == 25 and len(np.unique(victims)) == 25
    assert np.isin(victims, ids).all()
    assert (index.find(victims) == victim_slots).all()
    assert len(eviction) == 35
    index.remove(victims)  # the backend frees the slots only after the policy let go
    fresh = np.arange(500, 510, dtype=np.int64)
    fresh_slots, _ = index.add(fresh)  # into freed slots
    eviction.record_insert_slots(fresh, fresh_slots, 3)
    rest, rest_slots = eviction.choose_victim_slots(100, 4)
    assert set(rest.tolist()) == (set(ids.tolist()) - set(victims.tolist())) | set(fresh.tolist())
    assert (index.find(rest) == rest_slots).all()
    assert len(eviction) == 0


@pytest.mark.parametrize("name", EVICTION + ADMISSION)
@pytest.mark.parametrize("seed", [-1, 1.5, True, "7"])
def test_a_bad_seed_is_a_config_error(name: str, seed: object) -> None:
    with pytest.raises(ConfigError, match="seed"):
        registry.load_policy(name)(seed=seed)


@pytest.mark.parametrize(("name", "setting", "value"), [
    ("frequency", "threshold", 1.5), ("frequency", "depth", float("nan")),
    ("frequency", "width", True), ("frequency", "width", 1 << 62),
    ("frequency", "reset_after", 0.5), ("second_hit", "capacity", 1.5),
    ("second_hit", "capacity", 10**15), ("s3fifo", "move_to_main_threshold", 1.5),
    ("lfu", "history_width", float("inf")),
])
def test_whole_number_settings_refuse_fractions_bools_and_huge_values(
        name: str, setting: str, value: object) -> None:
    with pytest.raises(ConfigError, match=setting):
        registry.load_policy(name)(**{setting: value})


@pytest.mark.parametrize(("name", "setting", "value"), [
    ("lfu", "aging_period", 5e-324), ("lfu", "aging_period", 1e-7),
    ("lfu", "aging_period", True), ("lfu", "aging_period", float("inf")),
    ("lfu", "aging_period", "10"), ("lfu", "aging_factor", True),
    ("lfu", "aging_factor", float("nan")), ("s3fifo", "ghost_ratio", float("inf")),
    ("s3fifo", "ghost_ratio", True), ("s3fifo", "small_ratio", "0.1"),
    ("probability", "p", True), ("probability", "p", False), ("probability", "p", "0.5"),
    ("ttl", "ttl", True), ("ttl", "ttl", float("inf")), ("second_hit", "fp_rate", False),
    ("wtinylfu", "protected_share", True), ("wtinylfu", "sketch_factor", float("inf")),
    ("wtinylfu", "sample_factor", float("inf")), ("wtinylfu", "step", "0.1"),
])
def test_real_number_settings_refuse_bools_strings_and_non_finite_values(
        name: str, setting: str, value: object) -> None:
    # True is an int to Python (1), and an infinite ratio or a period of 5e-324 only failed
    # later, with an OverflowError on every call of the tier
    with pytest.raises(ConfigError, match=f"{setting} must be a finite number in "):
        registry.load_policy(name)(**{setting: value})


def test_the_shortest_lfu_aging_period_ages_at_any_clock_without_overflow() -> None:
    lfu = registry.load_policy("lfu")(aging_period=1e-6, history_width=None)
    ids = ids_of(1, 2, 3)
    lfu.record_insert(ids, 0)
    for now in (1, 2**40, 2**63 - 1):  # the tier's clock is an int64 batch counter
        lfu.record_access(ids_of(1), now)
    assert len(lfu.choose_victims(1, 2**63 - 1)) == 1


def test_s3fifo_with_a_huge_finite_ghost_ratio_evicts() -> None:
    s3 = registry.load_policy("s3fifo")(ghost_ratio=1e300)
    s3.record_insert(np.arange(10, dtype=np.int64), 0)
    assert len(s3.choose_victims(3, 1)) == 3


def test_a_store_whose_manifest_holds_a_whole_float_setting_still_opens(tmp_path) -> None:
    # manifests keep settings as given; one written as 2.0 before settings were checked as
    # whole numbers must still open (and the setting reads as the int)
    import embstore

    tiers = [embstore.TierSpec("dram", capacity=8, eviction="lru"),
             embstore.TierSpec("lmdb", admission="frequency",
                               admission_options={"threshold": 2})]
    with embstore.open(tmp_path / "s", tables=[embstore.TableSpec("t", dim=2)],
                       tiers=tiers) as store:
        store.update("t", np.arange(4), np.ones((4, 2), np.float32))
        store.flush()
        before = store.lookup("t", np.arange(4))
    from embstore.manifest import read_manifest, write_manifest

    doc = read_manifest(tmp_path / "s")  # as the earlier code wrote it
    doc["tiers"][1]["admission_options"]["threshold"] = 2.0
    write_manifest(tmp_path / "s", doc)
    assert '"threshold": 2.0' in (tmp_path / "s" / "MANIFEST.json").read_text()
    assert registry.load_policy("frequency")(threshold=2.0).config()["threshold"] == 2
    with embstore.open(tmp_path / "s", read_only=True) as store:
        np.testing.assert_array_equal(store.lookup("t", np.arange(4)), before)
