"""Tier models, the planner and placements: budgets kept, naive placements beaten, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embstore
from embstore.errors import ConfigError
from embstore.placement import apply_placement, load_document
from embstore.tools._plan import (
    chain_option,
    naive_placement,
    parse_budget,
    plan,
    to_placement,
)
from embstore.tools.cli import main
from embstore.tools.profile import build_profile, load_tables

EXAMPLE_TIERS = Path(__file__).parent / "data" / "tiers_optane_nvme.json"


@pytest.fixture(scope="module")
def profile() -> dict[str, Any]:
    tables = load_tables("synth:seed=1,batches=64,lookups=4096")
    return build_profile(tables, policies=["clock"], points=8)


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    return load_document(EXAMPLE_TIERS, "tiers")


def total(chosen: dict[str, Any]) -> float:
    return sum(o.seconds for o in chosen.values())


def test_the_plan_keeps_its_budgets_and_more_memory_never_predicts_slower(
        profile: dict[str, Any], model: dict[str, Any]) -> None:
    times = []
    for dram, pmem in (("1MiB", "0"), ("2MiB", "4MiB"), ("8MiB", "16MiB"), ("64MiB", "64MiB")):
        budget = parse_budget(f"dram={dram}" + (f",pmem={pmem}" if pmem != "0" else ""),
                              260, model)
        chosen = plan(profile, model, budget)
        for tier in ("dram", "pmem"):
            assert sum(o.use[tier] for o in chosen.values()) <= budget[tier]
        times.append(total(chosen))
    assert all(b <= a + 1e-12 for a, b in zip(times, times[1:], strict=False))
    assert times[-1] < 0.5 * times[0]


def test_the_plan_beats_both_naive_placements_under_the_model(
        profile: dict[str, Any], model: dict[str, Any]) -> None:
    budget = parse_budget("dram=2MiB,pmem=4MiB", 260, model)
    best = total(plan(profile, model, budget))
    for kind in ("proportional", "hottest"):
        naive = naive_placement(profile, model, budget, kind)
        for tier in ("dram", "pmem"):
            assert sum(o.use[tier] for o in naive.values()) <= budget[tier] * 1.0001
        assert best < total(naive), kind


def test_chain_costs_follow_the_miss_ratio_curve(profile: dict[str, Any],
                                                 model: dict[str, Any]) -> None:
    t = profile["tables"]["t00"]
    small, large = t["mrc"]["capacities"][2], t["mrc"]["capacities"][-2]
    a = chain_option(t, model, ["dram", "rocksdb"], [small], ["clock"])
    b = chain_option(t, model, ["dram", "rocksdb"], [large], ["clock"])
    assert b.hit_ratios[0] > a.hit_ratios[0] and b.seconds < a.seconds
    assert sum(a.hit_ratios) == pytest.approx(1.0)
    assert a.use["dram"] == pytest.approx(small * (260 + 21))
    assert chain_option(t, model, ["dram"], []).seconds < b.seconds


def test_budget_and_document_errors_say_what_to_fix(profile: dict[str, Any],
                                                    model: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="below one row"):
        parse_budget("dram=100B", 260, model)
    with pytest.raises(ConfigError, match="'ssd'"):
        parse_budget("dram=1MiB,ssd=1GiB", 260, model)
    with pytest.raises(ConfigError, match="no 'pmem' tier"):
        parse_budget("dram=1MiB,pmem=1GiB", 260, {"tiers": {"dram": {}}})
    bad = json.loads(json.dumps(model))
    bad["tiers"]["nvram"] = bad["tiers"].pop("pmem")
    with pytest.raises(ConfigError, match="unknown tier 'nvram'"):
        load_document(bad, "tiers")
    with pytest.raises(ConfigError, match="version"):
        load_document({**profile, "version": 9}, "profile")
    with pytest.raises(ConfigError, match="not an embstore.placement"):
        load_document(profile, "placement")
    broken = json.loads(json.dumps(profile))
    del broken["tables"]["t01"]["mrc"]["capacities"]
    with pytest.raises(ConfigError, match="'t01'.*capacities"):
        load_document(broken, "profile")


def test_open_with_a_placement_gives_tables_their_chains(
        tmp_path: Path, profile: dict[str, Any], model: dict[str, Any]) -> None:
    chosen = plan(profile, model, parse_budget("dram=1MiB,pmem=2MiB", 260, model))
    doc = to_placement(chosen, {"dram": 1 << 20, "pmem": 2 << 20})
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(doc))
    specs = [embstore.TableSpec(n, dim=64, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))
             for n in sorted(profile["tables"])]
    with embstore.open(tmp_path / "store", tables=specs, placement=path) as store:
        described = store.describe()["tables"]
        for name, entry in doc["tables"].items():
            assert [t["backend"] for t in described[name]["tiers"]] == [
                t["backend"] for t in entry["tiers"]]
        ids = np.arange(10, dtype=np.int64)
        store.apply_gradients("t00", ids, np.ones((10, 64), np.float32))
        assert store.lookup("t00", ids).shape == (10, 64)
    with pytest.raises(ConfigError, match="not among the tables given"):
        apply_placement(specs[:3], doc)
    with pytest.raises(ConfigError, match="no tables were given.*embstore migrate"):
        embstore.open(tmp_path / "store", placement=path)


def test_plan_and_bench_tiers_commands(tmp_path: Path, profile: dict[str, Any],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.json").write_text(json.dumps(profile))
    assert main(["bench", "tiers", "--quick", "--tiers", "dram,pmem,rocksdb", "-o",
                 str(tmp_path / "tiers.json")]) == 0
    measured = load_document(tmp_path / "tiers.json", "tiers")
    assert set(measured["tiers"]) == {"dram", "pmem", "rocksdb"}
    assert "fallback" in measured["tiers"]["pmem"]["note"] or "libpmem on" in \
        measured["tiers"]["pmem"]["note"]
    out = tmp_path / "placement.json"
    assert main(["plan", str(tmp_path / "p.json"), "--tiers", str(tmp_path / "tiers.json"),
                 "--budget", "dram=1MiB,pmem=1MiB", "-o", str(out)]) == 0
    assert "total" in capsys.readouterr().out
    load_document(out, "placement")
    assert main(["plan", str(tmp_path / "p.json"), "--tiers", str(tmp_path / "tiers.json"),
                 "--budget", "dram=12B", "-o", str(out)]) == 2
    assert "below one row" in capsys.readouterr().err


def test_bench_placement_checks_a_plan_against_the_simulator_and_a_store(
        tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert main(["bench", "placement", "--quick", "--tiers", str(EXAMPLE_TIERS),
                 "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["hit_ratio_error_points"]["vs_simulator_max"] <= 3.0
    times = report["seconds_per_batch"]
    assert times["plan"]["predicted"] < min(times["proportional"]["predicted"],
                                            times["hottest"]["predicted"])
    assert all(t["measured"] > 0 for t in times.values())


PLANNED = ("t00", "t02", "t05")


def _planned_store(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A store of three profiled tables (DRAM cache over LMDB), trained on their trace."""
    tables = load_tables("synth:seed=1,batches=64,lookups=4096")
    path = tmp_path / "store"
    specs = [embstore.TableSpec(n, dim=8, optimizer=embstore.optim.Adam(lr=0.1))
             for n in PLANNED]
    with embstore.open(path, tables=specs, tiers=[embstore.TierSpec("dram", capacity=64),
                                                  embstore.TierSpec("lmdb")]) as store:
        for b in range(0, 64, 4):
            for n in PLANNED:
                ids = np.unique(tables[n][b])
                store.apply_gradients(n, ids, np.full((len(ids), 8), 0.5, np.float32))
    profile = build_profile({n: tables[n] for n in PLANNED},
                            policies=["clock", "wtinylfu:hold_new=1"], points=8)
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    return path, _contents(path)


