"""Half-precision tables: 16-bit weights in every tier, float32 state, deterministic rounding."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

import embstore
from embstore._precision import RowCodec
from embstore.errors import ConfigError, NonFiniteValueError

BOTTOMS = ["dram", "rocksdb", "lmdb", "pmem"]
DIM = 8


def _spec(precision, **kw):
    kw.setdefault("optimizer", embstore.optim.RowWiseAdagrad(lr=0.05))
    return embstore.TableSpec("t", dim=DIM, precision=precision,
                              init=embstore.init.Uniform(-0.5, 0.5, seed=4), **kw)


def _open(path, precision, bottom, cache=None):
    tiers = [embstore.TierSpec(bottom)] if cache is None else [
        embstore.TierSpec("dram", capacity=cache), embstore.TierSpec(bottom)]
    return embstore.open(path if bottom != "dram" or cache else None,
                         tables=[_spec(precision)], tiers=tiers)


def _steps_from(store, first, last, seed=0):
    """`_train`'s steps first..last-1 (the draws of the earlier ones skipped)."""
    rng = np.random.default_rng(seed)
    for step in range(last):
        ids, grads = rng.integers(0, 200, 64), rng.standard_normal((64, DIM))
        if step >= first:
            store.lookup("t", ids)
            store.apply_gradients("t", ids, grads.astype(np.float32))


def _train(store, steps=30, seed=0):
    _steps_from(store, 0, steps, seed)


def _table(store):
    ids = np.arange(200)
    return store.lookup("t", ids, stored=True).copy(), store.lookup_state("t", ids).copy()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("bottom", BOTTOMS)
def test_rows_round_trip_at_their_precision_on_every_backend(tmp_path, precision, bottom):
    rows = np.random.default_rng(1).standard_normal((50, DIM)).astype(np.float32)
    codec = RowCodec("t", precision, DIM, 1)
    with _open(tmp_path / "s", precision, bottom) as store:
        store.update("t", np.arange(50), rows)
        got = store.lookup("t", np.arange(50))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, codec.quantize(rows))  # rounded to nearest
        stored = store.lookup("t", np.arange(50), stored=True)
        assert stored.dtype == (np.float16 if precision == "fp16" else np.uint16)
        # never-written ids read as their initializer rounded the same way
        fresh = store.lookup("t", np.array([1000, 1001]))
        np.testing.assert_array_equal(fresh, codec.quantize(
            embstore.init.Uniform(-0.5, 0.5, seed=4)(np.array([1000, 1001]), DIM,
                                                     np.dtype(np.float32))))
        store.apply_gradients("t", np.array([3]), np.ones((1, DIM), np.float32))
        state = store.lookup_state("t", np.array([3]))
        assert state.dtype == np.float32 and state[0, 0] == np.float32(1.0)  # exact, not 16-bit
    if bottom != "dram":
        with embstore.open(tmp_path / "s") as store:
            np.testing.assert_array_equal(store.lookup("t", np.arange(3)),
                                          codec.quantize(rows[:3]))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_training_is_bit_identical_across_tier_chains(tmp_path, precision):
    results = []
    for i, (bottom, cache) in enumerate([("dram", None), ("rocksdb", 20), ("pmem", 5)]):
        with _open(tmp_path / f"s{i}", precision, bottom, cache) as store:
            _train(store)
            results.append(_table(store))
    for other in results[1:]:
        np.testing.assert_array_equal(results[0][0], other[0])
        np.testing.assert_array_equal(results[0][1], other[1])


