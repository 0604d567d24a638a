"""`embstore profile`: per-table figures, LRU curves against the simulator, SHARDS error, files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embstore
from embstore._access_log import sample_mask
from embstore.errors import ConfigError
from embstore.placement import load_document
from embstore.tools._mrc import (
    LRU_CURVE_ERROR_BOUND,
    MIN_SAMPLED_IDS,
    SHARDS_ERROR_BOUND,
    capacity_grid,
    lru_curve,
    policy_curve,
    sample_trace,
)
from embstore.tools.cli import main
from embstore.tools.profile import build_profile, load_tables, save_tables
from embstore.tools.simulator import Trace


@pytest.fixture(scope="module")
def tables() -> dict[str, list[np.ndarray]]:
    return load_tables("synth:seed=1,batches=96,lookups=4096")


def test_lru_curve_from_stack_distances_matches_the_simulator(
        tables: dict[str, list[np.ndarray]]) -> None:
    checked = 0
    for batches in tables.values():
        trace = Trace(batches)
        caps = capacity_grid(trace.distinct, 10)
        caps = caps[caps >= 2 * trace.lookups / len(trace.batches)]
        if not len(caps):
            continue
        exact = lru_curve(trace, caps)
        replay = policy_curve(trace, "lru", caps.tolist())
        assert np.abs(exact - replay).max() <= LRU_CURVE_ERROR_BOUND
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("sets, width", [(3, 20), (5, 7), (4, 64)])
def test_lru_curve_of_a_loop_over_a_working_set_is_the_simulators(sets: int,
                                                                   width: int) -> None:
    # every id of a batch comes back together: they held ranks 0..width-1 in LRU's order,
    # and giving each the batch's mean rank had them all hit or all miss (at 52 ids of a
    # loop over 3 x 20: 5% misses against 43%)
    trace = Trace([np.arange(width) + (i % sets) * width for i in range(30 * sets)])
    caps = np.arange(2 * width, sets * width + 1)
    np.testing.assert_allclose(lru_curve(trace, caps),
                               policy_curve(trace, "lru", caps.tolist()), atol=1e-12)


def test_shards_curve_is_within_its_stated_bound_of_the_exact_one() -> None:
    big = load_tables("synth:seed=2,batches=160,lookups=8192")
    checked = 0
    for rate in (0.1, 0.2):
        for batches in big.values():
            trace = Trace(batches)
            if sample_trace(trace, rate).distinct < MIN_SAMPLED_IDS:
                continue
            caps = capacity_grid(trace.distinct, 12)
            err = np.abs(lru_curve(trace, caps, rate) - lru_curve(trace, caps)).max()
            assert err <= SHARDS_ERROR_BOUND, (rate, trace.distinct, err)
            checked += 1
    assert checked >= 2


def test_profile_figures_per_table(tables: dict[str, list[np.ndarray]]) -> None:
    profile = build_profile(tables, policies=["clock"], row_bytes="100,t00=400",
                            samples_per_batch=4, points=6)
    doc = load_document(profile, "profile")
    t0 = doc["tables"]["t00"]
    ids = np.concatenate(tables["t00"])
    assert t0["rows_touched"] == len(np.unique(ids))
    assert t0["lookups_per_sample"] == pytest.approx(len(ids) / 96 / 4)
    assert t0["bytes_per_sample"] == pytest.approx(t0["lookups_per_sample"] * 400)
    assert doc["tables"]["t01"]["row_bytes"] == 100
    mrc = t0["mrc"]
    assert mrc["capacities"][-1] == t0["rows_touched"]
    for curve in (mrc["lru"], mrc["clock"]):
        assert all(a >= b - 1e-9 for a, b in zip(curve, curve[1:], strict=False))
    assert sum(t0["reuse"]["lookups"]) + t0["reuse"]["cold"] == pytest.approx(1.0)


def test_per_table_npz_round_trips_and_bad_ones_are_refused(tmp_path: Path) -> None:
    tables = {"user": [np.array([1, 2, 2]), np.array([3])],
              "item": [np.array([7]), np.array([], np.int64)]}
    save_tables(tmp_path / "t.npz", tables)
    back = load_tables(str(tmp_path / "t.npz"))
    assert sorted(back) == ["item", "user"]
    assert [b.tolist() for b in back["user"]] == [[1, 2, 2], [3]]
    np.savez(tmp_path / "bad.npz", **{"user.ids": np.arange(3), "user.offsets": np.array([0, 5])})
    with pytest.raises(ConfigError, match="offsets rising"):
        load_tables(str(tmp_path / "bad.npz"))
    # a table with offsets and no ids was left out of the profile, unsaid
    np.savez(tmp_path / "half.npz", **{"user.ids": np.arange(3), "user.offsets": np.array([0, 3]),
                                       "item.offsets": np.array([0, 2])})
    with pytest.raises(ConfigError, match="'item' has offsets but no 'item.ids'"):
        load_tables(str(tmp_path / "half.npz"))
    # an .npz is read as one whatever its name: per-table arrays were refused as a simulator
    # trace's missing 'ids' and 'offsets'
    (tmp_path / "t.npz").rename(tmp_path / "trace")
    assert [b.tolist() for b in load_tables(str(tmp_path / "trace"))["user"]] == [[1, 2, 2], [3]]
    with pytest.raises(ConfigError, match="nosuch"):
        build_profile(tables, policies=["nosuch"])


def test_profile_command_writes_json_and_a_plot(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "p.json", tmp_path / "mrc.png"
    assert main(["profile", "synth:seed=3,batches=20,lookups=1024", "-o", str(out),
                 "--plot", str(png), "--policies", "clock", "--points", "5"]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "embstore.profile" and doc["policies"] == ["lru", "clock"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "t00" in capsys.readouterr().out
    assert main(["profile", str(tmp_path / "missing.npy"), "-o", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["clock", "lru", "wtinylfu", "wtinylfu:hold_new=1"])
def test_training_step_replay_equals_a_real_tiers_hits(
        tables: dict[str, list[np.ndarray]], policy: str, tmp_path: Path) -> None:
    import embstore
    from embstore.tools.simulator import parse_policy

    batches = [np.unique(b) for b in tables["t02"][:40]]
    trace = Trace(batches)
    capacity = 2 * round(trace.lookups / len(batches))
    predicted = 1 - policy_curve(trace, policy, [capacity], warmup=10, step_calls=3)[0]
    options = parse_policy(policy, "eviction").config()
    options.pop("seed")
    chain = (embstore.TierSpec("dram", capacity=capacity, eviction=policy.split(":")[0],
                               eviction_options=options), embstore.TierSpec("pmem"))
    spec = embstore.TableSpec("t", dim=4, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1),
                              tiers=chain)
    every = np.unique(np.concatenate(batches))
    with embstore.open(tmp_path / "s", tables=[spec]) as store:  # every row stored below
        store.update("t", every, np.zeros((len(every), 4), np.float32))
    hits = asked = 0
    with embstore.open(tmp_path / "s") as store:  # the cache starts empty
        for b, ids in enumerate(batches):
            before = store.tier_statistics("t")[0]
            store.lookup("t", ids)
            after = store.tier_statistics("t")[0]
            if b >= 10:
                hits += after.hits - before.hits
                asked += after.lookups - before.lookups
            store.apply_gradients("t", ids, np.ones((len(ids), 4), np.float32))
    assert hits / asked == pytest.approx(predicted, abs=1e-9)


# -- input validation: bad -o and --plot are refused before any work, and nothing is written --

SMALL = "synth:seed=3,batches=20,lookups=1024"


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make profiling itself fail: a refusal must come before it."""
    import embstore.tools.profile as profile_tool

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled before checking the flags")

    monkeypatch.setattr(profile_tool, "build_profile", boom)


