"""The sharding tools: the planner's report and the sharded demo's benchmark."""

from __future__ import annotations

import json

import pytest

from embstore.tools import _shard_plan


def test_shard_plan_reports_imbalance_against_round_robin(tmp_path, capsys) -> None:
    stats = tmp_path / "locality_stats.txt"
    stats.write_text("fbgemm_t200_bs4096_0.pt\nAvg # of indices: 6840000\n"
                     "Avg # of unique cols: 900000\n")
    assert _shard_plan.main(["--stats", str(stats), "--world", "4", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["tables"] == 200
    for row in out["results"]:
        assert row["imbalance_planner"] <= min(1.1, row["imbalance_round_robin"])
        assert row["memory_max_over_budget_planner"] <= 1.0
    assert [row["world"] for row in out["tiered"]] == [4, 8]
    for row in out["tiered"]:  # the default budgets: dram=10%,pmem=40%,rocksdb=unbounded
        assert row["imbalance_planner"] <= min(1.1, row["imbalance_round_robin"])
        assert row["step_seconds_planner"] <= row["step_seconds_round_robin"]
        assert row["tier_max_over_budget_planner"] <= 1.0
        assert set(row["budgets"]) == {"dram", "pmem", "rocksdb"}


def test_shard_plan_answers_bad_budgets_with_one_line(tmp_path, capsys) -> None:
    stats = tmp_path / "locality_stats.txt"
    stats.write_text("fbgemm_t20_bs64_0.pt\nAvg # of indices: 6000\nAvg # of unique cols: 900\n")
    assert _shard_plan.main(["--stats", str(stats), "--world", "2",
                             "--budget", "tape=1GiB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'tape'" in err and "Traceback" not in err


@pytest.mark.slow  # 9 s of the README's suite for a benchmark's printing (CI's slow job runs it)
@pytest.mark.timeout(180)
def test_bench_shard_trains_at_one_and_two_processes(capsys) -> None:
    pytest.importorskip("torch")
    from embstore.tools import _bench_shard

    assert _bench_shard.main(["--nproc", "1", "2", "--steps", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["nproc"] for r in rows] == [1, 2]
    assert rows[0]["bytes_per_step"] == 0 and rows[0]["steps_per_s"] > 0
    assert rows[1]["bytes_per_step"] >= rows[1]["min_bytes_per_step"] > 0


@pytest.mark.parametrize("text", [
    "fbgemm_t20_bs64_0.pt\nAvg # of indices: 6000\n",                            # no unique
    "no trace name\nAvg # of indices: 6000\nAvg # of unique cols: 900\n",         # no _t_bs
    "fbgemm_t0_bs64_0.pt\nAvg # of indices: 6000\nAvg # of unique cols: 900\n",   # 0 tables
    "fbgemm_t20_bs64_0.pt\nAvg # of indices: 0\nAvg # of unique cols: 0\n",       # 0 indices
])
def test_shard_plan_answers_bad_statistics_with_one_line(tmp_path, capsys, text) -> None:
    stats = tmp_path / "locality_stats.txt"
    stats.write_text(text)
    assert _shard_plan.main(["--stats", str(stats), "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(stats) in err and "Traceback" not in err


def test_shard_plan_answers_a_binary_statistics_file_with_one_line(tmp_path, capsys) -> None:
    stats = tmp_path / "locality_stats.txt"
    stats.write_bytes(b"\xff\xfe\x00Avg # of indices")
    assert _shard_plan.main(["--stats", str(stats), "--world", "2"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
