"""Access logs: a store records its batches, `embstore profile` reads them as it reads traces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import _crash
from embstore._access_log import read_access_log, sample_mask
from embstore.errors import (
    ConfigError,
    CorruptStoreError,
    InvalidIdsError,
    InvalidValuesError,
    NonFiniteValueError,
    StoreLockedError,
)
from embstore.tools._mrc import (
    MIN_SAMPLED_IDS,
    SHARDS_ERROR_BOUND,
    lru_curve,
    policy_curve,
    sample_trace,
)
from embstore.tools.cli import main
from embstore.tools.profile import build_profile, load_tables, read_trace, save_tables
from embstore.tools.simulator import Trace


def record(log: Path, tables: dict[str, list[np.ndarray]], sample: float = 1.0) -> None:
    """Train every table on its batches (a lookup, then one step of its distinct ids)."""
    specs = [embstore.TableSpec(n, dim=2) for n in tables]
    with embstore.open(None, tables=specs, record_accesses=log, record_sample=sample) as store:
        for b in range(len(next(iter(tables.values())))):
            for name, batches in tables.items():
                store.lookup(name, batches[b])
                unique = np.unique(batches[b])
                store.apply_gradients(name, unique, np.ones((len(unique), 2), np.float32))


def without_name(profile: dict) -> dict:
    return {k: v for k, v in profile.items() if k != "trace"}


def test_an_unsampled_log_profiles_exactly_as_the_trace_as_npz(tmp_path: Path) -> None:
    tables = load_tables("synth:seed=1,batches=40,lookups=2048")
    record(tmp_path / "log", tables)
    save_tables(tmp_path / "trace.npz", tables)
    for source in ("log", "trace.npz"):
        assert main(["profile", str(tmp_path / source), "-o", str(tmp_path / f"{source}.json"),
                     "--points", "6", "--policies", "clock"]) == 0
    from_log = json.loads((tmp_path / "log.json").read_text())
    from_npz = json.loads((tmp_path / "trace.npz.json").read_text())
    assert without_name(from_log) == without_name(from_npz)
    assert set(from_log["tables"]) == set(tables)


@pytest.fixture(scope="module")
def big() -> dict[str, list[np.ndarray]]:
    tables = load_tables("synth:seed=2,batches=160,lookups=8192")
    return {n: tables[n] for n in ("t00", "t01", "t02", "t03")}  # the tables with many ids


def test_a_sampled_log_is_the_sampled_trace_and_its_curves_keep_the_shards_bound(
        tmp_path: Path, big: dict[str, list[np.ndarray]]) -> None:
    rate = 0.25
    record(tmp_path / "log", big, sample=rate)
    logged, rates = read_trace(str(tmp_path / "log"))
    assert rates == dict.fromkeys(big, rate)
    profile = build_profile(logged, policies=[], recorded_rates=rates, points=10)
    for name, batches in big.items():
        full = Trace(batches)
        sub = Trace(logged[name])
        # the log holds exactly what SHARDS keeps of the trace at that rate, batch for batch
        assert [len(b) for b in sub.batches] == [len(b) for b in sample_trace(full, rate).batches]
        assert all(np.array_equal(a, b) for a, b in zip(
            sub.batches, sample_trace(full, rate).batches, strict=True))
        t = profile["tables"][name]
        caps = np.asarray(t["mrc"]["capacities"])
        # so its curves are those of the whole trace sampled at that rate ...
        assert np.array_equal(lru_curve(sub, caps, rate), lru_curve(full, caps, rate))
        assert np.array_equal(policy_curve(sub, "clock", caps[-4:].tolist(), rate),
                              policy_curve(full, "clock", caps[-4:].tolist(), rate))
        # ... within the stated bound of the exact ones, and its counts scale back
        assert t["sampled_ids"] >= MIN_SAMPLED_IDS and t["error_bound"] == SHARDS_ERROR_BOUND
        wide = caps >= 2 * full.lookups / len(full.batches)
        err = np.abs(np.asarray(t["mrc"]["lru"]) - lru_curve(full, caps))[wide].max()
        assert err <= SHARDS_ERROR_BOUND, (name, err)
        assert abs(t["rows_touched"] - full.distinct) <= 0.1 * full.distinct
        assert t["lookups_per_batch"] == pytest.approx(full.accesses / 160, rel=0.1)
        assert t["method"] == "shards" and t["recorded_rate"] == rate


def test_a_table_logged_with_too_few_ids_says_its_curves_have_no_bound(
        tmp_path: Path) -> None:
    tables = {"small": [np.arange(50) + 100 * (b % 3) for b in range(12)]}
    record(tmp_path / "log", tables, sample=0.5)
    logged, rates = read_trace(str(tmp_path / "log"))
    t = build_profile(logged, policies=[], recorded_rates=rates, points=4)["tables"]["small"]
    assert t["sampled_ids"] < MIN_SAMPLED_IDS and t["error_bound"] is None
    with pytest.raises(ConfigError, match="sampled its ids"):
        load_tables(str(tmp_path / "log"))


def test_the_sampling_kernel_keeps_what_the_sketches_hash_keeps(tmp_path: Path) -> None:
    from embstore.policies._hashing import splitmix64

    ids = np.random.default_rng(0).integers(-2**63, 2**63 - 1, 50_000, dtype=np.int64)
    for seed, rate in ((0, 0.3), (0, 2**-24), (5, 0.5), (0, 1.0)):
        want = (splitmix64(ids, seed) >> np.uint64(40)) < np.uint64(int(rate * 2**24))
        assert np.array_equal(sample_mask(ids, rate, seed), want)
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=2)],
                       record_accesses=tmp_path / "log", record_sample=0.3) as store:
        store.lookup("t", ids)
    assert np.array_equal(read_access_log(tmp_path / "log").ids["t"], ids[sample_mask(ids, 0.3)])


def test_a_batch_is_a_lookup_and_its_steps_writes_are_not_logged_again(tmp_path: Path) -> None:
    grads = np.ones((3, 2), np.float32)
    a, b, c = np.array([1, 2, 3]), np.array([4, 5, 6]), np.array([7, 8, 9])
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=2)],
                       record_accesses=tmp_path / "log") as store:
        store.lookup("t", a)                # a training step: lookup, then the update
        store.apply_gradients("t", a, grads)
        store.lookup("t", b)                # a pipeline: the next lookup before this update
        store.lookup("t", c)
        store.apply_gradients("t", b, grads)
        store.apply_gradients("t", c, grads)
        store.update("t", a, grads)         # a write without a lookup is a batch of its own
        store.apply_gradients("t", b, grads)
        store.lookup_state("t", a)          # not a training access
        store.flush()
        log = read_access_log(tmp_path / "log")
        assert [list(x) for x in log.batches("t")] == [[1, 2, 3], [4, 5, 6], [7, 8, 9],
                                                       [1, 2, 3], [4, 5, 6]]


def test_lookups_far_ahead_of_their_writes_are_each_one_batch(tmp_path: Path) -> None:
    # a pipeline 20 batches deep: every write is its lookup's step
    grads = np.ones((2, 2), np.float32)
    batches = [np.array([2 * b, 2 * b + 1]) for b in range(40)]
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=2)],
                       record_accesses=tmp_path / "log") as store:
        for b in range(60):
            if b < 40:
                store.lookup("t", batches[b])
            if b >= 20:
                store.apply_gradients("t", batches[b - 20], grads)
        store.flush()
    assert [x.tolist() for x in read_access_log(tmp_path / "log").batches("t")] == [
        b.tolist() for b in batches]


def test_a_lookup_no_write_follows_keeps_no_later_write_of_other_ids_out_of_the_log(
        tmp_path: Path) -> None:
    # writes were matched to lookups by count: an evaluation's lookup took the next write,
    # whatever its ids, and an empty lookup did too
    grads = np.ones((2, 2), np.float32)
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=2)],
                       record_accesses=tmp_path / "log") as store:
        store.lookup("t", np.array([1, 2]))            # evaluation: no write follows
        store.update("t", np.array([100, 101]), grads)  # a batch of its own
        store.lookup("t", np.array([], np.int64))
        store.apply_gradients("t", np.array([200, 201]), grads)  # and this one
        store.lookup("t", np.array([3, 4, 5]), accessed=np.array([5, 3, 4, 3]))
        store.apply_gradients("t", np.array([4, 3]), grads)  # that step's, in its order
        store.lookup_many({"t": np.array([6, 7])})
        store.apply_gradients_many({"t": (np.array([7, 6]), grads)})
        store.flush()
        log = read_access_log(tmp_path / "log")
        assert [list(x) for x in log.batches("t")] == [
            [1, 2], [100, 101], [], [200, 201], [5, 3, 4, 3], [6, 7]]


@pytest.mark.parametrize(("accessed", "words"), [([1, 2], "must be a mapping"),
                                                  ({"zz": [1]}, "does not look up")])
def test_a_bad_accessed_mapping_is_refused_and_logs_nothing(tmp_path: Path, accessed,
                                                            words) -> None:
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=2)],
                       record_accesses=tmp_path / "log") as store:
        store.lookup("t", np.array([1, 2]))
        with pytest.raises(InvalidValuesError, match=words):
            store.lookup_many({"t": np.array([3])}, accessed=accessed)
        store.flush()
        assert [list(x) for x in read_access_log(tmp_path / "log").batches("t")] == [[1, 2]]
        assert store.tier_statistics("t")[0].lookups == 2


def test_a_lookup_many_refused_for_one_tables_accessed_ids_logs_no_table(
        tmp_path: Path) -> None:
    # the first table's batch was logged before the second table's accessed ids were checked
    specs = [embstore.TableSpec("a", dim=2), embstore.TableSpec("b", dim=2)]
    with embstore.open(None, tables=specs, record_accesses=tmp_path / "log") as store:
        with pytest.raises(InvalidIdsError, match="table 'b'"):
            store.lookup_many({"a": np.array([1, 2]), "b": np.array([3])},
                              accessed={"a": np.array([1, 1, 2]), "b": np.array([1.5])})
        store.lookup_many({"a": np.array([4])})
        store.flush()
        log = read_access_log(tmp_path / "log")
        assert [list(x) for x in log.batches("a")] == [[4]]
        assert log.batches("b") == []
        assert store.tier_statistics("a")[0].lookups == 1


def test_a_write_the_store_refuses_is_not_logged_and_leaves_its_lookup_for_the_retry(
        tmp_path: Path) -> None:
    # a step refused for a non-finite result writes nothing, but it took its lookup's match
    # (the retried step was then logged as a batch of its own) or was logged as a batch
    spec = embstore.TableSpec("t", dim=2, optimizer=embstore.optim.SGD(lr=1.0))
    huge = np.full((2, 2), 3e38, np.float32)
    with embstore.open(None, tables=[spec], record_accesses=tmp_path / "log") as store:
        store.update("t", np.array([1, 2]), huge)           # a batch of its own
        store.lookup("t", np.array([1, 2]))
        for ids in (np.array([1, 2]), np.array([2])):       # the lookup's step, refused
            with pytest.raises(NonFiniteValueError):
                store.apply_gradients("t", ids, -huge[: len(ids)])
        with pytest.raises(NonFiniteValueError):            # no lookup: refused, no batch
            store.apply_gradients_many({"t": (np.array([1]), -huge[:1])})
        store.apply_gradients("t", np.array([2, 1]), np.ones((2, 2), np.float32))  # retried
        store.apply_gradients("t", np.array([9]), np.ones((1, 2), np.float32))  # its own
    log = read_access_log(tmp_path / "log")
    assert [list(x) for x in log.batches("t")] == [[1, 2], [1, 2], [9]]
    assert not log.left_out and not log.lost_batches
    assert (tmp_path / "log" / "t.ids").stat().st_size == 5 * 8
    assert (tmp_path / "log" / "t.offsets").stat().st_size == 4 * 8


def test_the_log_is_private_and_a_reopened_store_appends_to_it(tmp_path: Path) -> None:
    log = tmp_path / "runs" / "log"
    spec = embstore.TableSpec("t", dim=2)
    for start in (0, 10):
        with embstore.open(tmp_path / "store", tables=[spec], record_accesses=log) as store:
            store.lookup("t", np.arange(start, start + 5))
    assert (log.stat().st_mode & 0o777) == 0o700
    assert {f.name: f.stat().st_mode & 0o777 for f in log.iterdir()} == {
        "ACCESS_LOG.json": 0o600, "LOCK": 0o600, "t.ids": 0o600, "t.offsets": 0o600}
    assert [list(b) for b in read_access_log(log).batches("t")] == [
        list(range(5)), list(range(10, 15))]
    with pytest.raises(ConfigError, match="rate"):
        embstore.open(tmp_path / "store", record_accesses=log, record_sample=0.5)
    with embstore.open(tmp_path / "store", record_accesses=log), pytest.raises(
            StoreLockedError, match="another store"):
        embstore.open(None, tables=[spec], record_accesses=log)


CHILD = """
import sys, numpy as np, embstore
store = embstore.open(None, tables=[embstore.TableSpec("t", dim=2)],
                      record_accesses=sys.argv[1], record_sample=float(sys.argv[2]))