def _train_in_child(path, precision, queue):
    with _open(path, precision, "rocksdb", 10) as store:
        _train(store, steps=15)
        queue.put(_table(store)[0].view(np.uint16).tobytes())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_training_is_bit_identical_across_processes_and_reopens(tmp_path, precision):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_train_in_child, args=(str(tmp_path / "child"), precision, queue))
    child.start()
    theirs = queue.get(timeout=120)
    child.join(60)
    # here: the same 15 steps, but closed and reopened after 7 (the step count persists)
    path = tmp_path / "here"
    with _open(path, precision, "rocksdb", 10) as store:
        rng = np.random.default_rng(0)
        for step in range(15):
            if step == 7:
                store.close()
                store = embstore.open(path)
            ids = rng.integers(0, 200, 64)
            store.lookup("t", ids)
            store.apply_gradients("t", ids,
                                  rng.standard_normal((64, DIM)).astype(np.float32))
        assert _table(store)[0].view(np.uint16).tobytes() == theirs


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_table_added_at_a_reopen_keeps_the_step_counts_and_other_fields(tmp_path,
                                                                         precision):
    # the manifest written for the added table dropped the step counts, so the next steps
    # rounded with the seeds of step 0 on; a half-precision table's flush dropped every
    # field but tables and counts (a restore's origin, its step)
    with _open(None, precision, "dram") as ref:
        _train(ref, steps=10)
        want = _table(ref)
    with _open(tmp_path / "s", precision, "rocksdb", 20) as store:
        _steps_from(store, 0, 5)
        store.checkpoint(tmp_path / "c", step=5)
    embstore.restore(tmp_path / "c", tmp_path / "r")
    with embstore.open(tmp_path / "r", tables=[embstore.TableSpec("added", dim=4)]) as store:
        _steps_from(store, 5, 10)
        got = _table(store)
    doc = embstore.manifest.read_manifest(tmp_path / "r")
    assert doc["restored_from"]["step"] == 5 and doc["gradient_steps"] == {"t": 10}
    np.testing.assert_array_equal(got[0].view(np.uint16), want[0].view(np.uint16))
    np.testing.assert_array_equal(got[1], want[1])
    with _open(tmp_path / "again", precision, "rocksdb", 20) as store:
        _steps_from(store, 0, 5)
    embstore.open(tmp_path / "again", tables=[embstore.TableSpec("added", dim=4)]).close()
    with embstore.open(tmp_path / "again") as store:
        _steps_from(store, 5, 10)
        got = _table(store)
    np.testing.assert_array_equal(got[0].view(np.uint16), want[0].view(np.uint16))


@pytest.mark.parametrize("bottom", ["rocksdb", "lmdb", "pmem"])
def test_a_read_only_handles_checkpoint_records_the_step_count_of_its_rows(tmp_path, bottom):
    # a writer took steps after the reader opened: the checkpoint held their rows but the
    # count of the reader's open, so a restore rounded its next steps with the wrong seeds
    with _open(None, "fp16", "dram") as ref:
        _train(ref, steps=12)
        want = _table(ref)
    writer = _open(tmp_path / "s", "fp16", bottom, 16)
    _steps_from(writer, 0, 4)
    writer.flush()
    reader = embstore.open(tmp_path / "s", read_only=True)
    _steps_from(writer, 4, 8)
    writer.close()
    reader.checkpoint(tmp_path / "c")
    reader.close()
    assert embstore.manifest.read_manifest(tmp_path / "c")["gradient_steps"] == {"t": 8}
    with embstore.open(embstore.restore(tmp_path / "c", tmp_path / "r")) as store:
        _steps_from(store, 8, 12)
        got = _table(store)
    np.testing.assert_array_equal(got[0].view(np.uint16), want[0].view(np.uint16))


def test_stochastic_rounding_is_unbiased_and_seeded_by_step():
    codec = RowCodec("t", "fp16", 1, 0)
    w = np.full((20_000, 1), 1.0 + 2**-12, dtype=np.float32)  # a quarter of an fp16 ulp up
    ids = np.arange(20_000)
    up = codec.round_stochastic(w, ids, step=0).view(np.float16).astype(np.float64)
    assert set(np.unique(up)) == {1.0, 1.0 + 2**-10}
    assert abs(up.mean() - float(w[0, 0])) < 2e-5  # unbiased: E[rounded] == w
    again = codec.round_stochastic(w, ids, step=0)
    other = codec.round_stochastic(w, ids, step=1)
    assert np.array_equal(again.view(np.float16), up.astype(np.float16))
    assert not np.array_equal(other, again)
    bf = RowCodec("t", "bf16", 1, 0)
    wb = np.full((20_000, 1), 1.0 + 2**-9, dtype=np.float32)  # a quarter of a bf16 ulp up
    down_up = (bf.round_stochastic(wb, ids, step=3).astype(np.uint32) << 16).view(np.float32)
    assert abs(down_up.astype(np.float64).mean() - float(wb[0, 0])) < 2e-4


