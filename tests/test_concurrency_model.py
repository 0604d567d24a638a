"""Threads on one store end in the state of some serial order; a second writer process is
refused at once with the holder's pid.

Each of 8 threads runs a seeded mix of lookups, updates, gradient steps, deletes, flushes and
checkpoints on a DRAM cache over RocksDB: on its own ids (disjoint from the others') it keeps
a private in-memory store as its model, which the shared store must match bit for bit at
every lookup and at the end; on ids shared by all threads it writes rows that name the thread
and the operation, and each such id must end as the last write (or delete) of one of them.
CI runs 8 x 400 operations; the slow test 8 x 10,000.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import fsck
from embstore.errors import StoreLockedError

THREADS, OWN, SHARED, DIM = 8, 64, 32, 4
SPEC = embstore.TableSpec("t", dim=DIM, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1),
                          init=embstore.init.Uniform(-0.1, 0.1, seed=5))
SHARED_BASE = 1 << 20


def _worker(store: embstore.EmbeddingStore, k: int, ops: int, ckpt_dir: Path,
            last: dict[int, list[float | None]], errors: list[BaseException]) -> None:
    try:
        rng = np.random.default_rng(k)
        model = embstore.open(None, tables=[SPEC])
        own = np.arange(k * OWN, (k + 1) * OWN)
        shared_last: list[float | None] = [np.nan] * SHARED  # nan: never touched
        for op in range(ops):
            kind = rng.choice(["lookup", "update", "grad", "delete", "shared", "shared_del",
                               "flush", "checkpoint"],
                              p=[0.3, 0.15, 0.3, 0.05, 0.12, 0.03, 0.04, 0.01])
            ids = rng.choice(own, size=int(rng.integers(1, 9)))  # duplicates allowed
            if kind == "lookup":
                got = store.lookup("t", ids)
                want = model.lookup("t", ids)
                assert np.array_equal(got, want), f"thread {k} op {op}: lookup differs"
            elif kind == "update":
                rows = rng.standard_normal((len(ids), DIM)).astype(np.float32)
                store.update("t", ids, rows)
                model.update("t", ids, rows)
            elif kind == "grad":
                grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
                store.apply_gradients("t", ids, grads)
                model.apply_gradients("t", ids, grads)
            elif kind == "delete":
                store.delete("t", ids)
                model.delete("t", ids)
            elif kind in ("shared", "shared_del"):
                j = int(rng.integers(SHARED))
                tag = float(k * 1_000_000 + op)
                if kind == "shared":
                    store.update("t", [SHARED_BASE + j], np.full((1, DIM), tag, np.float32))
                    shared_last[j] = tag
                else:
                    store.delete("t", [SHARED_BASE + j])
                    shared_last[j] = None
            elif kind == "flush":
                store.flush()
            else:
                store.checkpoint(ckpt_dir / f"k{k}-op{op}", step=op)
        final_ids = own
        assert np.array_equal(store.lookup("t", final_ids), model.lookup("t", final_ids)), \
            f"thread {k}: final rows differ"
        assert np.array_equal(store.lookup_state("t", final_ids),
                              model.lookup_state("t", final_ids))
        last[k] = shared_last
        model.close()
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


def _run(tmp_path: Path, ops: int) -> None:
    tiers = [embstore.TierSpec("dram", capacity=THREADS * OWN // 4, eviction="lru"),
             embstore.TierSpec("rocksdb")]
    path = tmp_path / "s"
    last: dict[int, list[float | None]] = {}
    errors: list[BaseException] = []
    with embstore.open(path, tables=[SPEC], tiers=tiers) as store:
        threads = [threading.Thread(target=_worker,
                                    args=(store, k, ops, tmp_path, last, errors))
                   for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        final = store.lookup("t", SHARED_BASE + np.arange(SHARED))
        init = SPEC.init(SHARED_BASE + np.arange(SHARED), DIM, np.dtype(np.float32))
    for j in range(SHARED):
        # in a serial order the id ends as the last write of the thread whose op came last
        candidates = [last[k][j] for k in range(THREADS)
                      if not (isinstance(last[k][j], float) and np.isnan(last[k][j]))]
        row = final[j]
        if not candidates:
            assert np.array_equal(row, init[j])
        elif np.array_equal(row, init[j]):
            assert None in candidates, f"shared id {j}: deleted, yet no thread's last op was"
        else:
            assert row[0] in candidates and (row == row[0]).all(), \
                f"shared id {j}: {row} is no thread's last write {candidates}"
    assert fsck.check(path) == []
    for ckpt in tmp_path.glob("k*-op*"):
        assert fsck.check(ckpt) == []


def test_eight_threads_of_mixed_operations_end_in_a_serial_state(tmp_path):
    _run(tmp_path, 400)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 80,000 operations with checkpoints: minutes on two busy cores
def test_eight_threads_of_10000_mixed_operations_end_in_a_serial_state(tmp_path):
    _run(tmp_path, 10_000)


def test_a_second_writer_process_is_refused_at_once_naming_the_holder(tmp_path):
    path = tmp_path / "s"
    with embstore.open(path, tables=[SPEC], tiers=[embstore.TierSpec("rocksdb")]):
        code = ("import sys, embstore\n"
                "try:\n"
                "    embstore.open(sys.argv[1])\n"
                "except embstore.errors.StoreLockedError as exc:\n"
                "    print(exc.holder_pid, '|', exc)\n")
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                              text=True, timeout=60)
        pid, _, message = proc.stdout.partition("|")
        assert int(pid) == os.getpid(), proc.stdout + proc.stderr
        assert f"process {os.getpid()}" in message
        with pytest.raises(StoreLockedError, match="a handle of this process"):
            embstore.open(path)