def _contents(path: Path) -> dict[str, bytes]:
    """Every table's rows (weights and optimizer state) in id order, as bytes."""
    out = {}
    with embstore.open(path, read_only=True) as store:
        for name in store.tables:
            ids, weights, state = (np.concatenate(p) for p in zip(*store.items(name),
                                                                   strict=True))
            order = np.argsort(ids)
            out[name] = ids[order].tobytes() + weights[order].tobytes() + state[order].tobytes()
    return out


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != "LOCK"}


def test_migrate_applies_a_plan_to_a_store_bit_for_bit(tmp_path: Path) -> None:
    path, before = _planned_store(tmp_path)
    placement = tmp_path / "placement.json"
    assert main(["plan", str(tmp_path / "profile.json"), "--tiers", str(EXAMPLE_TIERS),
                 "--budget", "dram=2MiB,pmem=4MiB", "-o", str(placement)]) == 0
    planned = json.loads(placement.read_text())["tables"]
    assert len({json.dumps(e["tiers"]) for e in planned.values()}) == 3  # three layouts
    chains = {n: tuple(embstore.TierSpec.from_json(t) for t in e["tiers"])
              for n, e in planned.items()}
    assert main(["migrate", str(path), "--placement", str(placement)]) == 0
    assert _contents(path) == before and embstore.fsck.check(path) == []
    with embstore.open(path) as store:
        for name, chain in chains.items():
            assert store.table_spec(name).tiers == chain
            described = store.describe()["tables"][name]["tiers"]
            assert [t["eviction"] for t in described[:-1]] == [t.eviction for t in chain[:-1]]
        store.apply_gradients("t02", np.array([1, 2]), np.ones((2, 8), np.float32))


