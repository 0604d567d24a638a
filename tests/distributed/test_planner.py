"""The sharding planner: balance within memory, splitting of hot tables, errors."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.distributed.plan import Placement, Plan
from embstore.distributed.planner import TableProfile, plan_tables, round_robin
from embstore.errors import CapacityError, ConfigError
from embstore.tools import _shard_plan

SHAPE_2021 = {"tables": 856, "batch_size": 65536, "lookups_per_sample": 8.35,
              "unique_ratio": 0.132}


@pytest.mark.parametrize("world", [8, 16, 64])
def test_production_shaped_tables_balance_within_a_tenth(world: int) -> None:
    tables = _shard_plan.production_like(SHAPE_2021)
    budget = 1.25 * sum(t.memory for t in tables) / world
    planned = plan_tables(tables, world, 65536, budget)
    rr = round_robin(tables, world, 65536)
    assert planned.imbalance <= 1.1
    assert planned.imbalance < rr.imbalance
    assert planned.memory.max() <= budget
    # the per-rank figures are those of the placements
    assert np.isclose(planned.cost.sum(), sum(t.cost(65536) for t in tables))
    assert set(planned.plan.tables) == {t.name for t in tables}


def test_a_hot_table_is_split_over_distinct_ranks() -> None:
    tables = [TableProfile("hot", 10**6, 128, 200.0), TableProfile("wide", 10**3, 256, 50.0)]
    tables += [TableProfile(f"t{i}", 10**4, 32, 1.0) for i in range(20)]
    planned = plan_tables(tables, 4, 1024)
    hot, wide = planned.plan.tables["hot"], planned.plan.tables["wide"]
    assert hot.kind in ("row", "column") and len(hot.ranks) > 1
    assert len(set(hot.ranks)) == len(hot.ranks)
    assert wide.kind == "column" and wide.columns[-1] == 256
    assert planned.imbalance <= 1.1
    specs = [embstore.TableSpec(t.name, t.dim) for t in tables]
    planned.plan.check(specs)  # a plan embstore.distributed.open accepts


def test_memory_limits_force_row_wise_splits_and_are_reported() -> None:
    big = TableProfile("big", 10**7, 16, 1.0)
    small = [TableProfile(f"s{i}", 10, 16, 1.0) for i in range(8)]
    planned = plan_tables([big, *small], 4, 1024, memory_per_rank=0.4 * big.memory)
    assert planned.plan.tables["big"].kind == "row"
    assert planned.memory.max() <= 0.4 * big.memory
    with pytest.raises(CapacityError, match="add ranks or memory"):
        plan_tables([big, *small], 2, 1024, memory_per_rank=0.3 * big.memory)


def test_reads_the_shape_of_the_published_statistics(tmp_path) -> None:
    stats = tmp_path / "locality_stats.txt"
    stats.write_text("fbgemm_t10_bs100_0.pt\nAvg # of indices: 5000\nAvg # of unique cols: 500\n"
                     "\nfbgemm_t10_bs100_1.pt\nAvg # of indices: 7000\n"
                     "Avg # of unique cols: 700\n")
    shape = _shard_plan.read_shape(stats)
    assert shape == {"tables": 10, "batch_size": 100, "lookups_per_sample": 6.0,
                     "unique_ratio": pytest.approx(0.1)}


def test_half_precision_tables_are_never_split_by_columns() -> None:
    # stochastic rounding draws bits by (id, column): a column shard would round otherwise
    wide = TableProfile("wide", 10**3, 256, 50.0)
    half = TableProfile("wide", 10**3, 256, 50.0, column_split=False)
    rest = [TableProfile(f"t{i}", 10**4, 32, 1.0) for i in range(20)]
    assert plan_tables([wide, *rest], 4, 1024).plan.tables["wide"].kind == "column"
    planned = plan_tables([half, *rest], 4, 1024)
    assert planned.plan.tables["wide"].kind in ("row", "table")
    specs = [embstore.TableSpec(t.name, t.dim, precision="fp16") for t in [half, *rest]]
    planned.plan.check(specs)
    by_columns = Placement("column", (0, 1), columns=(0, 128, 256))
    forced = Plan(4, {**planned.plan.tables, "wide": by_columns})
    with pytest.raises(ConfigError, match="fp16 weights, which cannot be sharded column-wise"):
        forced.check(specs)
