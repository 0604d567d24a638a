"""Smoke test of `embstore bench backends`: it runs and prints a ratio per persistent backend."""

from __future__ import annotations

import re

import pytest

from embstore import registry
from embstore.tools._bench_backends import RAW
from embstore.tools.cli import main


def _benchmarked() -> list[str]:
    return [name for name in registry.available_backend_names() if name in RAW]


@pytest.mark.slow  # 13 s of the README's suite for a benchmark's printing (CI's slow job runs it)
def test_bench_backends_quick_prints_read_and_write_ratios_per_backend(
        capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "backends", "--quick"]) == 0
    out = capsys.readouterr().out
    names = _benchmarked()
    assert {"rocksdb", "lmdb"} <= set(names)
    for name in names:
        for op in ("read", "write"):
            row = re.search(rf"^\s+{name}\s+{op}\b.*?\s(\d+\.\d\d)x", out, re.MULTILINE)
            assert row, f"no {op} ratio for {name} in:\n{out}"
            assert float(row.group(1)) > 0
        assert re.search(rf"^{name}: flush of 1,000 scattered dirty rows wrote ", out,
                         re.MULTILINE)
