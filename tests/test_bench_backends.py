"""Smoke test of `embstore bench backends`: it runs and prints a ratio per persistent backend."""

from __future__ import annotations

import re

import pytest
from embstore.tools._bench_backends import RAW
from embstore.tools.cli import main

from embstore import registry
from embstore.errors import BackendUnavailableError


def _benchmarked() -> list[str]:
    names = []
    for name in registry.backend_names():
        if name not in RAW:
            continue
        try:
            registry.load_backend(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names


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
