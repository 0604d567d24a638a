"""The same calls give bit-identical tables whatever the tier chain, capacity, policy or run."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, registry

CHAINS = {
    "all-dram": [TierSpec("dram")],
    "tiny-dram-over-rocksdb": [TierSpec("dram", capacity=8, eviction="lru"), TierSpec("rocksdb")],
    "pmem-over-lmdb": [TierSpec("pmem", capacity=40, eviction="clock"), TierSpec("lmdb")],
    "dram-pmem-rocksdb": [
        TierSpec("dram", capacity=5, eviction="s3fifo", admission="second_hit"),
        TierSpec("pmem", capacity=30, eviction="lfu", admission="frequency"),
        TierSpec("rocksdb")],
    "lmdb-only": [TierSpec("lmdb")],
}


def _train_and_digest(path, tiers, optimizer: str) -> str:
    spec = TableSpec("t", dim=6, init=embstore.init.Normal(0, 0.1, seed=3),
                     optimizer=embstore.optim.from_config(optimizer, {}))
    rng = np.random.default_rng(42)
    with embstore.open(path, tables=[spec], tiers=tiers) as store:
        for step in range(12):
            ids = rng.integers(0, 120, 64)  # many duplicates per batch
            grads = rng.standard_normal((64, 6)).astype(np.float32)
            store.apply_gradients("t", ids, grads)
            if step % 4 == 3:
                store.update("t", ids[:5], rng.standard_normal((5, 6)).astype(np.float32))
                store.delete("t", ids[5:8])
                store.flush()
        digest = hashlib.sha256()
        rows = {}
        for ids, weights, state in store.items("t"):
            for i, w, s in zip(ids.tolist(), weights, state, strict=True):
                rows[i] = w.tobytes() + s.tobytes()
        for i in sorted(rows):
            digest.update(i.to_bytes(8, "little", signed=True) + rows[i])
        return digest.hexdigest()


def _usable(tiers) -> bool:
    return all(t.backend in registry.available_backend_names() for t in tiers)


@pytest.mark.parametrize("optimizer", embstore.optim.optimizer_names())
def test_every_chain_gives_the_same_bits(tmp_path, optimizer):
    digests = {name: _train_and_digest(tmp_path / name, tiers, optimizer)
               for name, tiers in CHAINS.items() if _usable(tiers)}
    assert len(digests) >= 3
    assert len(set(digests.values())) == 1, digests


def test_another_process_gives_the_same_bits(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_determinism as t; "
            "print(t._train_and_digest(sys.argv[2], t.CHAINS['tiny-dram-over-rocksdb'], 'adam'))")
    out = subprocess.run([sys.executable, "-c", code, str(__import__("pathlib").Path(__file__)
                                                           .parent), str(tmp_path / "child")],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == _train_and_digest(tmp_path / "here", CHAINS["all-dram"], "adam")
