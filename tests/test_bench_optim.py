"""Smoke test of `embstore bench optim`: it runs, checks store against numpy, prints a ratio."""

from __future__ import annotations

import re

import pytest

from embstore.tools.cli import main


def test_bench_optim_quick_runs_and_prints_rates_and_ratio(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "optim", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "error" not in out
    assert re.search(r"embstore apply_gradients, DRAM tier\s+[\d,]+\s+\d+\.\d\dx", out)
    match = re.search(r"ratio store/numpy: (\d+\.\d\d)", out)
    assert match and float(match.group(1)) > 0


def test_bench_optim_profile_names_apply_gradients(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "optim", "--quick", "--profile"]) == 0
    assert "apply_gradients" in capsys.readouterr().out
