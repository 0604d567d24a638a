"""The sharding planner with per-rank tier budgets and profiles: budgets kept on every rank and
tier, clear errors, miss-ratio curves that steer the chains, plans that carry the chains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import embstore
from embstore._tier_cost import DEFAULT_TIER_MODEL
from embstore.distributed import Placement, Plan
from embstore.distributed.planner import (
    MissCurve,
    PlanReport,
    TableProfile,
    parse_tier_budgets,
    plan_tables,
    round_robin,
    tables_from_profile,
)
from embstore.errors import CapacityError, ConfigError

EXAMPLE_TIERS = Path(__file__).parent.parent / "data" / "tiers_optane_nvme.json"
INF = math.inf


def steep(rows: int) -> MissCurve:
    """A curve whose first caches already catch most lookups."""
    caps = np.geomspace(1, rows, 10)
    return MissCurve(tuple(caps), tuple(1 - np.log1p(caps) / np.log1p(rows)))


def tier_bytes(report: PlanReport, tables: list[TableProfile]) -> dict[str, np.ndarray]:
    """Bytes of every tier on every rank, from the plan's chains alone."""
    world = report.plan.world_size
    by_name = {t.name: t for t in tables}
    out = {t: np.zeros(world) for t in report.budgets}
    for rank, per in report.plan.tiers.items():
        for name, chain in per.items():
            t, p = by_name[name], report.plan.tables[name]
            rows = t.rows / len(p.ranks) if p.kind == "row" else t.rows
            row_bytes = float(t.row_bytes)
            if p.kind == "column":
                c0, c1 = p.column_range(rank)
                row_bytes *= (c1 - c0) / t.dim
            for level, tier in enumerate(chain):
                held = rows if level == len(chain) - 1 else tier.capacity
                assert tier.backend in report.budgets
                assert (tier.capacity is None) == (level == len(chain) - 1)
                over = DEFAULT_TIER_MODEL["tiers"][tier.backend]["overhead_bytes_per_row"]
                out[tier.backend][rank] += held * (row_bytes + over)
    return out


@st.composite
def configurations(draw: Any) -> tuple[list[TableProfile], int, int, dict[str, float]]:
    tables = []
    for i in range(draw(st.integers(1, 10))):
        rows = draw(st.integers(10, 10**6))
        tables.append(TableProfile(
            f"t{i}", rows, draw(st.sampled_from([4, 8, 16, 64])),
            draw(st.floats(0.1, 30.0)), unique_ratio=draw(st.floats(0.05, 1.0)),
            curve=steep(rows) if draw(st.booleans()) else None))
    world = draw(st.integers(1, 4))
    share = sum(t.memory for t in tables) / world
    budgets = {"dram": draw(st.floats(0.02, 1.5)) * share}
    if draw(st.booleans()):
        budgets["pmem"] = draw(st.floats(0.05, 1.5)) * share
    ssd = draw(st.sampled_from([None, "rocksdb", "lmdb"]))
    if ssd is not None:
        budgets[ssd] = INF
    return tables, world, draw(st.integers(1, 4096)), budgets


@given(configurations())
def test_every_rank_keeps_every_tier_budget(config: Any) -> None:
    tables, world, batch, budgets = config
    try:
        report = plan_tables(tables, world, batch, tier_budgets=budgets)
    except CapacityError as exc:
        # only without an unbounded tier can the tables fail to fit
        assert not any(math.isinf(b) for b in budgets.values())
        assert "dram=" in str(exc) or "pmem=" in str(exc)
        return
    report.plan.check([embstore.TableSpec(t.name, t.dim) for t in tables])
    recomputed = tier_bytes(report, tables)
    for tier, budget in budgets.items():
        assert np.allclose(recomputed[tier], report.tier_memory[tier], rtol=1e-9, atol=1e-3)
        assert (recomputed[tier] <= budget * (1 + 1e-9) + 1e-3).all(), (tier, budget)
    for t in tables:  # every shard of every table has its chain on its rank
        for rank in report.plan.tables[t.name].ranks:
            assert report.plan.chain(rank, t.name) is not None
    assert report.unit == "seconds" and (report.cost >= 0).all()


def test_production_shaped_tables_with_tier_budgets_balance_within_a_tenth() -> None:
    from embstore.tools import _shard_plan

    shape = {"tables": 856, "batch_size": 65536, "lookups_per_sample": 8.35,
             "unique_ratio": 0.132}
    tables = _shard_plan.with_curves(_shard_plan.production_like(shape), 65536)
    world = 8
    budgets = parse_tier_budgets("dram=10%,pmem=40%,rocksdb=unbounded",
                                 share_of=sum(t.memory for t in tables) / world)
    planned = plan_tables(tables, world, 65536, tier_budgets=budgets)
    rr = round_robin(tables, world, 65536, tier_budgets=budgets)
    assert planned.imbalance <= 1.1 < rr.imbalance
    assert planned.cost.max() < rr.cost.max()  # the step (the slowest rank) is faster
    assert planned.over_budget() <= 1 + 1e-9


