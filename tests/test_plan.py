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
