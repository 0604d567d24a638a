"""Smoke test of `embstore bench cold`: cold and warm ratios, and the same rows for all."""

from __future__ import annotations

import os
import re

import pytest

from embstore.tools.cli import main


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_bench_cold_quick_prints_cold_and_warm_ratios(capsys: pytest.CaptureFixture,
                                                       tmp_path) -> None:
    where = tmp_path / "not yet made"
    assert main(["bench", "cold", "--quick", "--threads", "1,8", "--dir", str(where)]) == 0
    out = capsys.readouterr().out
    for cache in ("cold page cache", "warm page cache"):
        table = out[out.index(cache):]
        base = re.search(r"^\s+cold_read_threads=1 \[baseline\]\s+[\d,]+\s+1\.00x$", table,
                         re.MULTILINE)
        row = re.search(r"^\s+cold_read_threads=8\s+[\d,]+\s+\d+\.\d\dx$", table, re.MULTILINE)
        assert base and row, out
    assert "cold: every contender read the same rows" in out
    assert not any(where.iterdir())  # its table removed


@pytest.mark.parametrize("threads", ["0", "1,1", "x", "4,257"])
def test_bench_cold_refuses_bad_thread_counts(capsys: pytest.CaptureFixture, threads) -> None:
    assert main(["bench", "cold", "--threads", threads]) == 2
    assert "--threads" in capsys.readouterr().err
