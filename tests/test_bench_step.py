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


def test_bench_step_times_the_step_while_it_records_an_access_log(capsys) -> None:
    assert main(["bench", "step", "--quick", "--record-accesses", "1,0.01"]) == 0
    out = capsys.readouterr().out
    for rate in ("1", "0.01"):
        assert re.search(rf"store, recording at {rate}\s+[\d,]+\s+\d+\.\d\dx", out)
        line = re.search(rf"recording at {rate}: (\d+\.\d+) ms of the recorder a step = "
                         rf"(\d+\.\d+)% of the .* log (\d+\.\d) KiB a step", out)
        assert line and float(line.group(1)) > 0, out
    sizes = [float(x) for x in re.findall(r"log (\d+\.\d) KiB a step", out)]
    assert sizes[0] > 20 * sizes[1]  # a hundredth of the ids, plus the batch offsets
    assert main(["bench", "step", "--quick", "--record-accesses", "2"]) == 2
