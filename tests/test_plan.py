"""Tier models, the planner and placements: budgets kept, naive placements beaten, errors."""

from __future__ import annotations

import json
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
