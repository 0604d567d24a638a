"""The trace simulator: Belady's MIN is exact and an upper bound, references, trace loading, CLI."""

from __future__ import annotations

import itertools
import json
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from embstore import registry
from embstore.errors import ConfigError
from embstore.tools.cli import main
from embstore.tools.simulator import (
    Trace,
    belady,
    infinite,
    load_trace,
    parse_capacities,
    parse_policy,
    run_policies,
    simulate_trace,
)


def random_trace(seed: int, batches: int = 30, width: int = 12, ids: int = 40) -> Trace:
    rng = np.random.default_rng(seed)
    # a skewed draw so that caching matters; batch widths vary, empty batches included
    weights = 1.0 / np.arange(1, ids + 1)
    weights /= weights.sum()
    return Trace([rng.choice(ids, size=rng.integers(0, width + 1), p=weights) * 7 - 50
                  for _ in range(batches)])


def brute_force_min_misses(batches: list[list[int]], capacity: int) -> int:
    """Fewest misses over every cache content the batched model allows, by exhaustive DP."""
    states = {frozenset(): 0}  # cache content -> fewest misses so far
    for batch in batches:
        touched = set(batch)
        nxt: dict[frozenset[int], int] = {}
        for cache, misses in states.items():
            misses += len(touched - cache)
            pool = sorted(cache | touched)
            for k in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    key = frozenset(keep)
                    if nxt.get(key, 1 << 30) > misses:
                        nxt[key] = misses
        states = nxt
    return min(states.values())


@pytest.mark.parametrize("seed", range(12))
def test_belady_matches_brute_force_on_tiny_traces(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, 5, size=rng.integers(0, 4)).tolist() for _ in range(6)]
    for capacity in (1, 2, 3):
        result = belady(Trace([np.array(b, dtype=np.int64) for b in batches]), capacity)
        assert result.misses == brute_force_min_misses(batches, capacity), (batches, capacity)


@pytest.mark.parametrize("eviction", registry.policy_names("eviction"))
def test_belady_beats_every_policy_pair_on_random_traces(eviction: str) -> None:
    for seed in range(3):
        trace = random_trace(seed)
        for capacity in (3, 10):
            best = belady(trace, capacity)
            for admission in registry.policy_names("admission"):
                result = run_policies(trace, parse_policy(eviction, "eviction", seed),
                                      parse_policy(admission, "admission", seed), capacity)
                assert result.misses >= best.misses, (eviction, admission, seed, capacity)
                assert result.hit_ratio <= best.hit_ratio


def test_infinite_cache_misses_each_id_once() -> None:
    trace = random_trace(5)
    result = infinite(trace)
    assert result.misses == trace.distinct
    assert result.hit_ratio == pytest.approx(1 - trace.distinct / trace.lookups)
    # a cache that holds everything does as well as the infinite one, whatever the policy
    assert belady(trace, trace.distinct).misses == trace.distinct
    lru = run_policies(trace, parse_policy("lru", "eviction"),
                       parse_policy("always", "admission"), trace.distinct)
    assert lru.misses == trace.distinct


def test_lru_replay_counts_misses_per_distinct_id_per_batch() -> None:
    # capacity 2: [1 1 2] -> 2 misses; [3] -> miss, evicts 1; [1 2] -> 1 misses, 2 hits,
    # then 3 is evicted; [3 3 3] -> 1 miss
    trace = Trace([np.array(b) for b in ([1, 1, 2], [3], [1, 2], [3, 3, 3])])
    result = run_policies(trace, parse_policy("lru", "eviction"),
                          parse_policy("always", "admission"), 2)
    assert (result.accesses, result.lookups, result.misses) == (9, 6, 5)
    assert result.miss_ratio == pytest.approx(5 / 6)
    assert belady(trace, 2).misses == 4  # keep 3 out after batch 1: [1 2] both hit


def test_parse_capacities_takes_fractions_and_counts() -> None:
    assert parse_capacities("0.01,0.5,3", 1000) == [10, 500, 3]
    assert parse_capacities([0.0006], 1000) == [1]  # 0.6 ids round to one
    # a fraction of a small trace is at least one id, so the default fractions run on any
    # trace (the report shows the count)
    assert parse_capacities("0.01,0.05", 30) == [1, 2]
    with pytest.raises(ConfigError, match="must be > 0"):
        parse_capacities("0,0.1", 1000)


