"""A plan with per-rank tier chains, from the planner, opens each rank's shards on them."""

from __future__ import annotations

import copy
import math

import pytest

pytest.importorskip("torch", reason="embstore.distributed needs torch (the 'torch' extra)")

import _scenarios as sc  # noqa: E402

from embstore._tier_cost import DEFAULT_TIER_MODEL  # noqa: E402
from embstore.distributed import launch  # noqa: E402
from embstore.distributed.planner import TableProfile, plan_tables  # noqa: E402


@pytest.mark.timeout(120)
def test_a_planned_plan_opens_the_ranks_local_stores_with_its_tiers(tmp_path) -> None:
    # at the scenario's 40 ids per table, per-call latencies would dwarf every byte: without
    # them, small DRAM caches over RocksDB pay, and the test's caches evict
    model = copy.deepcopy(DEFAULT_TIER_MODEL)
    for tier in model["tiers"].values():
        for op in ("read", "write"):
            tier[op]["batch_latency_s"] = 0.0
    tables = [TableProfile(s.name, sc.ID_RANGE, s.dim, 2.0, state_width=s.row_width - s.dim)
              for s in sc.specs()]
    dram = 0.3 * sum(t.memory for t in tables) / 2
    report = plan_tables(tables, 2, 1, tier_budgets={"dram": dram, "rocksdb": math.inf},
                         tier_model=model)
    chains = [c for per in report.plan.tiers.values() for c in per.values()]
    assert sum([t.backend for t in c] == ["dram", "rocksdb"] for c in chains) >= 2
    assert any([t.backend for t in c] == ["rocksdb"] for c in chains)
    assert all(c[0].capacity is None or c[0].capacity < sc.ID_RANGE for c in chains)
    assert report.kinds()["row"] >= 1
    bad = launch.run(sc.tiered_plan, 2, str(tmp_path / "s"), report.plan.to_json(), 4,
                     timeout_s=100)
    assert bad == [[], []]
