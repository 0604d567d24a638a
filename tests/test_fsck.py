"""fsck finds damage the store would otherwise only meet on a read, and nothing in a healthy
store; it ends the stress tests as their oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, fsck
from embstore.tools.cli import main


@pytest.mark.parametrize("bottom", ["dram", "rocksdb", "lmdb", "pmem"])
def test_a_healthy_store_has_no_findings(tmp_path, bottom):
    tiers = [TierSpec("dram", capacity=10), TierSpec(bottom)]
    rng = np.random.default_rng(0)
    with embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=4, num_embeddings=500)],
                       tiers=tiers) as store:
        for _ in range(20):
            ids = rng.integers(0, 500, 30)
            store.apply_gradients("t", ids, rng.standard_normal((30, 4)).astype(np.float32))
            store.delete("t", ids[:3])
        assert fsck.check(store) == []
    assert fsck.check(tmp_path / "s") == []
    assert main(["fsck", str(tmp_path / "s")]) == 0


def test_a_damaged_lmdb_value_is_reported_with_its_table(tmp_path, capsys):
    path = tmp_path / "s"
    with embstore.open(path, tables=[TableSpec("t", dim=4)], tiers=[TierSpec("lmdb")]) as store:
        store.update("t", np.arange(50), np.full((50, 4), 1.25, np.float32))
    data = path / "tier0-lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    needle = np.full(4, 1.25, np.float32).tobytes()
    at = raw.find(needle)
    assert at > 0
    raw[at + 2] ^= 0x01
    data.write_bytes(bytes(raw))
    findings = fsck.check(path)
    assert findings and findings[0].table == "t" and "checksum" in findings[0].message
    assert main(["fsck", str(path)]) == 1
    assert "checksum" in capsys.readouterr().out


def test_a_missing_store_is_one_finding(tmp_path):
    (finding,) = fsck.check(tmp_path / "none")
    assert finding.table is None and "cannot open" in finding.message