def test_parse_policy_reads_settings_and_checks_the_family() -> None:
    lfu = parse_policy("lfu:aging_period=None:history_width=1024", "eviction", seed=3)
    assert lfu.config() == {"aging_period": None, "aging_factor": 0.5,
                            "history_width": 1024, "seed": 3}
    with pytest.raises(ConfigError, match="admission policy"):
        parse_policy("frequency", "eviction")
    with pytest.raises(ConfigError, match="threshold"):
        parse_policy("frequency:threshold=0", "admission")


def test_load_trace_reads_npy_npz_and_synth(tmp_path: Path) -> None:
    ids = np.arange(10, dtype=np.int64)
    np.save(tmp_path / "flat.npy", ids)
    np.save(tmp_path / "rows.npy", ids.reshape(2, 5))
    np.savez(tmp_path / "var.npz", ids=ids, offsets=np.array([0, 3, 3, 10]))
    assert [len(b) for b in load_trace(str(tmp_path / "flat.npy"), batch_size=4).batches] \
        == [4, 4, 2]
    assert [len(b) for b in load_trace(str(tmp_path / "rows.npy")).batches] == [5, 5]
    assert [len(b) for b in load_trace(str(tmp_path / "var.npz")).batches] == [3, 0, 7]
    synth = load_trace("synth:seed=2,batches=3,lookups=1000,profile=2022")
    assert [len(b) for b in synth.batches] == [1000] * 3
    np.save(tmp_path / "floats.npy", np.zeros(3))
    with pytest.raises(ConfigError, match="integer ids"):
        load_trace(str(tmp_path / "floats.npy"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_trace(str(tmp_path / "missing.npy"))
    with pytest.raises(ConfigError, match="synthesize"):
        load_trace("synth:nonsense=1")


def test_simulate_report_compares_every_pair_with_belady() -> None:
    trace = random_trace(9, batches=60)
    report = simulate_trace(trace, ["lru", "fifo"], ["always", "second_hit"], [0.2, 5])
    assert [c["capacity"] for c in report["capacities"]] == [round(0.2 * trace.distinct), 5]
    for cap in report["capacities"]:
        assert len(cap["policies"]) == 4
        for row in cap["policies"]:
            assert row["miss_vs_belady"] >= 1.0
            assert row["misses"] == pytest.approx(row["miss_vs_belady"] * cap["belady"]["misses"])


def test_cli_simulate_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.npy"
    assert main(["trace", "synth", str(out), "--batches", "4", "--batch-size", "2000",
                 "--seed", "3"]) == 0
    assert np.load(out).shape == (4, 2000)
    capsys.readouterr()
    assert main(["simulate", str(out), "--policy", "lru,s3fifo", "--admission",
                 "always,frequency", "--capacity", "0.05,100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["batches"] == 4 and len(report["capacities"]) == 2
    assert main(["simulate", str(out), "--policy", "lru"]) == 0
    assert "belady (MIN)" in capsys.readouterr().out
    assert main(["trace", "stats", str(out)]) == 0
    assert "(32768+" in capsys.readouterr().out
    assert main(["simulate", str(out), "--policy", "nosuch"]) == 2


def test_frequency_beats_recency_on_the_calibrated_trace() -> None:
    # the synthetic popularity is stationary and skewed, so LFU (with its count history) must
    # miss less than LRU; Belady bounds both
    trace = load_trace("synth:seed=3,batches=96,lookups=4096,profile=2021")
    capacity = parse_capacities("0.05", trace.distinct)[0]
    always = "always"
    lfu = run_policies(trace, parse_policy("lfu", "eviction"),
                       parse_policy(always, "admission"), capacity)
    lru = run_policies(trace, parse_policy("lru", "eviction"),
                       parse_policy(always, "admission"), capacity)
    best = belady(trace, capacity)
    assert best.misses < lfu.misses < lru.misses


def _zipf_trace(seed: int, batches: int = 40, width: int = 64, ids: int = 300) -> Trace:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, ids + 1) ** 1.1
    weights /= weights.sum()
    return Trace([rng.choice(ids, size=rng.integers(0, width + 1), p=weights) * 3 + 1
                  for _ in range(batches)])


@pytest.mark.parametrize("admission", registry.policy_names("admission"))
@pytest.mark.parametrize("eviction", registry.policy_names("eviction"))
def test_the_simulator_counts_what_a_real_bounded_dram_tier_counts(
        tmp_path: Path, eviction: str, admission: str) -> None:
    """Replay one trace through the simulator and through a store whose DRAM tier has the
    same capacity and policies (its store of record holding every id): same hits, same
    misses.
    """
    import embstore
    from embstore import TableSpec, TierSpec

    trace = _zipf_trace(7)
    capacity = 40
    simulated = run_policies(trace, parse_policy(eviction, "eviction"),
                             parse_policy(admission, "admission"), capacity)
    tiers = [TierSpec("dram", capacity=capacity, eviction=eviction, admission=admission),
             TierSpec("dram")]
    with embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=1)], tiers=tiers) as store:
        store.update("t", trace.ids, np.ones((trace.distinct, 1), np.float32))
    with embstore.open(tmp_path / "s") as store:  # caches start empty, policies fresh
        for batch in trace.batches:
            if len(batch):
                store.lookup("t", np.unique(batch))
        top = store.tier_statistics("t")[0]
    assert top.lookups == simulated.lookups == trace.lookups
    assert (top.hits, top.misses) == (simulated.lookups - simulated.misses, simulated.misses)
    assert 0 < simulated.misses < simulated.lookups


