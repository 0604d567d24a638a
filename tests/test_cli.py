"""The `embstore` command line, called through `main(argv)`."""

from __future__ import annotations

import json

import numpy as np
import pytest

import embstore
from embstore.tools.cli import main


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "s"
    tables = [embstore.TableSpec("user", dim=4), embstore.TableSpec("item", dim=2)]
    with embstore.open(path, tables=tables) as store:
        store.update("user", np.arange(10), np.ones((10, 4), np.float32))
    return path


def test_info_prints_tables_tiers_rows_and_bytes(store_path, capsys):
    assert main(["info", str(store_path)]) == 0
    out = capsys.readouterr().out
    assert "table user: dim 4" in out and "10 rows" in out
    assert "table item: dim 2" in out and "tier 0 dram" in out


def test_info_json_reports_rows_per_table_and_tier(store_path, capsys):
    assert main(["info", "--json", str(store_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tables"]["user"]["rows"] == 10
    assert info["tables"]["item"]["rows"] == 0
    (tier,) = info["tables"]["user"]["tiers"]
    assert tier["backend"] == "dram" and tier["rows"] == 10 and tier["bytes"] >= 10 * 16


def test_info_on_a_missing_store_exits_2_with_the_reason(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nothing")]) == 2
    assert "no embstore store" in capsys.readouterr().err


def test_info_beside_a_writer_describes_the_store(store_path, capsys):
    with embstore.open(store_path):
        assert main(["info", "--json", str(store_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["read_only"] and info["tables"]["user"]["rows"] == 10


@pytest.mark.parametrize("bench", ["lookup", "update"])
def test_bench_quick_prints_a_ratio_against_numpy(bench, capsys):
    assert main(["bench", bench, "--quick"]) == 0
    out = capsys.readouterr().out
    assert "[baseline]" in out
    ratio_lines = [line for line in out.splitlines() if "embstore" in line]
    assert ratio_lines and ratio_lines[0].rstrip().endswith("x")


def test_info_json_shows_the_counters_of_every_session_after_a_reopen(tmp_path, capsys):
    path = tmp_path / "s"
    tiers = [embstore.TierSpec("dram", capacity=5), embstore.TierSpec("lmdb")]
    for _ in range(2):
        with embstore.open(path, tables=[embstore.TableSpec("t", dim=4)], tiers=tiers) as store:
            store.update("t", np.arange(20), np.ones((20, 4), np.float32))
            store.lookup("t", np.arange(30))
            store.checkpoint(tmp_path / f"ckpt{_}", step=7 + _)
    assert main(["info", "--json", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    top, bottom = info["tables"]["t"]["tiers"]
    assert top["lookups"] == 0  # this (read-only) session's own counters
    assert top["cumulative"]["lookups"] == 60 and top["cumulative"]["evictions"] > 0
    assert top["cumulative"]["hits"] + top["cumulative"]["misses"] == 60
    assert bottom["cumulative"]["lookups"] > 0 and top["cumulative"]["writebacks"] > 0
    assert info["last_flush"] is not None and info["last_checkpoint"]["step"] == 8
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "lookups 60" in out and "last checkpoint" in out and "(step 8)" in out


def test_bench_json_prints_the_figures_as_one_document(capsys):
    assert main(["bench", "lookup", "--quick", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "lookup" and doc["exit_code"] == 0
    (table,) = doc["tables"]
    assert table["rows"][0]["ratio"] == 1.0 and all(r["rows_per_s"] > 0 for r in table["rows"])


def test_quick_keeps_the_sizes_given_beside_it(capsys, tmp_path):
    # --quick set its own sizes over those given, unsaid
    assert main(["bench", "lookup", "--quick", "--rows", "30000"]) == 0
    assert "loaded 30,000 rows" in capsys.readouterr().out
    assert main(["bench", "lookup", "--rows", "30000", "--quick", "--repeats", "2"]) == 0
    assert "loaded 30,000 rows" in capsys.readouterr().out
    assert main(["bench", "lookup", "--quick"]) == 0
    assert "loaded 20,000 rows" in capsys.readouterr().out  # its own where none is given
    out = tmp_path / "tiers.json"
    assert main(["bench", "tiers", "--quick", "--tiers", "dram", "--large", "1024", "--rows",
                 "3000", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["tiers"]["dram"]["read"]["bytes_per_s"] > 0
