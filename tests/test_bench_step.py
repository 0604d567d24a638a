"""Smoke test of `embstore bench step`: it runs, checks store against numpy, prints ids/s, the
ratio, and FBGEMM's figure as a reference measured elsewhere.
"""

from __future__ import annotations

import re

import pytest

from embstore.tools.cli import main


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
def test_bench_step_quick_prints_rates_ratio_and_reference(dist, capsys) -> None:
    assert main(["bench", "step", "--quick", "--dist", dist]) == 0
    out = capsys.readouterr().out
    assert "error" not in out
    assert re.search(r"embstore lookup\+apply_gradients, DRAM\s+[\d,]+\s+\d+\.\d\dx", out)
    assert re.search(r"ratio store/numpy: \d+\.\d\d", out)
    assert re.search(r"store step: \d+\.\d\dM ids/s", out)
    assert "reference measured elsewhere (not in this run): FBGEMM" in out