def test_migrate_refuses_a_placement_that_does_not_fit_the_store_and_changes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _planned_store(tmp_path)
    model = load_document(EXAMPLE_TIERS, "tiers")
    profile = load_document(tmp_path / "profile.json", "profile")
    doc = to_placement(plan(profile, model, parse_budget("dram=2MiB", 260, model)),
                       {"dram": 2 << 20, "pmem": 0})
    files = _files(path)
    missing = json.loads(json.dumps(doc))
    del missing["tables"]["t02"]
    foreign = json.loads(json.dumps(doc))
    foreign["tables"]["t99"] = foreign["tables"]["t00"]
    unknown = json.loads(json.dumps(doc))
    unknown["tables"]["t05"]["tiers"][-1]["backend"] = "floppy"
    for bad, message in ((missing, "no chain for tables ['t02']"), (foreign, "'t99'"),
                         (unknown, "unknown tier 'floppy'")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        assert main(["migrate", str(path), "--placement", str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert _files(path) == files
    # a table the plan lacks may stay where it is when only the planned ones move
    (tmp_path / "part.json").write_text(json.dumps(missing))
    assert main(["migrate", str(path), "--placement", str(tmp_path / "part.json"),
                 "--table", "t00", "--table", "t05"]) == 0
    with embstore.open(path, read_only=True) as store:
        assert store.table_spec("t02").tiers is None


def _profile_of(curves: dict[str, list[float]]) -> dict[str, Any]:
    caps = [4096, 32768, 262144, 1 << 21]
    return {"rows_touched": caps[-1], "row_bytes": 260, "distinct_per_batch": 2000.0,
            "lookups_per_sample": 2000.0, "bytes_per_sample": 520_000.0,
            "mrc": {"capacities": caps, **curves}}


def test_each_cache_takes_the_profiled_policy_with_the_fewest_misses_at_its_size(
        profile: dict[str, Any], model: dict[str, Any]) -> None:
    recency = _profile_of({"lru": [0.9, 0.5, 0.2, 0.0], "clock": [0.9, 0.6, 0.3, 0.0],
                           "wtinylfu": [0.9, 0.55, 0.25, 0.0]})
    frequency = _profile_of({"lru": [0.9, 0.7, 0.4, 0.0], "clock": [0.9, 0.6, 0.35, 0.0],
                             "wtinylfu": [0.8, 0.3, 0.1, 0.0]})
    crossing = _profile_of({"lru": [0.9, 0.4, 0.3, 0.0], "clock": [0.9, 0.5, 0.1, 0.0]})
    for t, size, want in ((recency, 32768, "lru"), (frequency, 32768, "wtinylfu"),
                          (crossing, 32768, "lru"), (crossing, 262144, "clock")):
        assert chain_option(t, model, ["dram", "rocksdb"], [size]).policies == [want]
    # and through the whole planner into the placement's tier specs
    doc = {"format": "embstore.profile", "version": 1,
           "tables": {"recency": recency, "frequency": frequency}}
    budget = parse_budget("dram=32MiB", 260, model)
    chosen = to_placement(plan(doc, model, budget), budget)["tables"]
    for name, want in (("recency", "lru"), ("frequency", "wtinylfu")):
        tiers = chosen[name]["tiers"]
        assert len(tiers) == 2 and tiers[0]["eviction"] == want, chosen[name]
    # a real profile: every planned cache runs the curve that is lowest at its size
    for name, o in plan(profile, model, parse_budget("dram=2MiB,pmem=4MiB", 260, model)).items():
        t = profile["tables"][name]
        for i, policy in enumerate(o.policies):
            size = np.log(sum(o.caps[: i + 1]))
            at = {p: np.interp(size, np.log(t["mrc"]["capacities"]), t["mrc"][p])
                  for p in t["mrc"] if p != "capacities"}
            assert at[policy] == min(at.values()), (name, at)


# -- input validation: every bad file or flag is one clear line, and nothing is written --


@pytest.fixture
def files(tmp_path: Path, profile: dict[str, Any]) -> Path:
    """tmp_path holding p.json (a profile), t.json (a tier model) and an empty folder d."""
    (tmp_path / "p.json").write_text(json.dumps(profile))
    (tmp_path / "t.json").write_bytes(EXAMPLE_TIERS.read_bytes())
    (tmp_path / "d").mkdir()
    return tmp_path


def _plan_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str,
                profile: str = "p.json", tiers: str = "t.json",
                budget: str = "dram=1MiB") -> str:
    """Run `plan` expecting exit 2 and one error line; nothing new or changed in tmp_path."""
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv = ["plan", str(tmp_path / profile), "--tiers", str(tmp_path / tiers), "--budget",
            budget, *args]
    if "-o" not in args:
        argv += ["-o", str(tmp_path / "out.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "internal error" not in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    return err


@pytest.mark.parametrize(("output", "message"), [
    ("p.json", "is also an input"), ("t.json", "is also an input"),
    ("link.json", "is also an input"), ("", "-o is empty"), ("d", "is a directory"),
    ("nodir/x.json", "nodir' does not exist"),
    ("t.json/x.json", "t.json' is not a folder")])  # it said the folder did not exist
def test_plan_refuses_an_output_that_is_an_input_or_no_file(
        files: Path, capsys: pytest.CaptureFixture[str], output: str, message: str) -> None:
    (files / "link.json").symlink_to(files / "p.json")
    target = str(files / output) if output else ""
    assert message in _plan_fails(files, capsys, "-o", target)


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `doc` with the dotted `path` set to `value`."""
    doc = json.loads(json.dumps(doc))
    *parents, last = path.split(".")
    obj = doc
    for key in parents:
        obj = obj[key]
    obj[last] = value
    return doc


@pytest.mark.parametrize(("field", "value"), [
    ("distinct_per_batch", float("nan")), ("distinct_per_batch", float("inf")),
    ("distinct_per_batch", -1), ("lookups_per_sample", float("-inf")),
    ("bytes_per_sample", "x"), ("lookups_per_batch", -2.0), ("rows_touched", 1.5),
    ("row_bytes", True), ("sample_rate", 0.0), ("sample_rate", 2), ("error_bound", float("nan")),
    ("reuse.cold", 1.5), ("reuse.lookups", [float("nan")]), ("mrc.capacities", [0, 10]),
    ("mrc.capacities", ["a", "b"]), ("mrc.lru", [float("nan")] * 8)])
def test_every_profile_number_is_checked_naming_table_and_field(
        profile: dict[str, Any], field: str, value: Any) -> None:
    bad = _set(profile, f"tables.t03.{field}", value)
    with pytest.raises(ConfigError, match=rf"table 't03'.*{field.split('.')[-1]}"):
        load_document(bad, "profile")


def test_a_profile_whose_distinct_ids_per_batch_contradict_its_other_figures_is_refused(
        files: Path, profile: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    # an edited distinct_per_batch was planned as given: seconds per batch for reads of rows
    # the table does not have
    t = profile["tables"]["t03"]
    assert t["distinct_per_batch"] <= min(t["lookups_per_batch"], t["rows_touched"])
    for fields, says in (
            ({"distinct_per_batch": t["lookups_per_batch"] * 1.01}, "its lookups_per_batch"),
            ({"distinct_per_batch": t["rows_touched"] + 1.0, "lookups_per_batch":
              t["rows_touched"] * 2.0}, "rows it touches (rows_touched)")):
        bad = json.loads(json.dumps(profile))
        bad["tables"]["t03"].update(fields)
        with pytest.raises(ConfigError, match=r"table 't03'.distinct_per_batch .*more than"):
            load_document(bad, "profile")
        (files / "bad.json").write_text(json.dumps(bad))
        assert says in _plan_fails(files, capsys, profile="bad.json")


@pytest.mark.parametrize(("field", "value"), [
    ("batches", -1), ("samples_per_batch", 0), ("step_calls", float("nan"))])
def test_profile_header_numbers_are_checked(profile: dict[str, Any], field: str,
                                            value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        load_document(_set(profile, field, value), "profile")


def test_an_infinite_profile_figure_is_refused_before_planning(
        files: Path, profile: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    bad = _set(profile, "tables.t00.distinct_per_batch", float("inf"))
    (files / "inf.json").write_text(json.dumps(bad))  # Python writes the token Infinity
    err = _plan_fails(files, capsys, profile="inf.json")
    assert "table 't00'.distinct_per_batch must be a finite number" in err


@pytest.mark.parametrize(("field", "value"), [
    ("dram.read.bytes_per_s", float("nan")), ("pmem.write.bytes_per_s", 0),
    ("rocksdb.read.bytes_per_s", float("inf")), ("dram.read.bytes_per_s", "x"),
    ("lmdb.write.batch_latency_s", -1e-6), ("dram.read.batch_latency_s", float("nan")),
    ("dram.overhead_bytes_per_row", -1), ("pmem.overhead_bytes_per_row", "x"),
    ("rocksdb.overhead_bytes_per_row", float("inf"))])
def test_every_tier_model_number_is_checked_naming_tier_and_field(
        files: Path, model: dict[str, Any], capsys: pytest.CaptureFixture[str], field: str,
        value: Any) -> None:
    tier, *rest = field.split(".")
    bad = _set(model, f"tiers.{field}", value)
    name = rf"tier '{tier}'\.{'.'.join(rest)}"
    with pytest.raises(ConfigError, match=name):
        load_document(bad, "tiers")
    (files / "bad.json").write_text(json.dumps(bad))
    assert re.search(name, _plan_fails(files, capsys, tiers="bad.json"))


NOT_JSON = [(b"\xff\xfe\x00\x01binary\x80", "is not UTF-8 text"), (b"", "the file is empty"),
            (b"  \n", "the file is empty"), (b'{"format": ', "malformed at line 1 column 12"),
            (b"\x89PNG\r\n\x1a\n", "is not UTF-8 text"), (b"[" * 100_000, "nesting")]


@pytest.mark.parametrize(("data", "message"), NOT_JSON)
def test_files_that_are_not_json_get_our_message_not_the_parsers(
        files: Path, capsys: pytest.CaptureFixture[str], data: bytes, message: str) -> None:
    (files / "bad.json").write_bytes(data)
    for role in ("profile", "tiers"):
        err = _plan_fails(files, capsys, **{role: "bad.json"})
        assert f"{role} '{files / 'bad.json'}' is not a JSON document" in err, err
        assert message in err and "Expecting" not in err and "codec" not in err, err
    with pytest.raises(ConfigError, match=f"is not a JSON document.*{message}"):
        load_document(files / "bad.json", "placement")


def test_open_and_migrate_refuse_a_placement_that_is_not_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xd8\xff\xe0 a JPEG, not a placement")
    spec = embstore.TableSpec("t00", dim=4)
    with pytest.raises(ConfigError, match="placement .* is not a JSON document: byte 0"):
        embstore.open(tmp_path / "new", tables=[spec], placement=bad)
    assert not (tmp_path / "new").exists()
    with embstore.open(tmp_path / "store", tables=[spec]):
        pass
    files = _files(tmp_path / "store")
    assert main(["migrate", str(tmp_path / "store"), "--placement", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not a JSON document: byte 0 (0xff) is not UTF-8 text" in err, err
    assert _files(tmp_path / "store") == files


@pytest.mark.parametrize("tier", [
    {"backend": "dram", "capacity": 8, "eviction": "lru", "eviction_options": {"seed": -1}},
    {"backend": "dram", "capacity": 8, "options": [["chunk_rows_log2", 4]]},
])
def test_migrate_answers_a_placement_with_bad_tier_settings_as_a_config_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tier: dict[str, Any]) -> None:
    spec = embstore.TableSpec("t00", dim=4)
    with embstore.open(tmp_path / "store", tables=[spec]):
        pass
    files = _files(tmp_path / "store")
    placement = {"format": "embstore.placement", "version": 1,
                 "tables": {"t00": {"tiers": [tier, {"backend": "lmdb"}]}}}
    (tmp_path / "p.json").write_text(json.dumps(placement))
    argv = ["migrate", str(tmp_path / "store"), "--placement", str(tmp_path / "p.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and "error:" in err, err
    assert _files(tmp_path / "store") == files


def test_a_placement_of_another_type_or_a_bool_version_is_a_config_error(
        tmp_path: Path) -> None:
    spec = embstore.TableSpec("t00", dim=4)
    with pytest.raises(ConfigError, match="path to its JSON file or an already parsed dict"):
        embstore.open(tmp_path / "a", tables=[spec], placement=12)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="version True is not supported"):
        embstore.open(tmp_path / "b", tables=[spec],
                      placement={"format": "embstore.placement", "version": True,
                                 "tables": {}})
    assert not list(tmp_path.iterdir())


def test_save_document_refuses_non_finite_numbers_and_folders(tmp_path: Path) -> None:
    from embstore.placement import save_document

    with pytest.raises(ConfigError, match="NaN or an infinity"):
        save_document(tmp_path / "x.json", {"seconds": float("inf")})
    with pytest.raises(ConfigError, match="not a directory"):
        save_document(tmp_path, {"a": 1})
    assert list(tmp_path.iterdir()) == []


_HUGE = 10**400  # json reads it as an int that no float can hold


@pytest.mark.parametrize(("doc", "field", "value"), [
    ("p.json", "tables.t00.rows_touched", _HUGE), ("p.json", "tables.t00.row_bytes", _HUGE),
    ("p.json", "tables.t00.distinct_per_batch", 1e308),
    ("t.json", "tiers.dram.read.batch_latency_s", 1e308),
    ("t.json", "tiers.rocksdb.read.batch_latency_s", _HUGE),
    ("t.json", "tiers.dram.overhead_bytes_per_row", 1e308),
    ("t.json", "tiers.dram.read.bytes_per_s", 1e-320),
    ("t.json", "tiers.pmem.write.bytes_per_s", 0.5)])
def test_a_huge_or_vanishing_figure_is_refused_by_name_not_overflowed(
        files: Path, capsys: pytest.CaptureFixture[str], doc: str, field: str,
        value: Any) -> None:
    # they overflowed the planner's floats: an OverflowError, or a NaN placement refused as
    # "a bug: please report it"
    bad = _set(json.loads((files / doc).read_text()), field, value)
    (files / "bad.json").write_text(json.dumps(bad))
    err = _plan_fails(files, capsys, budget="dram=1MiB,pmem=1MiB",
                      **{"profile" if doc == "p.json" else "tiers": "bad.json"})
    assert f"{field.split('.', 2)[-1].split('.')[-1]} must be a" in err
    assert len(err) < 300, err  # the huge number is cut short


def test_a_huge_mrc_capacity_is_refused(profile: dict[str, Any]) -> None:
    caps = profile["tables"]["t00"]["mrc"]["capacities"]
    bad = _set(profile, "tables.t00.mrc.capacities", [*caps[:-1], _HUGE])
    with pytest.raises(ConfigError, match=r"capacities must be whole row counts"):
        load_document(bad, "profile")


def test_bench_tiers_refuses_no_tier_and_a_bad_output_before_measuring(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import embstore.tools._bench_tiers as bench_tiers

    # no tier: it wrote a model of no tier (exit 0) that plan then refused
    assert main(["bench", "tiers", "--quick", "--tiers", ",", "-o",
                 str(tmp_path / "t.json")]) == 2
    assert "names no tier" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before checking -o")

    monkeypatch.setattr(bench_tiers, "_measure", measured)
    for out, says in ((str(tmp_path / "none" / "t.json"), "does not exist"),
                      ("", "-o is empty"), (str(tmp_path), "is a directory")):
        assert main(["bench", "tiers", "--quick", "--tiers", "dram", "-o", out]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("budget", "says"), [
    ("dram=8GiB,pmem=64GiB,rocksdb=unbounded,lmdb=unbounded", None),
    ("dram=0.5", "a number without a unit counts bytes, which are whole"),
    ("dram=100", "is 100 bytes (a number without a unit counts bytes), below one row (260"),
    ("dram=abc", "dram=abc: not a size in bytes; write it with a unit"),
    ("dram=1MiB,rocksdb=1GiB", "rocksdb is not limited"),
    ("dram=unbounded", "needs a size, e.g. dram=8GiB"),
    ("dram=8GiB,dram=1GiB", "gives dram twice"), ("dram=8GiB,pmem=1GiB, pmem=2GiB",
                                                  "gives pmem twice"),
    ("dram=1" + "0" * 400, "--budget dram: 401 characters is too large"),
    ("dram=9000TiB", "above the 2**53 a placement holds"),
    ("dram=8GiB,pmem=100000000000000000000", "above the 2**53 a placement holds")])
def test_a_budget_is_bytes_given_once_and_rocksdb_may_be_unbounded(
        model: dict[str, Any], budget: str, says: str | None) -> None:
    # "dram=0.5" was refused as "below one row (16 bytes)" beside a parse error offering "a
    # row count (int)", and rocksdb=unbounded, parse_tier_budgets's form, was refused
    if says is None:
        assert parse_budget(budget, 260, model) == {"dram": 8 << 30, "pmem": 64 << 30}
        return
    with pytest.raises(ConfigError) as info:
        parse_budget(budget, 260, model)
    assert says in str(info.value) and "row count" not in str(info.value)


_PLACED = {"format": "embstore.placement", "version": 1, "budget": {"dram": 1024, "pmem": 0},
           "predicted_seconds_per_batch": 0.5,
           "tables": {"t": {"tiers": [{"backend": "dram", "capacity": 8, "eviction": "lru"},
                                      {"backend": "rocksdb"}],
                            "policy": "lru", "cache_rows": [8], "hit_ratios": [0.5, 0.5],
                            "seconds_per_batch": 0.5, "bytes": {"dram": 100}}}}


@pytest.mark.parametrize(("field", "value", "says"), [
    ("version", 1.0, "version 1.0 is not supported"),
    ("predicted_seconds_per_batch", float("nan"), "predicted_seconds_per_batch must be a"),
    ("predicted_seconds_per_batch", "x", "predicted_seconds_per_batch must be a"),
    ("budget", "x", "budget must be an object of tier"), ("budget.dram", -1, "budget.dram must"),
    ("tables", {}, "places no table"), ("tables.t", "rocksdb", "table 't' must be an object"),
    ("tables", {"t/x": _PLACED["tables"]["t"]}, "names table 't/x', which is no table name"),
    ("tables.t.tiers", [["rocksdb"]], "table 't'.tiers[0] must be an object"),
    ("tables.t.policy", 5, "table 't'.policy must be an eviction policy spec"),
    ("tables.t.policy", "nosuch", "table 't'.policy must be an eviction policy spec"),
    ("tables.t.cache_rows", [-5], "table 't'.cache_rows[0] must be whole row counts"),
    ("tables.t.cache_rows", [], "a row count per cache tier (1 for its chain of 2)"),
    ("tables.t.hit_ratios", ["x", 1], "table 't'.hit_ratios[0] must be ratios in [-1, 1]"),
    ("tables.t.hit_ratios", [0.5, 1.5], "table 't'.hit_ratios[1] must be ratios in [-1, 1]"),
    ("tables.t.hit_ratios", [-1.5, 1], "table 't'.hit_ratios[0] must be ratios in [-1, 1]"),
    ("tables.t.seconds_per_batch", float("inf"), "table 't'.seconds_per_batch must be"),
    ("tables.t.bytes", {"floppy": 1}, "table 't'.bytes must be an object of tier"),
    ("tables.t.bytes", {"dram": float("nan")}, "table 't'.bytes.dram must be")])
def test_every_placement_field_is_checked(tmp_path: Path, field: str, value: Any,
                                          says: str) -> None:
    # these loaded (a list tier as "unknown tier None"): the schema's fields went unchecked
    assert load_document(_PLACED, "placement") is _PLACED
    with pytest.raises(ConfigError) as info:
        load_document(_set(_PLACED, field, value), "placement")
    assert says in str(info.value), info.value


def test_a_placement_of_an_earlier_planner_with_a_negative_hit_share_still_loads() -> None:
    # earlier planners let a lower cache miss more than the one above where a miss-ratio
    # curve rose between profiled sizes: its share of hits came out below 0
    old = _set(_PLACED, "tables.t.hit_ratios", [0.64, -0.14])
    assert load_document(old, "placement") is old


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_placement_that_cannot_be_written_is_said_of_the_path_given(
        files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _plan_fails(files, capsys, "-o", "/proc/x.json")
    assert "cannot write '/proc/x.json': No such file or directory" in err, err
    assert ".tmp" not in err and "Errno" not in err


def test_a_users_file_named_like_the_output_and_tmp_is_left_alone(
        files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # <output>.tmp was the temporary file: a file of that name was overwritten and removed,
    # even the profile the command read, and a directory of that name failed the write
    (files / "p.json.tmp").write_bytes((files / "p.json").read_bytes())
    (files / "out.json.tmp").write_text("precious")
    (files / "x.json.tmp").mkdir()
    for profile, out in (("p.json", "out.json"), ("p.json", "x.json"),
                         ("p.json.tmp", "p.json")):
        assert main(["plan", str(files / profile), "--tiers", str(files / "t.json"),
                     "--budget", "dram=1MiB", "-o", str(files / out)]) == 0
        load_document(files / out, "placement")
    assert (files / "p.json.tmp").is_file() and (files / "x.json.tmp").is_dir()
    assert (files / "out.json.tmp").read_text() == "precious"
    capsys.readouterr()


def test_plan_writes_no_placement_that_open_would_refuse(tmp_path: Path, profile: dict[str, Any],
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    # a tier model this slow predicts seconds beyond what a placement holds: said before
    # writing, not left for `embstore.open(placement=...)` to refuse
    model = json.loads(EXAMPLE_TIERS.read_text())
    for tier in model["tiers"].values():
        for way in ("read", "write"):
            tier[way]["batch_latency_s"] = 2**53
    (tmp_path / "p.json").write_text(json.dumps(profile))
    (tmp_path / "slow.json").write_text(json.dumps(model))
    out = tmp_path / "placement.json"
    rc = main(["plan", str(tmp_path / "p.json"), "--tiers", str(tmp_path / "slow.json"),
               "--budget", "dram=1MiB,pmem=1MiB", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "do not fit a placement" in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("curve", ["bogus", "lru:foo=1", "always"])
def test_a_profile_curve_of_no_eviction_policy_is_refused_before_planning(
        profile: dict[str, Any], model: dict[str, Any], curve: str) -> None:
    # it passed, and failed only where the planner chose that curve, naming no table
    table = sorted(profile["tables"])[0]
    bad = json.loads(json.dumps(profile))
    bad["tables"][table]["mrc"][curve] = bad["tables"][table]["mrc"]["lru"]
    with pytest.raises(ConfigError, match=f"table {table!r} has a curve of no eviction"):
        plan(bad, model, parse_budget("dram=1MiB", 260, model))


def test_a_document_whose_name_is_near_the_limit_is_written(tmp_path: Path,
                                                            profile: dict[str, Any]) -> None:
    # its temporary name, 25 bytes longer, was past the file system's 255
    from embstore.placement import save_document

    path = tmp_path / ("p" * 245 + ".json")
    save_document(path, profile)
    assert load_document(path, "profile") == profile
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
