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


def test_info_on_a_locked_store_exits_2(store_path, capsys):
    with embstore.open(store_path):
        assert main(["info", str(store_path)]) == 2
    assert "open in another process" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["lookup", "update"])
def test_bench_quick_prints_a_ratio_against_numpy(bench, capsys):
    assert main(["bench", bench, "--quick"]) == 0
    out = capsys.readouterr().out
    assert "[baseline]" in out
    ratio_lines = [line for line in out.splitlines() if "embstore" in line]
    assert ratio_lines and ratio_lines[0].rstrip().endswith("x")