def test_policy_specs_read_true_and_false_as_booleans() -> None:
    # "climb=false" once reached the policy as the string "false", which bool() reads as True
    fixed = parse_policy("wtinylfu:climb=false:hold_new=True", "eviction")
    assert fixed.config()["climb"] is False and fixed.config()["hold_new"] is True
    with pytest.raises(ConfigError, match="climb must be true or false"):
        parse_policy("wtinylfu:climb=no", "eviction")


def _bad_trace_files(tmp_path: Path) -> dict[str, Path]:
    """Files that are no trace: each must be refused by name, with no library message."""
    good = tmp_path / "good.npy"
    np.save(good, np.arange(400).reshape(4, 100))
    files = {"empty": b"", "text": b"garbage\n", "truncated npy": good.read_bytes()[:100]}
    out = {}
    for name, raw in files.items():
        out[name] = tmp_path / f"{name.replace(' ', '_')}.npy"
        out[name].write_bytes(raw)
    out["objects"] = tmp_path / "objects.npy"
    np.save(out["objects"], np.array([{}], dtype=object), allow_pickle=True)
    out["float offsets"] = tmp_path / "float_offsets.npz"
    np.savez(out["float offsets"], ids=np.arange(10), offsets=np.array([0.0, 5.0, 10.0]))
    out["truncated npz"] = tmp_path / "truncated.npz"
    out["truncated npz"].write_bytes(out["float offsets"].read_bytes()[:100])
    # offsets that go down, unsigned: np.diff wrapped round and they read as 3 batches
    out["unsigned offsets going down"] = tmp_path / "unsigned.npz"
    np.savez(out["unsigned offsets going down"], ids=np.arange(3),
             offsets=np.array([0, 3, 1, 3], np.uint64))
    return out