def test_small_updates_survive_stochastic_rounding():
    # steps smaller than half an ulp vanish with round-to-nearest, not on average here
    store = embstore.open(None, tables=[embstore.TableSpec(
        "t", dim=DIM, precision="bf16", optimizer=embstore.optim.SGD(lr=1.0))])
    ids = np.arange(2000)
    store.update("t", ids, np.ones((2000, DIM), np.float32))
    store.apply_gradients("t", ids, np.full((2000, DIM), 1e-3, np.float32))  # < ulp/2 (3.9e-3)
    moved = store.lookup("t", ids)
    assert (moved < 1).mean() > 0.1  # some rounded down a whole ulp
    assert abs(moved.mean() - (1 - 1e-3)) < 2e-4


def test_bad_precision_settings():
    with pytest.raises(ConfigError, match="precision"):
        embstore.TableSpec("t", dim=4, precision="fp8")
    with pytest.raises(ConfigError, match="float32"):
        embstore.TableSpec("t", dim=4, precision="fp16", dtype=np.float64)


@pytest.mark.parametrize(("precision", "big"), [("fp16", 1e6), ("bf16", 3.4e38)])
@pytest.mark.parametrize("how", ["update", "bulk_load"])
def test_half_precision_overflow_is_refused_and_changes_nothing(precision, big, how):
    # finite float32 weights beyond the format's range would round to infinity
    store = embstore.open(None, tables=[_spec(precision)])
    store.update("t", np.array([1]), np.ones((1, DIM), np.float32))
    with pytest.raises(NonFiniteValueError, match="float16" if precision == "fp16"
                       else "bfloat16"):
        getattr(store, how)("t", np.array([2, 1]), np.full((2, DIM), big, np.float32))
    np.testing.assert_array_equal(store.lookup("t", np.array([1])), 1)
    assert store.num_rows("t") == 1


def test_an_update_many_with_one_overflowing_table_changes_no_table():
    tables = [embstore.TableSpec("a", dim=DIM), _spec("fp16")]
    with embstore.open(None, tables=tables) as store:
        with pytest.raises(NonFiniteValueError, match="'t'.*float16"):
            store.update_many({"a": ([1], np.full((1, DIM), 7, np.float32)),
                               "t": ([1], np.full((1, DIM), 1e5, np.float32))})
        assert store.num_rows("a") == store.num_rows("t") == 0


def test_a_refused_half_precision_update_moves_no_row_between_tiers(tmp_path):
    with _open(tmp_path / "s", "fp16", "rocksdb", cache=50) as store:
        store.update("t", np.arange(200), np.ones((200, DIM), np.float32))
        before = [(s.lookups, s.hits, s.rows) for s in store.tier_statistics("t")]
        with pytest.raises(NonFiniteValueError, match="row 1 overflows"):
            store.update("t", np.array([1, 150]), np.full((2, DIM), 1e5, np.float32))
        assert [(s.lookups, s.hits, s.rows) for s in store.tier_statistics("t")] == before


def test_an_overflowing_row_an_update_overwrites_in_the_same_call_is_not_refused():
    with embstore.open(None, tables=[_spec("fp16")]) as store:
        rows = np.full((3, DIM), 2.0, np.float32)
        rows[0] = 1e5  # id 4's first row; its last (2.0) is the one written
        store.update("t", np.array([4, 5, 4]), rows)
        np.testing.assert_array_equal(store.lookup("t", np.array([4, 5])), 2.0)