def test_an_infeasible_budget_names_the_table_and_the_budget() -> None:
    tables = [TableProfile("big", 10**6, 64, 2.0), TableProfile("small", 10**3, 64, 2.0)]
    with pytest.raises(CapacityError) as info:
        plan_tables(tables, 2, 512, tier_budgets={"dram": 0.2 * tables[0].memory,
                                                  "pmem": 0.2 * tables[0].memory})
    message = str(info.value)
    assert "'big'" in message and "pmem=" in message and "2 ranks" in message
    assert "rocksdb=unbounded" in message
    # each table's smallest share of the budgets is all in DRAM, and both overflow it: the
    # planner moves one to pmem instead of giving up
    two = [tables[0], TableProfile("mid", 2 * 10**5, 64, 2.0)]
    fits = plan_tables(two, 1, 512, tier_budgets={"dram": 1.2 * two[0].memory,
                                                  "pmem": 1.1 * two[0].memory})
    assert fits.over_budget() <= 1 and fits.tier_memory["pmem"][0] > 0
    # the same tables fit once an unbounded tier takes what the budgets cannot
    report = plan_tables(tables, 2, 512, tier_budgets={"dram": 0.2 * tables[0].memory,
                                                       "rocksdb": INF})
    assert report.over_budget() <= 1


def test_bad_tier_arguments_are_config_errors() -> None:
    tables = [TableProfile("a", 100, 8, 1.0)]
    with pytest.raises(ConfigError, match="not both"):
        plan_tables(tables, 1, 8, 10**6, tier_budgets={"dram": 10**6})
    with pytest.raises(ConfigError, match="needs tier_budgets"):
        plan_tables(tables, 1, 8, tier_model=DEFAULT_TIER_MODEL)
    model = json.loads(EXAMPLE_TIERS.read_text())
    del model["tiers"]["pmem"]
    with pytest.raises(ConfigError, match="no such tier"):
        plan_tables(tables, 1, 8, tier_budgets={"dram": 10**6, "pmem": 10**6},
                    tier_model=model)


def test_tier_budgets_read_sizes_unbounded_and_shares() -> None:
    assert parse_tier_budgets("dram=8GiB, pmem=64GiB,rocksdb=unbounded") == {
        "dram": 8 * 2**30, "pmem": 64 * 2**30, "rocksdb": INF}
    assert parse_tier_budgets("dram=10%,lmdb=unbounded", share_of=1000.0) == {
        "dram": pytest.approx(100.0), "lmdb": INF}
    for bad, what in (("tape=1GiB", "known"), ("dram", "tier=size"), ("dram=0", "below"),
                      ("dram=1GiB,dram=2GiB", "twice"), ("dram=10%", "percentage"),
                      ("dram=lots", "size"), ("", "no tier")):
        with pytest.raises(ConfigError, match=what):
            parse_tier_budgets(bad)


def test_the_default_tier_model_is_the_documented_example() -> None:
    example = json.loads(EXAMPLE_TIERS.read_text())["tiers"]
    for tier in example.values():
        tier.pop("note", None)
    assert DEFAULT_TIER_MODEL["tiers"] == example


# --- profiles ---------------------------------------------------------------------------


def profile_doc(steep_policy: str = "wtinylfu:hold_new=1") -> dict[str, Any]:
    """Two tables alike but for their curves: 'hot' caches well, 'flat' hardly at all."""
    caps = [100, 1000, 10_000, 100_000]
    common = {"rows_touched": 100_000, "lookups_per_batch": 8000.0,
              "distinct_per_batch": 2000.0, "lookups_per_sample": 8.0, "row_bytes": 260,
              "bytes_per_sample": 2080.0}
    return {"format": "embstore.profile", "version": 1, "samples_per_batch": 1000,
            "policies": ["lru", steep_policy], "tables": {
                "hot": {**common, "mrc": {"capacities": caps, "lru": [0.5, 0.2, 0.1, 0.0],
                                          steep_policy: [0.4, 0.1, 0.05, 0.0]}},
                "flat": {**common, "mrc": {"capacities": caps,
                                           "lru": [0.999, 0.99, 0.9, 0.0],
                                           steep_policy: [0.999, 0.995, 0.95, 0.0]}}}}


def specs(**kw: Any) -> list[embstore.TableSpec]:
    return [embstore.TableSpec(n, dim=64, optimizer=embstore.optim.RowWiseAdagrad(), **kw)
            for n in ("hot", "flat")]


def test_a_profile_gives_lookups_reuse_and_the_best_curve() -> None:
    hot, flat = tables_from_profile(profile_doc(), specs())
    assert (hot.rows, hot.row_bytes, hot.lookups_per_sample) == (100_000, 260, 8.0)
    assert hot.unique_ratio == pytest.approx(0.25)
    assert hot.curve is not None and flat.curve is not None
    assert hot.curve.miss == (0.4, 0.1, 0.05, 0.0)
    assert flat.curve.miss == (0.999, 0.99, 0.9, 0.0)
    assert hot.curve.policies[0] == "wtinylfu:hold_new=1" and flat.curve.policies[1] == "lru"
    assert hot.distinct(1000) == pytest.approx(2000.0)