def _profile_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run `profile` expecting exit 2 and one error line; nothing new or changed in tmp_path."""
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["profile", *args, "--policies", "clock", "--points", "5"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "internal error" not in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    return err


@pytest.mark.parametrize(("output", "message"), [
    ("trace.npz", "is also an input"), ("link.npz", "is also an input"), ("", "-o is empty"),
    ("d", "is a directory"), ("nodir/p.json", "nodir' does not exist")])
def test_profile_refuses_an_output_that_is_its_trace_or_no_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None, output: str,
        message: str) -> None:
    save_tables(tmp_path / "trace.npz", {"user": [np.array([1, 2]), np.array([3])]})
    (tmp_path / "link.npz").symlink_to(tmp_path / "trace.npz")
    (tmp_path / "d").mkdir()
    target = str(tmp_path / output) if output else ""
    assert message in _profile_fails(tmp_path, capsys, str(tmp_path / "trace.npz"), "-o",
                                     target)


@pytest.mark.parametrize("flag", ["-o", "--plot"])
@pytest.mark.parametrize("name", ["t.ids", "ACCESS_LOG.json", "sub/new.svg"])
def test_profile_refuses_an_output_inside_the_access_log_it_reads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None, flag: str,
        name: str) -> None:
    # -o log/t.ids replaced the log's own file with the profile, and any new file there joined
    # the log, which its reader and recorder then refused as damaged
    log = tmp_path / "log"
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=2)],
                       record_accesses=log) as store:
        store.lookup("t", np.array([1, 2, 3]))
    (log / "sub").mkdir()
    (tmp_path / "link").symlink_to(log)
    for trace in (log, tmp_path / "link"):
        out = ["-o", str(log / name)] if flag == "-o" else [
            "-o", str(tmp_path / "p.json"), "--plot", str((log / name).with_suffix(".svg"))]
        assert "lies inside the" in _profile_fails(tmp_path, capsys, str(trace), *out)


@pytest.mark.parametrize(("plot", "message"), [
    ("mrc.txt", "matplotlib cannot draw a .txt file; end the name in .png, .pdf or .svg"),
    ("mrc", "a file without an extension"), ("nodir/mrc.png", "nodir' does not exist"),
    ("d", "is a directory"), ("p.json", "is also -o")])
def test_a_bad_plot_path_is_refused_before_the_work_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None, plot: str,
        message: str) -> None:
    (tmp_path / "d").mkdir()
    if plot == "p.json":
        plot = "p.svg"  # a drawable name that is the output too (a link to it)
        (tmp_path / "p.svg").symlink_to(tmp_path / "p.json")
    err = _profile_fails(tmp_path, capsys, SMALL, "-o", str(tmp_path / "p.json"), "--plot",
                         str(tmp_path / plot))
    assert message in err, err
    assert not (tmp_path / "p.json").exists()


def test_profile_without_matplotlib_says_so_before_the_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    err = _profile_fails(tmp_path, capsys, SMALL, "-o", str(tmp_path / "p.json"), "--plot",
                         str(tmp_path / "mrc.png"))
    assert "--plot needs matplotlib" in err


def test_a_plot_in_another_format_is_drawn_in_it(tmp_path: Path) -> None:
    out, svg = tmp_path / "p.json", tmp_path / "MRC.SVG"
    assert main(["profile", SMALL, "-o", str(out), "--plot", str(svg), "--policies", "clock",
                 "--points", "5"]) == 0
    assert b"<svg" in svg.read_bytes()[:500]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["MRC.SVG", "p.json"]


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--step-calls", "0", "argument --step-calls: '0' must be at least 1"),
    ("--step-calls", "-2", "argument --step-calls: '-2' must be at least 1"),
    ("--samples-per-batch", "0", "argument --samples-per-batch: '0' must be at least 1"),
    ("--seed", "-1", "argument --seed: '-1' must be at least 0"),
    # blamed on the policy spec 'lru' that it reached
    ("--seed", str(2**64), f"--seed {2**64}: the seed must be an integer >= 0 and < 2**63"),
    ("--points", "1", "--points 1: capacities per curve must be an integer >= 2"),
    ("--warmup", "1", "--warmup 1.0: the share of batches that only warm the caches must be "
                      "in [0, 1)"),
    ("--warmup", "nan", "--warmup nan:"),
    ("--sample-rate", "0", "--sample-rate 0.0: the SHARDS rate must be in [2**-24, 1]"),
    ("--sample-rate", "1e-9", "--sample-rate 1e-09: the SHARDS rate must be in"),
    # huge ones: --points filled memory with capacities, --step-calls looped for ever, the
    # others overflowed a float (an internal error)
    ("--points", "100000000", "--points 100000000: capacities per curve must be an "
                              "integer >= 2 and <= 1000"),
    ("--step-calls", "10000000000", "--step-calls 10000000000: tier calls per batch must "
                                    "be an integer >= 1 and <= 1000"),
    ("--samples-per-batch", "1" + "0" * 40, "training samples per batch must be an integer "
                                            ">= 1 and <= 2**53")])
def test_a_setting_out_of_range_names_its_flag_and_range_before_the_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None, flag: str,
        value: str, message: str) -> None:
    # not _profile_fails: its own --points 5 would come after the flag and win
    assert main(["profile", SMALL, "-o", str(tmp_path / "p.json"), flag, value]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.json").exists()


def test_build_profile_names_the_setting_out_of_range(
        tables: dict[str, list[np.ndarray]]) -> None:
    with pytest.raises(ConfigError, match=r"--step-calls 0: .*integer >= 1"):
        build_profile(tables, step_calls=0)
    with pytest.raises(ConfigError, match=r"--seed -1: .*integer >= 0"):
        build_profile(tables, seed=-1)


def test_a_directory_that_is_no_access_log_is_refused_in_our_words(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    err = _profile_fails(tmp_path, capsys, str(tmp_path / "empty"), "-o",
                         str(tmp_path / "p.json"))
    assert "is a directory but no access log (no ACCESS_LOG.json)" in err
    assert "Errno" not in err
    lost = tmp_path / "lost"
    lost.mkdir()
    for name in ("user.ids", "user.offsets"):
        (lost / name).write_bytes(np.zeros(1, "<i8").tobytes())
    err = _profile_fails(tmp_path, capsys, str(lost), "-o", str(tmp_path / "p.json"))
    assert "holds the files of access log tables (user) but no ACCESS_LOG.json" in err


@pytest.mark.parametrize(("row_bytes", "says"), [("260,a=5,a=6", "gives table 'a' twice"),
                                                ("260,516", "gives the default twice")])
def test_row_bytes_given_twice_are_refused(row_bytes: str, says: str) -> None:
    # the last one won, unsaid
    with pytest.raises(ConfigError, match=says):
        build_profile({"a": [np.arange(4)]}, row_bytes=row_bytes)


def test_a_huge_row_size_is_refused_not_overflowed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # bytes_per_sample overflowed a float: an internal error
    err = _profile_fails(tmp_path, capsys, SMALL, "-o", str(tmp_path / "p.json"),
                         "--row-bytes", "1" + "0" * 40)
    assert "a row of more than 2**53 bytes" in err


def test_a_per_table_trace_whose_tables_hold_no_ids_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it wrote a profile of no table (exit 0), which plan then refused
    save_tables(tmp_path / "t.npz", {"user": [np.zeros(0, np.int64)] * 2,
                                     "item": [np.zeros(0, np.int64)] * 2})
    err = _profile_fails(tmp_path, capsys, str(tmp_path / "t.npz"), "-o",
                         str(tmp_path / "p.json"))
    assert "holds no ids in any table" in err
    with pytest.raises(ConfigError, match="holds no ids in any table"):
        build_profile({"user": [np.zeros(0, np.int64)]})


def test_a_sample_rate_that_keeps_too_few_ids_claims_no_error_bound(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --sample-rate 0.01 kept a few dozen ids of a table yet claimed the tested bound (0.03)
    # for curves more than 0.1 off the exact ones
    few = {"t": [np.arange(1000) + 500 * (b % 4) for b in range(8)]}
    t = build_profile(few, policies=[], sample_rate=0.01, points=4)["tables"]["t"]
    assert t["method"] == "shards" and t["error_bound"] is None
    many = {"t": [np.arange(20_000) + 5000 * (b % 4) for b in range(4)]}
    t = build_profile(many, policies=[], sample_rate=0.1, points=4)["tables"]["t"]
    assert t["error_bound"] == SHARDS_ERROR_BOUND
    save_tables(tmp_path / "few.npz", few)
    assert main(["profile", str(tmp_path / "few.npz"), "-o", str(tmp_path / "p.json"),
                 "--sample-rate", "0.01", "--policies", "clock", "--points", "4"]) == 0
    out = capsys.readouterr().out
    assert "shards!" in out and "give a higher --sample-rate" in out, out


def test_a_sample_rate_that_keeps_no_id_of_a_table_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # every curve was 0 (no lookup counted, none missed), and plan read it as a perfect cache
    tables = {"t": [np.arange(200) + 50 * b for b in range(6)]}
    with pytest.raises(ConfigError, match="'t': sampling at 1e-05 keeps none of its 450 ids"):
        build_profile(tables, policies=[], sample_rate=1e-5, points=4)
    save_tables(tmp_path / "t.npz", tables)
    err = _profile_fails(tmp_path, capsys, str(tmp_path / "t.npz"), "-o",
                         str(tmp_path / "p.json"), "--sample-rate", "1e-5")
    assert "keeps none of its 450 ids" in err
    # ids kept, but only in the batches the warm-up leaves out: all curves were 0 as well
    kept = np.flatnonzero(sample_mask(np.arange(10_000), 0.01))[:3]
    warm = {"t": [kept, kept + 0] + [np.arange(5000, 5100) + 100 * b for b in range(6)]}
    warm["t"][2:] = [b[~sample_mask(b, 0.01)] for b in warm["t"][2:]]
    with pytest.raises(ConfigError, match="keeps none of its .* ids after its first 2 batches"):
        build_profile(warm, policies=[], sample_rate=0.01, warmup=0.25, points=4)


def test_a_table_with_no_ids_after_the_warmup_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # its curves were all 0 (no lookup counted, none missed): a one-row cache looked perfect
    empty = np.zeros(0, np.int64)
    tables = {"a": [np.arange(100) + 10 * b for b in range(5)] + [empty] * 5,
              "b": [np.arange(100) + 10 * b for b in range(10)]}
    with pytest.raises(ConfigError, match=r"table 'a' has no ids after its first 5 batches"):
        build_profile(tables, policies=["clock"], warmup=0.5, points=4)
    t = build_profile(tables, policies=["clock"], warmup=0.4, points=4)["tables"]["a"]
    assert min(t["mrc"]["lru"]) > 0
    save_tables(tmp_path / "t.npz", tables)
    err = _profile_fails(tmp_path, capsys, str(tmp_path / "t.npz"), "-o",
                         str(tmp_path / "p.json"), "--warmup", "0.5")
    assert "lower --warmup" in err


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: np.savez(p / "t.npz", **{"a/b.ids": np.arange(4), "a/b.offsets": [0, 2, 4]}),
     "names table 'a/b': a table name is 1-128 letters"),
    (lambda p: np.save(p / "t.npy", np.array([[1, -1], [2, 3]])),
     "holds id -1: a trace of all tables together keeps each id's table in its bits above"),
    (lambda p: np.save(p / "t.npy", np.full((2, 2), 2**64 - 1, np.uint64)),
     "holds id 18446744073709551615, past the largest int64 id"),
    (lambda p: np.savez(p / "t.npz", **{"u.ids": np.full(2, 2**63, np.uint64),
                                        "u.offsets": [0, 2]}),
     "table 'u', holds id 9223372036854775808, past the largest int64 id")])
def test_table_names_a_store_refuses_and_ids_past_int64_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None,
        make: Any, says: str) -> None:
    # "a/b" made a profile a store cannot open, and negative or uint64 ids a table "t-1"
    make(tmp_path)
    trace = next(p for p in tmp_path.iterdir() if p.name.startswith("t."))
    err = _profile_fails(tmp_path, capsys, str(trace), "-o", str(tmp_path / "p.json"))
    assert says in err, err


def test_build_profile_and_an_access_log_check_table_names(tmp_path: Path) -> None:
    import embstore
    from embstore.errors import CorruptStoreError
    from embstore.tools.profile import read_trace

    with pytest.raises(ConfigError, match="names table '../x'"):
        build_profile({"../x": [np.arange(4)]})
    log = tmp_path / "log"
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=2)],
                       record_accesses=log) as store:
        store.lookup("t", np.arange(4))
    header = json.loads((log / "ACCESS_LOG.json").read_text())
    header["tables"]["t/../t"] = header["tables"].pop("t")  # it starts like a table name
    (log / "ACCESS_LOG.json").write_text(json.dumps(header))
    with pytest.raises(CorruptStoreError, match="lists 't/../t', which is not a table name"):
        read_trace(str(log))


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("flags", [["-o", "/proc/p.json"],
                                   ["-o", "p.json", "--plot", "/proc/x.png"]])
def test_outputs_that_cannot_be_written_are_said_of_the_path_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    # the message named the private temporary file ('/proc/p.json.tmp') in OSError's words
    flags = [f if f.startswith(("-", "/")) else str(tmp_path / f) for f in flags]
    err = _profile_fails(tmp_path, capsys, SMALL, *flags)
    path = flags[-1]
    assert f"{path!r}: cannot write it: No such file or directory" in err or \
        f"cannot write {path!r}: No such file or directory" in err, err
    assert ".tmp" not in err and "Errno" not in err
