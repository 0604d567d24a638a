"""The C optimizer kernels (embstore/_fused.py) and the in-place step through a DRAM tier's slots.

- the kernels give the numpy rules' bits, for every rule with a kernel, decay mode and row
  length (short rows, SIMD bodies with tails, the pairwise sum's split above 128);
- `apply_gradients` on rows a DRAM top tier holds steps them in place through their slots,
  and the table is bit-identical to the one a DRAM cache over RocksDB (no in-place step for
  the rows it lacks) and a bare RocksDB chain give;
- bad input raises the embstore error and changes nothing, on the in-place path too.
"""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, _fused, optim
from embstore.errors import DtypeMismatchError, NonFiniteValueError
from embstore.hierarchy import TableChain

KERNEL_OPTIMIZERS = [
    optim.SGD(0.1),
    optim.SGD(0.1, weight_decay=0.05),
    optim.Adagrad(0.1),
    optim.Adagrad(0.1, weight_decay=0.05, initial_accumulator_value=0.1),
    optim.RowWiseAdagrad(0.05),
    optim.RowWiseAdagrad(0.05, weight_decay=0.02),
    optim.RowWiseAdagrad(0.05, weight_decay=0.02, weight_decay_mode="decoupled"),
]


@pytest.mark.parametrize("opt", KERNEL_OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("dim", [1, 7, 8, 20, 64, 128, 129, 300])
def test_kernel_gives_the_numpy_rules_bits(opt, dim) -> None:
    assert _fused.kernel_rule(opt, np.dtype(np.float32)) is not None
    rng = np.random.default_rng(dim)
    n = 50
    rows = rng.standard_normal((n, dim + opt.state_width(dim))).astype(np.float32)
    rows[:, dim:] = np.abs(rows[:, dim:])  # accumulators are sums of squares
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    expected = rows.copy()
    opt.step(expected[:, :dim], expected[:, dim:], grads)
    assert _fused.step_rows(opt, dim, rows, grads) == -1
    assert np.array_equal(rows.view(np.uint32), expected.view(np.uint32))


def test_kernel_reports_the_first_nonfinite_row() -> None:
    opt = optim.SGD(1.0)
    rows = np.zeros((4, 3), np.float32)
    grads = np.zeros((4, 3), np.float32)
    grads[2, 1] = 3e38
    rows[2, 1] = -3e38  # -3e38 - 3e38 overflows
    grads[3, 0] = np.inf
    assert _fused.step_rows(opt, 3, rows, grads) == 2


def test_no_kernel_for_adam_or_other_dtypes() -> None:
    assert _fused.kernel_rule(optim.Adam(), np.dtype(np.float32)) is None
    assert _fused.kernel_rule(optim.RowWiseAdagrad(), np.dtype(np.float64)) is None


def _spec(opt: optim.Optimizer) -> TableSpec:
    return TableSpec("t", dim=16, init=embstore.init.Uniform(-0.1, 0.1, seed=5), optimizer=opt)


def _table(store: embstore.EmbeddingStore) -> dict[int, bytes]:
    rows = {}
    for ids, weights, state in store.items("t"):
        for i, w, s in zip(ids.tolist(), weights, state, strict=True):
            rows[i] = w.tobytes() + s.tobytes()
    return rows


def _train(store: embstore.EmbeddingStore, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(10):
        ids = rng.integers(0, 300, 200)  # duplicates, and ids new and old
        store.apply_gradients("t", ids, rng.standard_normal((200, 16)).astype(np.float32))
        distinct = np.unique(ids)  # already distinct, as a trainer passes them
        store.apply_gradients("t", distinct,
                              rng.standard_normal((len(distinct), 16)).astype(np.float32))


@pytest.mark.parametrize("opt", [optim.RowWiseAdagrad(0.05), optim.Adagrad(0.1),
                                 optim.SGD(0.1, weight_decay=0.01), optim.Adam()], ids=repr)
def test_in_place_step_gives_the_bits_of_other_chains(tmp_path, monkeypatch, opt) -> None:
    calls = []
    put_top_slots = TableChain.put_top_slots

    def counting(self, ids, slots, rows):
        calls.append(len(ids))
        return put_top_slots(self, ids, slots, rows)

    monkeypatch.setattr(TableChain, "put_top_slots", counting)
    tables = {}
    for name, tiers in {
            "dram": [TierSpec("dram")],
            "dram-over-rocksdb": [TierSpec("dram", capacity=20, eviction="lru"),
                                  TierSpec("rocksdb")],
            "rocksdb": [TierSpec("rocksdb")]}.items():
        calls.clear()
        with embstore.open(tmp_path / name, tables=[_spec(opt)], tiers=tiers) as store:
            _train(store)
            tables[name] = _table(store)
            stats = store.tier_statistics("t")
        if name == "dram":
            assert calls, "the all-DRAM table never stepped rows in place"
        if name == "rocksdb":
            assert not calls
        assert stats[0].lookups == stats[0].hits + stats[0].misses
    assert tables["dram"] == tables["dram-over-rocksdb"] == tables["rocksdb"]


@pytest.mark.parametrize("opt", KERNEL_OPTIMIZERS[::2], ids=repr)
def test_long_shuffled_batches_step_in_slot_order_to_the_same_bits(opt) -> None:
    # batches past the kernel's sorting threshold (2,048 rows a range) are stepped in slot
    # order, not the batch's: each row must still get its own gradient
    rng = np.random.default_rng(11)
    ids = rng.permutation(30_000)[:12_000] * 7 + 3
    weights = rng.standard_normal((len(ids), 16)).astype(np.float32)
    with embstore.open(None, tables=[_spec(opt)]) as store:
        store.update("t", ids, weights)
        expected = np.hstack([weights, store.lookup_state("t", ids)])
        for _ in range(3):
            batch = rng.permutation(len(ids))
            grads = rng.standard_normal((len(ids), 16)).astype(np.float32)
            store.apply_gradients("t", ids[batch], grads)
            stepped = expected[batch]
            assert _fused.step_rows(opt, 16, stepped, grads) == -1
            expected[batch] = stepped
        got = np.hstack([store.lookup("t", ids), store.lookup_state("t", ids)])
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_in_place_step_counts_hits_and_marks_cache_rows_dirty(tmp_path) -> None:
    spec = _spec(optim.RowWiseAdagrad(0.05))
    tiers = [TierSpec("dram", capacity=100, eviction="lru"), TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=[spec], tiers=tiers) as store:
        ids = np.arange(10)
        store.apply_gradients("t", ids, np.ones((10, 16), np.float32))  # new rows: a put
        before = store.tier_statistics("t")[0]
        store.apply_gradients("t", ids, np.ones((10, 16), np.float32))  # held: in place
        after = store.tier_statistics("t")[0]
        assert after.hits - before.hits == 10 and after.misses == before.misses
        expected = store.lookup("t", ids).copy()
        state = store.lookup_state("t", ids).copy()
        store.flush()  # dirty rows reach the store of record
    with embstore.open(tmp_path / "s") as store:
        assert np.array_equal(store.lookup("t", ids), expected)
        assert np.array_equal(store.lookup_state("t", ids), state)


@pytest.mark.parametrize("tiers", [[TierSpec("dram")],
                                   [TierSpec("dram", capacity=50, eviction="lru"),
                                    TierSpec("rocksdb")]], ids=["dram", "dram-over-rocksdb"])
def test_bad_input_on_the_in_place_path_changes_nothing(tmp_path, tiers) -> None:
    spec = TableSpec("t", dim=4, optimizer=optim.SGD(1.0))
    with embstore.open(tmp_path / "s", tables=[spec], tiers=tiers) as store:
        ids = np.arange(6)
        store.update("t", ids, np.full((6, 4), 1.0, np.float32))
        before = store.lookup("t", ids).copy()
        nan = np.ones((6, 4), np.float32)
        nan[3, 2] = np.nan
        with pytest.raises(NonFiniteValueError):
            store.apply_gradients("t", ids, nan)
        with pytest.raises(DtypeMismatchError):
            store.apply_gradients("t", ids, np.ones((6, 4), np.float64))
        store.update("t", ids[4:5], np.full((1, 4), -3e38, np.float32))
        before = store.lookup("t", ids).copy()
        huge = np.zeros((6, 4), np.float32)
        huge[4] = 3e38  # -3e38 - 3e38 overflows in row 4 alone
        with pytest.raises(NonFiniteValueError, match="row 4 "):
            store.apply_gradients("t", ids, huge)
        assert np.array_equal(store.lookup("t", ids), before)


def test_update_in_place_keeps_the_last_row_of_each_id(tmp_path) -> None:
    tables = {}
    for name, tiers in {"dram": [TierSpec("dram")],
                        "dram-over-rocksdb": [TierSpec("dram", capacity=10, eviction="lru"),
                                              TierSpec("rocksdb")]}.items():
        spec = TableSpec("t", dim=5)
        rng = np.random.default_rng(3)
        with embstore.open(tmp_path / name, tables=[spec], tiers=tiers) as store:
            store.update("t", np.arange(40), np.zeros((40, 5), np.float32))
            ids = np.array([3, 7, 3, 9, 7, 3])
            rows = np.arange(30, dtype=np.float32).reshape(6, 5)
            store.update("t", ids, rows)
            got = store.lookup("t", np.array([3, 7, 9]))
            assert np.array_equal(got, rows[[5, 4, 3]])
            store.update("t", rng.integers(0, 40, 100),
                         rng.standard_normal((100, 5)).astype(np.float32))
            tables[name] = _table(store)
    assert tables["dram"] == tables["dram-over-rocksdb"]
