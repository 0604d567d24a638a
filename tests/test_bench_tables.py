"""Smoke test of `embstore bench tables`: a tiny many-table run prints every phase and checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from embstore.tools.cli import main

STATS = Path(__file__).resolve().parent / "data" / "dlrm_datasets" / "2021" / "locality_stats.txt"
PHASES = ("create", "close (empty)", "reopen (empty)", "cold batch, batched calls",
          "batch, lookup_many + apply_gradients_many", "batch, per-table calls (baseline)",
          "flush", "close (trained)", "reopen (trained)")


def test_bench_tables_prints_every_phase_and_a_passing_spot_check(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["bench", "tables", "--quick", "--stats", str(STATS),
                 "--path", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert "8.35 lookups per sample per table" in out  # the numbered 2021 batches' mean
    assert re.search(r"^20 tables on dram:4096,rocksdb", out, re.MULTILINE)
    for phase in PHASES:
        assert re.search(rf"^\s+{re.escape(phase)}\s+\d+\.\d{{3}}\s+\d+\.\d\d", out,
                         re.MULTILINE), f"no {phase!r} in:\n{out}"
    assert re.search(r"KiB resident per empty table", out)
    share = re.search(r"(\d+\.\d)% outside the tables' work", out)
    assert share and 0 <= float(share.group(1)) < 100
    assert re.search(r"spot check after reopen: [\d,]+ trained rows and their state equal", out)


def test_bench_tables_json_gives_the_figures(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "tables", "--tables", "6", "--samples", "8", "--batches", "1",
                 "--tiers", "dram", "--stats", str(STATS), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "tables" and doc["exit_code"] == 0
    phases = doc["tables"][0]["rows"]
    assert [p["phase"] for p in phases] == list(PHASES)
    assert all(p["seconds"] > 0 for p in phases)
    figures = doc["tables"][1]["rows"][0]
    assert figures["tables"] == 6 and figures["spot_check"] is True
    assert 0 <= figures["outside_share"] < 1


@pytest.mark.parametrize("argv", [["--tables", "0"], ["--samples", "x"],
                                  ["--tiers", "dram:4096:lru,nosuch"]])
def test_bench_tables_refuses_bad_arguments_in_one_line(argv: list[str],
                                                        capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "tables", *argv]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1 and "error" in err