def test_half_precision_halves_the_bytes_per_row(tmp_path):
    sizes = {}
    for precision in ("fp32", "fp16"):
        spec = embstore.TableSpec("t", dim=64, precision=precision)
        assert spec.storage_width * spec.storage_dtype.itemsize == (256 if precision == "fp32"
                                                                    else 128)
        with embstore.open(None, tables=[spec]) as store:
            store.update("t", np.arange(10_000), np.ones((10_000, 64), np.float32))
            sizes[precision] = store.tier_statistics("t")[0].bytes
    assert sizes["fp16"] < 0.6 * sizes["fp32"]


def test_a_float32_training_run_and_its_half_precision_twins_track_each_other():
    # a small regression: learn hidden per-id targets through row-wise Adagrad
    rng = np.random.default_rng(0)
    target = rng.standard_normal((500, DIM)).astype(np.float32) * 0.5
    losses = {}
    for precision in ("fp32", "fp16", "bf16"):
        store = embstore.open(None, tables=[embstore.TableSpec(
            "t", dim=DIM, precision=precision, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))])
        r = np.random.default_rng(1)
        for _ in range(300):
            ids = r.integers(0, 500, 256)
            w = store.lookup("t", ids)
            store.apply_gradients("t", ids, (w - target[ids]).astype(np.float32))
        final = store.lookup("t", np.arange(500))
        losses[precision] = float(np.mean((final - target) ** 2))
    assert losses["fp32"] < 0.05  # it learned
    assert abs(losses["fp16"] - losses["fp32"]) < 0.1 * losses["fp32"] + 1e-3
    assert abs(losses["bf16"] - losses["fp32"]) < 0.2 * losses["fp32"] + 5e-3


def test_bench_precision_quick_runs(capsys):
    from embstore.tools.cli import main

    assert main(["bench", "precision", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "apply_gradients" in out and "bf16" in out and "bytes per row" in out


def _reference_round(precision, w, ids=None, step=0, seed=0):
    """The rounding rules written with numpy alone: what the C kernel must give, bit for bit."""
    from embstore.init import hash_bits

    w = np.ascontiguousarray(w, dtype=np.float32)
    if ids is None:
        if precision == "fp16":
            with np.errstate(over="ignore"):
                return w.astype(np.float16).view(np.uint16)
        u = w.view(np.uint32).astype(np.uint64)
        out = ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1)))
               >> np.uint64(16)).astype(np.uint16)
        out[np.isnan(w)] = 0x7FC0
        return out
    bits = hash_bits(seed, ids, w.shape[1], stream=step)
    if precision == "bf16":
        u = w.view(np.uint32).astype(np.uint64)
        out = ((u + (bits >> np.uint64(48))) >> np.uint64(16)).astype(np.uint16)
        out[np.isnan(w)] = 0x7FC0
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        near = w.astype(np.float16)
        near32 = near.astype(np.float32)
        other = np.nextafter(near, np.where(near32 < w, np.float16(np.inf), np.float16(-np.inf)))
        gap = other.astype(np.float64) - near32
        p = np.where(gap != 0, (w.astype(np.float64) - near32) / gap, 0.0)
        draw = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)
        take = (draw < p) & np.isfinite(near32) & (near32 != w)
    return np.where(take, other, near).view(np.uint16)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_rounding_kernel_gives_the_bits_of_the_numpy_rules(precision):
    rng = np.random.default_rng(0)
    w = np.concatenate([
        rng.standard_normal((200, 16)) * 10.0 ** rng.integers(-9, 6, (200, 1)),
        np.array([[0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.0, 65520.0,
                   70000.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 6.1e-5, -6.1e-5, 1e-8, 1.0]]),
    ]).astype(np.float32)
    codec = RowCodec("t", precision, 16, 0)
    ids = np.arange(len(w)) * 7919 - 500
    np.testing.assert_array_equal(codec.round_nearest(w), _reference_round(precision, w))
    np.testing.assert_array_equal(codec.round_stochastic(w, ids, 9),
                                  _reference_round(precision, w, ids, 9, codec.seed))
    bits = codec.round_nearest(w)
    expected = (bits.view(np.float16).astype(np.float32) if precision == "fp16"
                else (bits.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_array_equal(codec.quantize(w), expected)
