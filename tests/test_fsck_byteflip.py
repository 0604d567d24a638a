"""Byte-flip campaigns: every flip that changes a row, a key or a header is flagged by fsck,
and fsck never crashes (see tests/_byteflip.py for how a flip is judged).

The default run samples a few hundred bytes of lmdb and pmem; `-m slow` samples rocksdb too,
flips every byte of a small store and 1,000 random bytes of a larger one, and prints the
detection rates.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, fsck

sys.path.insert(0, str(Path(__file__).parent))
import _byteflip  # noqa: E402

PERSISTENT = ["rocksdb", "lmdb", "pmem"]


def _make(path: Path, bottom: str, rows: int) -> Path:
    # a bounded pmem bottom tier keeps the slot file small (its capacity sizes the file)
    bottom_tier = TierSpec(bottom, capacity=rows + 8) if bottom == "pmem" else TierSpec(bottom)
    tables = [TableSpec("t", dim=4, num_embeddings=10 * rows)]
    rng = np.random.default_rng(rows)
    with embstore.open(path, tables=tables, tiers=[bottom_tier]) as store:
        store.update("t", np.arange(rows), rng.standard_normal((rows, 4)).astype(np.float32))
        store.delete("t", np.arange(0, rows, 7))
        store.update("t", np.arange(0, rows, 5), np.ones((len(range(0, rows, 5)), 4),
                                                         np.float32))
    return path


def _report(name: str, tally: _byteflip.Tally) -> None:
    print(f"\n{name}: {tally.flips} flips, {tally.changed} change a row/key/header, "
          f"{tally.detected} detected ({100 * tally.rate:.2f}%), {tally.flagged_benign} "
          f"benign flips flagged, {tally.crashes} native crashes; missed {tally.missed[:10]}")


def _real_fsck_survives(store: Path, flips: list[tuple[str, int]]) -> None:
    """Flips that crashed a native reader: the real fsck (reader in a child) reports them."""
    for f, off in flips:
        raw = (store / f).read_bytes()
        (store / f).write_bytes(raw[:off] + bytes([raw[off] ^ 0xFF]) + raw[off + 1:])
        try:
            findings = fsck.check(store)
        finally:
            (store / f).write_bytes(raw)
        assert findings and fsck.exit_code(findings) == 4, (f, off)


# rocksdb (12 s) in the slow job, whose exhaustive flips cover it too
@pytest.mark.parametrize("bottom", [pytest.param(b, marks=pytest.mark.slow) if b == "rocksdb" else b
                                    for b in PERSISTENT])
def test_sampled_flips_of_a_small_store_are_all_detected(tmp_path, bottom):
    store = _make(tmp_path / "s", bottom, rows=20)
    # most of a small LMDB file is free pages (about 2% of its bytes hold rows, keys or
    # headers): enough flips that some land on them whatever the layout
    tally = _byteflip.campaign(store, _byteflip.random_bytes(store, 600, seed=1))
    _report(f"{bottom} sampled", tally)
    assert tally.changed > 0
    assert tally.missed == []


@pytest.mark.slow
@pytest.mark.timeout(1800)  # thousands of flips, each checked in a child: past the suite's 600 s
@pytest.mark.parametrize("bottom", PERSISTENT)
def test_every_byte_of_a_small_store(tmp_path, bottom):
    store = _make(tmp_path / "s", bottom, rows=20)
    tally = _byteflip.campaign(store, _byteflip.every_byte(store), timeout=3600)
    _report(f"{bottom} every byte", tally)
    assert tally.missed == []
    _real_fsck_survives(store, tally.crash_flips[:5])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("bottom", PERSISTENT)
def test_a_thousand_random_bytes_of_a_larger_store(tmp_path, bottom):
    store = _make(tmp_path / "s", bottom, rows=5000)
    tally = _byteflip.campaign(store, _byteflip.random_bytes(store, 1000, seed=2),
                               timeout=3600)
    _report(f"{bottom} 1000 random bytes", tally)
    assert tally.missed == []
    _real_fsck_survives(store, tally.crash_flips[:5])
