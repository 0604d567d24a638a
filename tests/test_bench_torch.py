"""`embstore bench torch --quick`: both parts run and print their ratios."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from embstore._parallel import available_cores  # noqa: E402
from embstore.tools.cli import main  # noqa: E402


def test_bench_torch_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "torch", "--quick"]) == 0
    out = capsys.readouterr().out
    for dist in ("uniform", "zipf"):
        assert f"ratio embstore/torch ({dist}):" in out
        assert f"ratio embstore/fbgemm ({dist}):" in out  # a ratio, or why it was skipped
    # timed once the DRAM tiers are full, so misses write evicted rows back as in a long run
    assert "filled the DRAM tiers to 100% of their rows" in out
    assert "ratio tiered pipelined / all-DRAM:" in out
    assert "ratio tiered in line / all-DRAM:" in out
    assert "ratio compute alone / all-DRAM:" in out
    assert "tables are identical" in out
    # cores busy: the process's CPU time over wall time, so within (0, the machine's cores]
    cores = available_cores()
    busy = {}
    for line in out.splitlines():
        m = re.match(r"\s+(tiered|all DRAM|compute)(.*?)\s{2,}[\d,]+\s+[\d.]+x\s+([\d.]+)$",
                     line)
        if m:
            busy[m.group(1) + m.group(2)] = float(m.group(3))
    assert len(busy) == 5, out
    assert all(0 < v <= cores + 0.05 for v in busy.values()), busy


def test_bench_torch_bad_parts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "torch", "--quick", "--parts", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--parts" in err and "unknown part 'nope'" in err