def dram_bytes(report: PlanReport, table: str) -> float:
    chain = report.plan.chain(0, table)
    assert chain is not None
    if chain[0].backend != "dram":
        return 0.0
    return float(chain[0].capacity if chain[0].capacity is not None else 100_000) * (260 + 21)


def test_a_steep_curve_gets_a_small_cache_and_the_dram_goes_where_it_pays() -> None:
    tables = tables_from_profile(profile_doc(), specs())
    budgets = {"dram": 1.2 * 100_000 * 281, "rocksdb": INF}  # not both tables whole
    report = plan_tables(tables, 1, 1000, tier_budgets=budgets)
    hot = report.plan.chain(0, "hot")
    assert hot is not None and [t.backend for t in hot] == ["dram", "rocksdb"]
    assert hot[0].capacity is not None and hot[0].capacity < 20_000
    assert (hot[0].eviction, hot[0].eviction_options) == ("wtinylfu", {"hold_new": 1})
    assert dram_bytes(report, "hot") < dram_bytes(report, "flat")
    # the same tables with the flat curve everywhere: the DRAM goes to the first one instead
    flat_curve = tables[1].curve
    both_flat = [TableProfile(t.name, t.rows, t.dim, t.lookups_per_sample, t.itemsize,
                              t.state_width, t.unique_ratio, flat_curve, t.stored_row_bytes)
                 for t in tables]
    again = plan_tables(both_flat, 1, 1000, tier_budgets=budgets)
    assert dram_bytes(again, "hot") > dram_bytes(report, "hot")
    assert again.cost.max() > report.cost.max()  # the steep curve made the step cheaper


def test_profiles_that_do_not_match_the_tables_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match=r"'cold' is not in the profile.*'flat', 'hot'"):
        tables_from_profile(profile_doc(), [*specs(),
                                            embstore.TableSpec("cold", dim=64)])
    wide = [embstore.TableSpec("hot", dim=128, optimizer=embstore.optim.RowWiseAdagrad())]
    with pytest.raises(ConfigError, match=r"260 bytes but the spec stores 516.*hot=516"):
        tables_from_profile(profile_doc(), wide)
    with pytest.raises(ConfigError, match="100000 distinct ids, more than its num_embeddings"):
        tables_from_profile(profile_doc(), specs(num_embeddings=5000))


# --- plans that carry tiers --------------------------------------------------------------


def test_a_plan_with_tiers_round_trips_and_checks_its_chains() -> None:
    cache = (embstore.TierSpec("dram", capacity=64, eviction="lru"),
             embstore.TierSpec("rocksdb"))
    plan = Plan(2, {"a": Placement("row", (0, 1)), "b": Placement("table", (1,))},
                {0: {"a": cache}, 1: {"b": (embstore.TierSpec("dram"),)}})
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.chain(0, "a") == cache and again.chain(1, "a") is None
    tables = [embstore.TableSpec("a", 4), embstore.TableSpec("b", 4)]
    plan.check(tables)
    with pytest.raises(ConfigError, match="rank 0 tiers for table 'b'"):
        Plan(2, plan.tables, {0: {"b": cache}}).check(tables)
    with pytest.raises(ConfigError, match="sets its own tiers and the plan others"):
        plan.check([embstore.TableSpec("a", 4, tiers=(embstore.TierSpec("lmdb"),)),
                    tables[1]])
    with pytest.raises(ConfigError, match="non-empty list of TierSpec"):
        Plan(2, plan.tables, {0: {"a": ()}})


def test_a_profile_written_by_embstore_profile_plans_its_tables() -> None:
    from embstore.tools.profile import build_profile, load_tables

    profile = build_profile(load_tables("synth:seed=1,batches=16,lookups=2048"),
                            policies=["clock"], points=6, samples_per_batch=64)
    tables = tables_from_profile(profile, [
        embstore.TableSpec(name, dim=64, optimizer=embstore.optim.RowWiseAdagrad())
        for name in profile["tables"]])
    total = sum(t.memory for t in tables)
    report = plan_tables(tables, 2, 64, tier_budgets={"dram": 0.05 * total, "rocksdb": INF})
    assert report.over_budget() <= 1
    cached = [c for per in report.plan.tiers.values() for c in per.values()
              if c[0].capacity is not None]
    assert cached and {c[0].eviction for c in cached} <= {"clock", "lru"}


def test_an_in_memory_sharded_store_refuses_a_plan_with_disk_tiers() -> None:
    pytest.importorskip("torch")
    import embstore.distributed as ed

    plan = Plan(1, {"a": Placement("table", (0,))},
                {0: {"a": (embstore.TierSpec("dram", capacity=8), embstore.TierSpec("lmdb"))}})
    with pytest.raises(ConfigError, match=r"\['lmdb'\] tiers, which need a directory"):
        ed.open(None, tables=[embstore.TableSpec("a", 4)], plan=plan)
