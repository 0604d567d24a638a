"""Random kills under load (tests/crash/_soak.py): a mixed workload on a DRAM cache over each
persistent backend is SIGKILLed at random times, again and again on the same store; after each
kill fsck is clean and every row (weights and optimizer state) is as the last acknowledged
flush left it or as the step in progress made it. The README's suite kills rocksdb 4 times,
the slow job every backend 4 and 100 times; `python tests/crash/_soak.py 1000` runs a
thousand per backend.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _soak  # noqa: E402  (beside this file; tests/ is not a package)

pytestmark = pytest.mark.crash
BACKENDS = ["rocksdb", "lmdb", "pmem"]


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[] if b == "rocksdb" else
                                                  [pytest.mark.slow]) for b in BACKENDS])
def test_random_kills_under_load_lose_no_acknowledged_row(tmp_path, backend):
    tally = _soak.soak(tmp_path, backend, kills=4, seed=1)
    print(f"random kills {backend}: {tally}")
    assert tally["rows_wrong"] == 0 and tally["kills"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_100_random_kills_under_load_lose_no_acknowledged_row(tmp_path, backend):
    tally = _soak.soak(tmp_path, backend, kills=100, seed=2)
    print(f"random kills {backend}: {tally}")
    assert tally["rows_wrong"] == 0 and tally["kills"] == 100
    assert tally["acked_steps"] > 100  # the kills came under load, not only at startup