@pytest.mark.parametrize("command", [["simulate"], ["trace", "stats"], ["profile"]])
def test_unreadable_trace_files_are_refused_by_name(tmp_path: Path, command: list[str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    for what, file in _bad_trace_files(tmp_path).items():
        extra = ["-o", str(tmp_path / "p.json")] if command == ["profile"] else []
        assert main([*command, str(file), *extra]) == 2, what
        err = capsys.readouterr().err
        assert f"trace {str(file)!r}" in err, (what, err)
        assert "internal error" not in err and "Traceback" not in err, (what, err)
        assert not (tmp_path / "p.json").exists()


def test_a_trace_file_named_like_a_synthetic_spec_is_read_as_a_file(tmp_path: Path) -> None:
    file = tmp_path / "synth_trace.npy"
    np.save(file, np.arange(6).reshape(2, 3))
    assert load_trace(str(file)).distinct == 6  # not the default synthetic trace
    with pytest.raises(ConfigError, match="does not exist"):
        load_trace("synthx:seed=1")


@pytest.mark.parametrize("spec", ["synth:batches=2,lookups=abc", "synth:batches=2,lookups=nan",
                                  "synth:batches=2,seed=-1", "synth:nosuch=1",
                                  "synth:batches=2,lookups=99999999999999999999",
                                  f"synth:batches=2,lookups={2**28 + 1}"])
def test_bad_synthetic_specs_are_config_errors(spec: str) -> None:
    # a huge lookups printed numpy's RuntimeWarning beside a raw "int too large" message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match="trace spec"):
            load_trace(spec)


@pytest.mark.parametrize(("spec", "says"), [
    ("synth:seed=1,seed=2", "seed is given twice"),  # the last one won
    ("synth:batches=2,seed=-1", "seed must be a whole number >= 0, got -1")])
def test_a_synthetic_spec_says_what_is_wrong_in_its_terms(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_trace(spec)


def test_capacities_past_the_distinct_ids_are_the_infinite_cache() -> None:
    # a count far past the trace's ids must not allocate for it (it used to: MemoryError)
    assert parse_capacities([1e10, 5.0], distinct=10) == [10, 5]
    for bad in ([float("nan")], [float("inf")], [0.0], "x,1"):
        with pytest.raises(ConfigError):
            parse_capacities(bad, distinct=10)


def test_trace_stats_refuses_a_trace_without_ids_and_empty_production_stats(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.npy"
    np.save(empty, np.zeros((3, 0), np.int64))
    assert main(["trace", "stats", str(empty)]) == 2
    assert "holds no ids" in capsys.readouterr().err
    good, stats = tmp_path / "good.npy", tmp_path / "stats.txt"
    np.save(good, np.arange(40).reshape(4, 10))
    stats.write_text("\n")
    assert main(["trace", "stats", str(good), "--production", str(stats)]) == 2
    assert "no locality-stats block" in capsys.readouterr().err


def test_trace_synth_names_the_file_it_writes_and_refuses_no_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "synth", str(tmp_path / "t"), "--batches", "2",
                 "--batch-size", "50"]) == 0
    assert f"wrote {tmp_path / 't.npy'}:" in capsys.readouterr().out
    assert np.load(tmp_path / "t.npy").shape == (2, 50)
    for bad in ("", str(tmp_path)):
        assert main(["trace", "synth", bad, "--batches", "1"]) == 2
        assert "OUT.npy" in capsys.readouterr().err
    assert not (tmp_path / "..npy").exists() and not Path(f"{tmp_path}.npy").exists()
    assert main(["simulate", str(tmp_path / "t.npy"), "--seed", "-1"]) == 2
    assert "--seed" in capsys.readouterr().err
    # past int64: it blamed the policy spec 'lru'
    assert main(["simulate", str(tmp_path / "t.npy"), "--seed", str(2**64)]) == 2
    assert "--seed 18446744073709551616: the seed must be" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--policy", ""], ["--policy", ","], ["--admission", ""]])
def test_simulate_refuses_an_empty_list_of_policies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    np.save(tmp_path / "t.npy", np.arange(20).reshape(2, 10))
    assert main(["simulate", str(tmp_path / "t.npy"), *flags]) == 2
    assert f"{flags[0]} names no policy" in capsys.readouterr().err


def test_simulate_refuses_a_trace_without_ids(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # it printed every capacity as a perfect cache (0/0 taken as no miss) and exited 0
    np.save(tmp_path / "empty.npy", np.zeros(0, np.int64))
    np.savez(tmp_path / "empty.npz", ids=np.zeros(0, np.int64), offsets=np.zeros(3, np.int64))
    for trace in (str(tmp_path / "empty.npy"), str(tmp_path / "empty.npz"),
                  "synth:seed=1,batches=0"):
        assert main(["simulate", trace]) == 2
        out, err = capsys.readouterr()
        assert not out and "holds no ids; nothing to simulate" in err, err
        assert len(err.strip().splitlines()) == 1


def _damaged_trace_files(tmp_path: Path) -> list[tuple[Path, str]]:
    """Files whose damage must be said in words, each with what the message must say."""
    header = "{'descr': '<i8', 'fortran_order': False, 'shape': (100000000000, 40), }"
    header += " " * (117 - len(header)) + "\n"
    huge = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
    good = tmp_path / "good.npy"
    np.save(good, np.arange(400).reshape(10, 40))
    raw = good.read_bytes()
    files: list[tuple[str, bytes, str]] = [
        ("huge.npy", huge + b"\0" * 64, "header promises an array of shape (100000000000, 40)"),
        ("version.npy", b"\x93NUMPY\xff\xff" + b"\0" * 100, "bad header: format version 255.255"),
        ("header_cut.npy", raw[:20], "bad or truncated header"),
        ("data_cut.npy", raw[:-7], "3,200 bytes) but 3,193 bytes follow"),
        ("empty.npy", b"", "is empty"),
        ("zip.npz", b"PK\x03\x04" + b"\0" * 100, "not a .npz (zip) archive"),
    ]
    out = []
    for name, data, says in files:
        (tmp_path / name).write_bytes(data)
        out.append((tmp_path / name, says))
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:
        z.writestr("ids.npy", huge + b"\0" * 64)
        z.writestr("offsets.npy", raw)
    out.append((tmp_path / "huge.npz", "member 'ids.npy' is truncated or damaged: its header"))
    (tmp_path / "dir.npz").mkdir()
    out.append((tmp_path / "dir.npz", "is a directory"))
    return out


@pytest.mark.parametrize("command", [["simulate"], ["trace", "stats"], ["profile"]])
def test_damaged_trace_files_are_said_in_words_and_nothing_is_allocated(
        tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # a header claiming 29 TiB was an "internal error: MemoryError"; numpy's and zipfile's
    # own words ("we only support format version", "EOF:", "File is not a zip file", "Errno")
    # reached the user
    for file, says in _damaged_trace_files(tmp_path):
        extra = ["-o", str(tmp_path / "p.json")] if command == ["profile"] else []
        assert main([*command, str(file), *extra]) == 2, file
        err = capsys.readouterr().err
        assert f"trace {str(file)!r}" in err and says in err, err
        assert len(err.strip().splitlines()) == 1 and "internal error" not in err, err
        for words in ("we only support", "EOF", "File is not", "Errno"):
            assert words not in err, err


@pytest.mark.parametrize(("spec", "says"), [
    ("synth:params=1", "unknown key 'params'; known: batches, drift, lookups, profile, seed"),
    ("synth:batches=true", "batches must be a whole number, got 'true'"),
    ("synth:batches=2.0", "batches must be a whole number, got '2.0'"),
    ("synth:lookups=1024.5,batches=1", "lookups must be a whole number"),
    ("synth:drift=true,batches=1", "drift must be a number, got 'true'"),
    ("synth:seed=false,batches=1", "seed must be a whole number, got 'false'"),
    ("synth:batches=99999999999999999999", "more than the 1,073,741,824 (2**30)"),
    (f"synth:batches={2**30 // 4096 + 1},lookups=4096", "more than the 1,073,741,824")])
def test_synthetic_specs_take_known_keys_of_the_right_kind_and_a_bounded_size(
        spec: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    # params=1 was an internal AttributeError, batches=true one batch, and a huge batch
    # count grew memory until the process was killed
    with pytest.raises(ConfigError, match="trace spec") as info:
        load_trace(spec)
    assert says in str(info.value)
    assert main(["simulate", spec]) == 2
    assert says in capsys.readouterr().err


def test_trace_synth_refuses_a_trace_too_large_for_memory_before_drawing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.npy"
    assert main(["trace", "synth", str(out), "--batches", "99999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert "more than the 1,073,741,824 (2**30) a trace may have" in err and "memory" in err
    assert not out.exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_trace_that_cannot_be_written_is_said_of_the_path_given(
        capsys: pytest.CaptureFixture[str]) -> None:
    # /proc takes no new file: the message named '/proc/x.npy' in raw OSError words
    assert main(["trace", "synth", "/proc/x", "--batches", "1", "--batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "cannot write '/proc/x.npy': No such file or directory" in err, err
    assert "Errno" not in err and ".tmp" not in err


@pytest.mark.parametrize(("capacity", "says"), [
    (["--capacity", "1KiB", "--row-bytes", "99999999999"],
     "--capacity of 1024 bytes holds no row of 99999999999 bytes")])
def test_simulate_refuses_a_capacity_that_holds_no_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], capacity: list[str],
        says: str) -> None:
    # it was silently a cache of one id, where --tiers dram:1B is refused
    np.save(tmp_path / "t.npy", np.arange(400))
    assert main(["simulate", str(tmp_path / "t.npy"), *capacity]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_ids_past_int64_are_refused_not_wrapped_around(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "u64.npy", np.full((2, 4), 2**64 - 1, np.uint64))
    np.savez(tmp_path / "u64.npz", ids=np.full(4, 2**63, np.uint64), offsets=np.array([0, 4]))
    for name, big in (("u64.npy", 2**64 - 1), ("u64.npz", 2**63)):
        assert main(["simulate", str(tmp_path / name)]) == 2
        assert f"holds id {big}, past the largest int64 id" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="past the largest int64 id"):
        Trace([np.array([2**63], np.uint64)])
    assert Trace([np.array([5, 2**63 - 1], np.uint64)]).distinct == 2


def test_an_npz_trace_with_a_file_beside_its_arrays_reads_as_np_load_reads_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import zipfile

    path = tmp_path / "t.npz"
    np.savez_compressed(path, ids=np.arange(400) % 50, offsets=np.arange(0, 401, 40))
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("meta.json", "{}")
    assert main(["simulate", str(path)]) == 0  # default capacities on 50 distinct ids
    assert "belady" in capsys.readouterr().out