for b in range(100):
    store.lookup("t", np.arange(b, b + 4000))
"""


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_killed_writer_leaves_every_complete_batch_and_the_next_one_appends(
        tmp_path: Path, rate: float) -> None:
    log = tmp_path / "log"
    env = {**os.environ, _crash.ENV: "access_log.after_ids:6"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(log), str(rate)], env=env,
                           check=False)
    assert child.returncode == -signal.SIGKILL
    assert (log / "t.ids").stat().st_size > 0
    want = [b[sample_mask(b, rate)] for b in (np.arange(b, b + 4000) for b in range(5))]
    got = read_access_log(log).batches("t")
    assert len(got) == 5 and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    # a torn offset record on top of the torn batch changes nothing either
    with open(log / "t.offsets", "ab") as fh:
        fh.write(b"\x01\x02\x03")
    assert len(read_access_log(log).batches("t")) == 5
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=2)], record_accesses=log,
                       record_sample=rate) as store:
        store.lookup("t", np.arange(7, 11))
    got = read_access_log(log).batches("t")
    assert len(got) == 6 and np.array_equal(got[-1], np.arange(7, 11)[sample_mask(
        np.arange(7, 11), rate)])


def test_bad_paths_and_rates_give_embstore_errors_and_create_no_store(tmp_path: Path) -> None:
    spec = embstore.TableSpec("t", dim=2)
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    cases = [(tmp_path / "file", "is a file"), (tmp_path / "file" / "log", "cannot record"),
             (tmp_path / "other", "not an access log"), (7, "must be a path")]
    for path, message in cases:
        with pytest.raises(ConfigError, match=message):
            embstore.open(None, tables=[spec], record_accesses=path)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=message):  # a store made for nothing: undone
            embstore.open(tmp_path / "store", tables=[spec],
                          record_accesses=path)  # type: ignore[arg-type]
        assert not (tmp_path / "store").exists()
    for rate in (0, 1.5, -1, True, "0.1", 1e-9):
        with pytest.raises(ConfigError, match="record_sample"):
            embstore.open(tmp_path / "store", tables=[spec], record_accesses=tmp_path / "log",
                          record_sample=rate)  # type: ignore[arg-type]
    for where in (None, tmp_path / "store"):
        with pytest.raises(ConfigError, match="does not have"):
            embstore.open(where, tables=[spec], record_accesses=tmp_path / "log",
                          record_sample={"nope": 0.1})
    with pytest.raises(ConfigError, match="inside the store"):
        embstore.open(tmp_path / "store", tables=[spec],
                      record_accesses=tmp_path / "store" / "log")
    assert not (tmp_path / "store").exists() and not (tmp_path / "log").exists()
    assert main(["profile", str(tmp_path / "other"), "-o", str(tmp_path / "p.json")]) == 2


def test_numpy_rates_are_rates_and_numpy_bools_are_not(tmp_path: Path) -> None:
    # np.float32(0.5) was refused as "not a rate in [2**-24, 1]", while np.float64 was taken
    specs = [embstore.TableSpec("a", dim=2), embstore.TableSpec("b", dim=2)]
    for k, sample in enumerate((np.float32(0.5), {"a": np.float32(0.25), "b": np.int64(1)})):
        with embstore.open(None, tables=specs, record_accesses=tmp_path / f"log{k}",
                           record_sample=sample) as store:  # type: ignore[arg-type]
            store.lookup("a", np.arange(1000))
        rates = read_access_log(tmp_path / f"log{k}").rates
        assert rates == ({"a": 0.5, "b": 0.5} if k == 0 else {"a": 0.25, "b": 1.0})
        assert all(type(r) is float for r in rates.values())
    for bad in (np.bool_(True), np.float32(0), np.float64(np.nan), np.int64(2)):
        with pytest.raises(ConfigError, match="record_sample"):
            embstore.open(None, tables=specs, record_accesses=tmp_path / "bad",
                          record_sample=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "bad").exists()


def test_per_rank_logs_read_as_one_in_rank_order_and_must_agree(tmp_path: Path) -> None:
    from embstore._access_log import AccessRecorder

    def record(rank: int, batches: list[list[int]], rate: float = 1.0) -> None:
        rec = AccessRecorder(tmp_path / "logs" / f"rank{rank}", ["t"], rate)
        for b in batches:
            rec.lookup("t", np.asarray(b, dtype=np.int64))
        rec.close()

    record(0, [[1, 2], [3], [4, 4]])
    record(1, [[10], []])  # a rank with fewer batches (killed early) adds what it has
    log = read_access_log(tmp_path / "logs")
    assert [b.tolist() for b in log.batches("t")] == [[1, 2], [10], [3], [], [4, 4]]
    assert log.rates == {"t": 1.0}
    record(2, [[5]], rate=0.5)
    with pytest.raises(ConfigError, match="different rates"):
        read_access_log(tmp_path / "logs")
    (tmp_path / "logs" / "rank2").rename(tmp_path / "logs" / "rank3")
    with pytest.raises(ConfigError, match="no gap"):
        read_access_log(tmp_path / "logs")


def test_a_sharded_store_refuses_a_bad_rate_before_any_collective(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="embstore.distributed needs torch")
    import embstore.distributed as ed

    # no process group exists here: the check must come first, on every rank alike
    with pytest.raises(ConfigError, match="rate"):
        ed.open(None, tables=[embstore.TableSpec("t", dim=4)],
                record_accesses=tmp_path / "logs", record_sample=1.5)
    assert not (tmp_path / "logs").exists()


# -- a damaged log is refused, naming what is wrong where; a torn tail is said, not hidden --

def small_log(log: Path) -> None:
    """A closed log of two tables, 'user' and 'item', three batches each."""
    record(log, {"user": [np.arange(b, b + 6) for b in range(3)],
                 "item": [np.arange(10 * b, 10 * b + 4) for b in range(3)]})


def _offsets(log: Path, values: list[int]) -> None:
    np.array(values, dtype="<i8").tofile(log / "user.offsets")


DAMAGE = {
    "offset-past-the-ids": (lambda log: _offsets(log, [0, 10**12, 12]), "user.offsets"),
    "negative-offset": (lambda log: _offsets(log, [0, -5, 12]), "user.offsets"),
    "offsets-not-from-0": (lambda log: _offsets(log, [3, 6, 12]), "user.offsets"),
    "offsets-empty": (lambda log: _offsets(log, []), "user.offsets"),
    "ids-missing": (lambda log: (log / "user.ids").unlink(), "user.ids is missing"),
    "offsets-missing": (lambda log: (log / "user.offsets").unlink(),
                        "user.offsets is missing"),
    "ids-a-directory": (lambda log: ((log / "user.ids").unlink(), (log / "user.ids").mkdir()),
                        "user.ids"),
    "unlisted-table": (lambda log: np.arange(4, dtype="<i8").tofile(log / "zzz.ids"),
                       "zzz.ids holds batches of table 'zzz'"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_table_is_refused_naming_it_and_profile_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    log = tmp_path / "log"
    small_log(log)
    apply, where = DAMAGE[damage]
    apply(log)
    table = "zzz" if damage == "unlisted-table" else "user"
    with pytest.raises(CorruptStoreError, match=f"'{table}'") as info:
        read_access_log(log)
    assert where in str(info.value) and "damaged" in str(info.value)
    assert main(["profile", str(log), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("embstore profile: error: ") and len(err.strip().splitlines()) == 1
    assert where in err and not (tmp_path / "p.json").exists()
    # a store recording to it refuses too, rather than cut the damage off as a torn tail
    before = {p.name: p.read_bytes() for p in log.iterdir() if p.is_file()}
    with pytest.raises(CorruptStoreError, match=f"'{table}'"):
        embstore.open(None, tables=[embstore.TableSpec(n, dim=2) for n in ("user", "item")],
                      record_accesses=log)
    assert {p.name: p.read_bytes() for p in log.iterdir() if p.is_file()} == before


def _header(log: Path) -> dict:
    return json.loads((log / "ACCESS_LOG.json").read_text())


FIELDS = ["format", "version", "byte_order", "dtype", "sampling", "tables"]


@pytest.mark.parametrize("raw", [b"", b"  \n", b'{"format": "embstore.acc', b"{not json",
                                 b"\xff\xfe{}", b"[1, 2]", b"null", b"[" * 100_000,
                                 b'{"version": 1' + b"9" * 5000 + b"}"])
def test_a_header_that_is_no_json_object_is_our_one_line_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], raw: bytes) -> None:
    log = tmp_path / "log"
    small_log(log)
    (log / "ACCESS_LOG.json").write_bytes(raw)
    with pytest.raises(CorruptStoreError, match="ACCESS_LOG.json") as info:
        read_access_log(log)
    assert "Expecting" not in str(info.value) and "line 1 column" not in str(info.value)
    assert main(["profile", str(log), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "ACCESS_LOG.json" in err and len(err) < 400
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", [None, "x", 1.5, [], {}, True, "missing"])
def test_each_header_field_of_the_wrong_type_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object) -> None:
    log = tmp_path / "log"
    small_log(log)
    header = _header(log)
    if value == "missing":
        del header[field]
    elif field == "tables" and value == {}:
        header[field] = {"user": {}}  # an entry without its rate and threshold
    else:
        header[field] = value
    (log / "ACCESS_LOG.json").write_text(json.dumps(header))
    with pytest.raises(CorruptStoreError, match=f"ACCESS_LOG.json: field '{field}"):
        read_access_log(log)
    assert main(["profile", str(log), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert f"field '{field}" in err and len(err.strip().splitlines()) == 1
    assert "unknown sampling" not in err and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(("entry", "field"), [
    ({"user": None}, "tables.user'"), ({"user": {"rate": 1.0, "threshold": "x"}},
                                       "tables.user.threshold'"),
    ({"user": {"rate": 1.0, "threshold": 0}}, "tables.user.threshold'"),
    ({"user": {"rate": 1.0, "threshold": True}}, "tables.user.threshold'"),
    ({"user": {"rate": 0.5, "threshold": 2**24}}, "tables.user.rate'"),
    ({"user": {"threshold": 2**24}}, "tables.user.rate'"),
    ({"../user": {"rate": 1.0, "threshold": 2**24}}, "not a table name")])
def test_a_bad_table_entry_in_the_header_is_named(tmp_path: Path, entry: dict,
                                                  field: str) -> None:
    log = tmp_path / "log"
    small_log(log)
    header = _header(log)
    header["tables"] = {**{k: v for k, v in header["tables"].items() if k != "user"}, **entry}
    (log / "ACCESS_LOG.json").write_text(json.dumps(header))
    with pytest.raises(CorruptStoreError, match="ACCESS_LOG.json") as info:
        read_access_log(log)
    assert field in str(info.value)


def test_a_newer_version_is_a_config_error_not_damage(tmp_path: Path) -> None:
    log = tmp_path / "log"
    small_log(log)
    (log / "ACCESS_LOG.json").write_text(json.dumps({**_header(log), "version": 2}))
    with pytest.raises(ConfigError, match="version 2 is not supported"):
        read_access_log(log)


def test_a_torn_tail_is_read_up_to_it_and_profile_says_what_it_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log"
    small_log(log)
    # an offsets file cut inside its second record looks like a writer killed mid-record
    os.truncate(log / "user.offsets", 13)
    got = read_access_log(log)
    assert got.batches("user") == [] and got.left_out == {"user": 18}
    assert main(["profile", str(log), "-o", str(tmp_path / "p.json"), "--points", "3",
                 "--policies", "clock"]) == 0
    err = capsys.readouterr().err
    assert "table 'user': 18 logged ids past its last complete batch were left out" in err
    assert set(json.loads((tmp_path / "p.json").read_text())["tables"]) == {"item"}


@pytest.mark.parametrize("tail", [b"\x01" * 10, np.array([10**6], "<i8").tobytes()])
def test_a_record_past_the_ids_is_counted_as_one_lost_batch_not_as_its_value_in_ids(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tail: bytes) -> None:
    # the note gave 10**6 - 18 (or 72340172838076673 - 18) ids as left out
    log = tmp_path / "log"
    small_log(log)
    with open(log / "user.offsets", "ab") as f:
        f.write(tail)
    got = read_access_log(log)
    assert len(got.batches("user")) == 3 and got.lost_batches == {"user": 1}
    assert not got.left_out
    assert main(["profile", str(log), "-o", str(tmp_path / "p.json"), "--points", "3",
                 "--policies", "clock"]) == 0
    err = capsys.readouterr().err
    assert "table 'user': 1 batch ends past the ids its file holds" in err, err


def _edit_rate(log: Path, rate: float) -> None:
    header = _header(log)
    header["tables"]["user"] = {"rate": rate, "threshold": int(rate * 2**24)}
    (log / "ACCESS_LOG.json").write_text(json.dumps(header))


def test_ids_a_sampled_log_could_not_have_kept_are_damage(tmp_path: Path) -> None:
    # an id's changed bytes, or a rate edited in the header, were read as accesses: the
    # profile counted rows never looked up, or scaled them up by the false rate
    log = tmp_path / "log"
    record(log, {"user": [np.arange(b * 500, b * 500 + 2000) for b in range(4)]}, sample=0.5)
    assert len(read_access_log(log).batches("user")) == 4
    raw = bytearray((log / "user.ids").read_bytes())
    for k in range(10, 18):  # a high byte of 8 ids: each changed id is kept by chance 0.5
        raw[8 * k + 6] ^= 0x40
    (log / "user.ids").write_bytes(bytes(raw))
    with pytest.raises(CorruptStoreError, match="'user': [1-8] of its .* are not among those "
                                                "its rate .*0.5.* keeps"):
        read_access_log(log)
    fresh = tmp_path / "unsampled"
    small_log(fresh)
    _edit_rate(fresh, 0.5)
    with pytest.raises(CorruptStoreError, match="'user'.*rate"):
        read_access_log(fresh)


def test_a_killed_writers_empty_files_of_a_new_table_are_no_damage(tmp_path: Path) -> None:
    log = tmp_path / "log"
    small_log(log)
    (log / "new.ids").write_bytes(b"")  # created, but the header never listed the table
    np.zeros(1, "<i8").tofile(log / "new.offsets")
    assert sorted(read_access_log(log).ids) == ["item", "user"]
    with embstore.open(None, tables=[embstore.TableSpec("new", dim=2)],
                       record_accesses=log) as store:
        store.lookup("new", np.arange(3))
    assert [b.tolist() for b in read_access_log(log).batches("new")] == [[0, 1, 2]]


@pytest.mark.parametrize("kept_ids,batches", [(7, 1), (0, 0)])
def test_offsets_past_ids_a_power_cut_lost_are_a_torn_tail_read_up_to_it(
        tmp_path: Path, kept_ids: int, batches: int) -> None:
    """A power cut can keep offsets written since the last flush and lose their ids (the
    flush syncs ids first): the batches before are read, the rest said to be left out.
    """
    log = tmp_path / "log"
    small_log(log)  # user: three batches of 6 ids
    os.truncate(log / "user.ids", 8 * kept_ids + 3)
    got = read_access_log(log)
    assert len(got.batches("user")) == batches and got.lost_batches == {"user": 3 - batches}
    assert got.left_out == ({"user": kept_ids - 6 * batches} if kept_ids > 6 * batches else {})
    assert len(got.batches("item")) == 3
    # a store recording to it again goes on after the last complete batch
    with embstore.open(None, tables=[embstore.TableSpec(n, dim=2) for n in ("user", "item")],
                       record_accesses=log) as store:
        store.lookup("user", np.arange(4))
    again = read_access_log(log)
    assert len(again.batches("user")) == batches + 1 and not again.left_out
