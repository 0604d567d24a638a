"""Every error path of the public API: the right class from embstore.errors, a message that
says what to do, and no change to the store.
"""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec
from embstore import errors as E


def _store(**kw) -> embstore.EmbeddingStore:
    return embstore.open(None, tables=[TableSpec("t", dim=3, **kw)])


def _snapshot(store: embstore.EmbeddingStore) -> dict[int, list[float]]:
    out = {}
    for ids, weights, _ in store.items("t"):
        out.update(zip(ids.tolist(), weights.tolist(), strict=True))
    return out


ROWS = np.ones((2, 3), np.float32)


class _NoArray:
    """An array-like whose conversion raises, as a torch tensor that requires grad does."""

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("Can't call numpy() on Tensor that requires grad")


BAD_IDS = [
    (np.array([1.0, 2.0]), "integers"),
    (np.array([True, False]), "integers"),
    (np.array([[1, 2]]), "1-D"),
    (np.array([2**63], dtype=np.uint64), "does not fit"),
    (np.array(["a", "b"]), "integers"),
    (np.array([1, None], dtype=object), "integers"),
    (5, "scalar"),
    (np.ma.masked_array([1, 2], mask=[False, True]), "masked"),  # its mask would go unseen
    (None, "NoneType"),
    ({1, 2}, "set"),
    ((i for i in (1, 2)), "generator"),
    ([-1, 2**63], "9223372036854775808 does not fit"),  # numpy reads floats: astype wraps
    ([1, 2**70], "does not fit in int64"),  # numpy reads objects
    (_NoArray(), "requires grad"),
    ([3, True], "True or False"),  # numpy reads [3, 1]
    ((np.int64(3), np.bool_(False)), "True or False"),
    ([3, np.array(True)], "True or False"),
]


@pytest.mark.parametrize(("ids", "words"), BAD_IDS, ids=lambda v: str(v)[:20])
def test_bad_ids_raise_invalid_ids_and_change_nothing(ids, words):
    store = _store()
    store.update("t", [1, 2], ROWS)
    before = _snapshot(store)
    for call in (lambda: store.lookup("t", ids), lambda: store.update("t", ids, ROWS),
                 lambda: store.apply_gradients("t", ids, ROWS), lambda: store.delete("t", ids)):
        with pytest.raises(E.InvalidIdsError, match=words):
            call()
    assert _snapshot(store) == before


def test_ids_outside_num_embeddings_are_rejected():
    store = _store(num_embeddings=10)
    for ids in ([0, 10], [-1, 3]):
        with pytest.raises(E.InvalidIdsError, match=r"outside \[0, 10\)"):
            store.update("t", ids, ROWS)
    assert store.num_rows("t") == 0
    store.update("t", [0, 9], ROWS)
    assert store.num_rows("t") == 2


@pytest.mark.parametrize(("rows", "cls"), [
    (np.ones((2, 3), np.float64), E.DtypeMismatchError),
    (np.ones((2, 4), np.float32), E.DimensionMismatchError),
    (np.ones((3, 3), np.float32), E.InvalidValuesError),
    (np.ones(3, np.float32), E.DimensionMismatchError),
    ([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], E.InvalidValuesError),
    (np.array([[1, np.nan, 1], [1, 1, 1]], np.float32), E.NonFiniteValueError),
    (np.array([[1, 1, 1], [np.inf, 1, 1]], np.float32), E.NonFiniteValueError),
    (np.array([[1, 1, 1], [1, 1, -np.inf]], np.float32), E.NonFiniteValueError),
    (np.asfortranarray([[1, 1, np.nan], [1, 1, 1]], np.float32), E.NonFiniteValueError),
    (np.ma.masked_invalid(np.array([[1, np.nan, 1], [1, 1, 1]], np.float32)),
     E.InvalidValuesError),
    (np.ma.masked_array(np.ones((2, 3), np.float32), mask=True), E.InvalidValuesError),
])
def test_bad_rows_and_gradients_raise_and_change_nothing(rows, cls):
    store = _store()
    store.update("t", [1, 2], ROWS)
    before = _snapshot(store)
    with pytest.raises(cls):
        store.update("t", [1, 2], rows)
    with pytest.raises(cls):
        store.apply_gradients("t", [1, 2], rows)
    assert _snapshot(store) == before


def test_nonfinite_values_are_kept_where_the_table_allows_them():
    store = _store(allow_nonfinite=True)
    rows = np.array([[np.nan, np.inf, -np.inf]], np.float32)
    store.update("t", [4], rows)
    np.testing.assert_array_equal(store.lookup("t", [4]), rows)


@pytest.mark.parametrize(("value", "precision", "shown"), [
    (float("nan"), "fp32", "nan in float32"), (1e40, "fp32", "inf in float32"),
    (1e5, "fp16", "inf in float16")])
def test_a_new_table_whose_initial_value_it_forbids_is_refused(tmp_path, value, precision,
                                                               shown):
    # rows never written read as their initial value: a NaN there would reach the caller
    spec = TableSpec("t", dim=4, init=embstore.init.Constant(value), precision=precision)
    with pytest.raises(E.ConfigError, match=shown):
        embstore.open(None, tables=[spec])
    with pytest.raises(E.ConfigError, match=shown):
        embstore.open(tmp_path / "s", tables=[spec])
    assert not (tmp_path / "s").exists()
    allowed = TableSpec("t", dim=4, init=embstore.init.Constant(value), precision=precision,
                        allow_nonfinite=True)
    with embstore.open(None, tables=[allowed]) as store:
        assert not np.isfinite(store.lookup("t", np.array([3]))).any()


@pytest.mark.parametrize(("init", "precision", "shown"), [
    (embstore.init.Uniform(-1e5, 1e5, seed=0), "fp16", "inf in float16"),
    (embstore.init.Normal(0.0, 2e38, seed=1), "fp32", "inf in float32"),
    (embstore.init.Normal(0.0, 4e37, seed=1), "fp32", "inf in float32"),
    (embstore.init.Constant(3.4e38), "bf16", "inf in bfloat16"),  # finite in float32
    (embstore.init.Normal(0.0, 1e308, seed=1), "fp32", "inf in float32")])
def test_an_init_refused_by_its_range_not_by_the_row_of_id_zero(init, precision, shown):
    # id 0's row was all that was checked: these gave it finite values, and other ids inf
    with pytest.raises(E.ConfigError, match=shown):
        embstore.open(None, tables=[TableSpec("t", dim=1, init=init, precision=precision)])


def test_a_float64_uniform_whose_span_overflows_is_refused():
    # low and high are finite, high - low is not: every value was inf or NaN
    with pytest.raises(E.ConfigError, match="can give"):
        embstore.open(None, tables=[TableSpec("t", dim=2, dtype=np.float64,
                                              init=embstore.init.Uniform(-1.7e308, 1.7e308))])


def test_an_init_within_range_gives_finite_rows_for_every_id():
    # the widest Normal the check lets through in float16: 8.572 standard deviations
    init = embstore.init.Normal(0.0, 65504 / 8.6, seed=3)
    with embstore.open(None, tables=[TableSpec("t", dim=8, init=init,
                                               precision="fp16")]) as store:
        assert np.isfinite(store.lookup("t", np.arange(200_000))).all()


def test_a_stored_table_with_such_an_initial_value_still_opens(tmp_path):
    # made before the check: its manifest holds the spec, and the store must stay readable
    from embstore.manifest import read_manifest, write_manifest

    with embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=2)]) as store:
        store.update("t", np.arange(2), np.ones((2, 2), np.float32))
    doc = read_manifest(tmp_path / "s")
    doc["tables"][0]["init"] = {"name": "constant", "config": {"value": float("nan")}}
    write_manifest(tmp_path / "s", doc)
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store.lookup("t", np.arange(2)), np.ones((2, 2)))


class _Failing(embstore.init.Initializer):
    name = "failing_for_test"
    listed = False  # registered (every initializer is), but no name users see

    def __call__(self, ids, dim, dtype):
        raise ZeroDivisionError("no rows here")

    def config(self):
        return {}


def test_an_init_that_fails_on_a_new_table_is_a_config_error():
    with pytest.raises(E.ConfigError, match="failed on one row.*ZeroDivisionError"):
        embstore.open(None, tables=[TableSpec("t", dim=2, init=_Failing())])


def test_an_optimizer_step_that_overflows_writes_nothing():
    store = _store(optimizer=embstore.optim.SGD(lr=1e30))
    store.update("t", [1], ROWS[:1])
    with pytest.raises(E.NonFiniteValueError, match="nothing was written"):
        store.apply_gradients("t", [1], np.full((1, 3), 1e30, np.float32))
    np.testing.assert_array_equal(store.lookup("t", [1]), ROWS[:1])


def test_a_seed_up_to_uint64_stays_valid_for_stores_made_with_one(tmp_path):
    spec = TableSpec("t", dim=2, init=embstore.init.Uniform(seed=2**63 + 5))
    embstore.open(tmp_path / "s", tables=[spec]).close()
    with embstore.open(tmp_path / "s") as store:
        assert store.table_spec("t").init.seed == 2**63 + 5


def test_an_os_error_inside_a_store_names_the_file(tmp_path, monkeypatch):
    embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=2)]).close()
    manifest = tmp_path / "s" / "MANIFEST.json"

    def refuse(directory):
        raise PermissionError(13, "Permission denied", str(manifest))
    monkeypatch.setattr(embstore._open, "read_manifest", refuse)
    with pytest.raises(E.StorageIOError, match=r"Permission denied \(.*MANIFEST\.json\)"):
        embstore.open(tmp_path / "s")


def test_a_tier_capacity_may_be_a_numpy_integer_and_is_kept_as_an_int():
    tier = TierSpec("dram", capacity=np.int64(5))
    assert tier.capacity == 5 and type(tier.capacity) is int
    with pytest.raises(E.ConfigError, match="capacity"):
        TierSpec("dram", capacity=np.bool_(True))


def test_a_closed_store_cannot_enter_a_with_block():
    store = _store()
    store.close()
    with pytest.raises(E.StoreClosedError), store:
        pass


def test_unknown_table_names_the_known_ones():
    store = _store()
    with pytest.raises(E.UnknownTableError, match=r"\['t'\]"):
        store.lookup("nope", [1])
    with pytest.raises(LookupError):
        store.update("nope", [1], ROWS[:1])
    for name in (["t"], {"t": 1}, None, 1):  # unhashable names too
        with pytest.raises(E.UnknownTableError, match="table names are str"):
            store.lookup(name, [1])


def test_memoryview_ids_read_as_the_array_they_view():
    store = _store()
    store.update("t", [1, 2], ROWS * 2)
    np.testing.assert_array_equal(store.lookup("t", memoryview(np.array([2, 1]))), ROWS * 2)


def test_a_byte_swapped_table_names_its_own_dtype_to_convert_to():
    store = _store(dtype=">f4")
    with pytest.raises(E.DtypeMismatchError, match=r"astype\('>f4'\)"):
        store.update("t", [1, 2], ROWS)


def test_items_refuses_a_page_size_that_is_no_whole_number():
    store = _store()
    store.update("t", [1, 2], ROWS)
    for bad in (1.5, None, "3", True, 0):
        with pytest.raises(E.ConfigError, match="batch_rows"):
            store.items("t", batch_rows=bad)
    assert sum(len(ids) for ids, _, _ in store.items("t", batch_rows=np.int64(1))) == 2


@pytest.mark.parametrize("state", [[[1.0, 1.0, 1.0], [1.0]], _NoArray()],
                         ids=["ragged", "no-array"])
def test_bulk_load_refuses_a_state_that_is_no_array(state):
    store = _store(optimizer=embstore.optim.Adagrad())
    with pytest.raises(E.InvalidValuesError, match="state"):
        store.bulk_load("t", [1, 2], ROWS, state=state)
    assert store.num_rows("t") == 0


@pytest.mark.parametrize(("args", "words"), [
    ((b"/tmp/x",), "decode it first"),
    ((5,), "path must be"),
    ((None, TableSpec("t", dim=2)), "wrap one"),
    ((None, {"t": TableSpec("t", dim=2)}), "tables must be a list"),
    ((None, 5), "tables must be a list"),
    ((None, [TableSpec("t", dim=2)], TierSpec("dram")), "wrap one"),
    ((None, [TableSpec("t", dim=2, dtype=np.float16, optimizer=embstore.optim.Adam())]),
     "Adam needs a float32 or float64 table"),
    (("/tmp/a\0b", [TableSpec("t", dim=2)]), "NUL byte"),
])
def test_open_refuses_arguments_of_the_wrong_kind(tmp_path, args, words):
    with pytest.raises(E.ConfigError, match=words):
        embstore.open(*args)


@pytest.mark.parametrize("read_only", ["no", 1, None])
def test_read_only_must_be_a_bool(tmp_path, read_only):
    embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=2)]).close()
    with pytest.raises(E.ConfigError, match="read_only must be True or False"):
        embstore.open(tmp_path / "s", read_only=read_only)


@pytest.mark.parametrize(("where", "words"), [("file/s", "is not a directory"),
                                               ("x" * 300, "too long")])
def test_a_path_the_os_refuses_is_a_storage_io_error_and_leaves_nothing(tmp_path, where,
                                                                         words):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(E.StorageIOError, match=words):
        embstore.open(tmp_path / where, tables=[TableSpec("t", dim=2)])
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize("make", [
    lambda: TableSpec("t", dim=0),
    lambda: TableSpec("t", dim=2.5),
    lambda: TableSpec("bad/name", dim=2),
    lambda: TableSpec("t", dim=2, dtype=np.int32),
    lambda: TableSpec("t", dim=2, dtype="not-a-dtype"),
    lambda: TableSpec("t", dim=2, num_embeddings=0),
    lambda: TableSpec("t", dim=2, init=lambda ids: ids),
    lambda: TierSpec("dram", capacity=0),
    lambda: TierSpec("dram", capacity="12 parsecs"),
    lambda: embstore.init.Uniform(1, 0),
    lambda: embstore.init.Normal(0, -1),
    lambda: embstore.optim.SGD(lr=-1),
    lambda: TableSpec("t\n", dim=2),  # a name ending in a newline (it names files)
    lambda: TableSpec("t", dim=2, allow_nonfinite="no"),
    lambda: TableSpec("t", dim=2, dtype=None),
    lambda: TableSpec("t", dim=2, num_embeddings=2**70),
    lambda: TableSpec("t", dim=2**33),  # rows beyond what a backend stores as one value
    lambda: TableSpec("t", dim=2**28, optimizer=embstore.optim.Adam()),  # 3 GiB with state
    lambda: TableSpec("t", dim=2, tiers=TierSpec("dram")),
    lambda: TableSpec.from_json({"name": "t"}),
    lambda: TierSpec("dram", capacity=10**30),
    lambda: TierSpec("dram", capacity="99999999TiB"),
    lambda: TierSpec("dram", options=[1]),
    lambda: TierSpec("rocksdb", options={"sync_writes": {True}}),  # not JSON: no manifest
    lambda: TierSpec("dram", capacity=4, eviction_options={"window": {0.1}}),
    lambda: TierSpec("lmdb", options={"sync_commits": float("nan")}),  # NaN != NaN on reopen
    lambda: TierSpec("dram", capacity="9" * 400),  # beyond any float
    lambda: TableSpec("t", dim=4, precision=np.array("fp16")),  # unhashable, not JSON
    lambda: TableSpec("t", dim=4, dtype=("f4", -1)),  # numpy's own ValueError
    lambda: TableSpec("t", dim=4, init=_NumpyConfig()),
    lambda: embstore.optim.RowWiseAdagrad(weight_decay_mode=np.array("decoupled")),
    lambda: embstore.optim.SGD(lr=10**400),
    lambda: embstore.optim.Adagrad(eps=10**400),
    lambda: embstore.optim.SGD(lr=np.timedelta64(1)),
    lambda: embstore.init.Constant(10**400),
    lambda: embstore.init.Uniform(-10**400, 1),
    lambda: TierSpec("dram", capacity=4, eviction_options=None),
    lambda: TierSpec("dram", capacity=4, eviction=5),
    lambda: TierSpec.from_json({"backend": "dram", "size": 4}),
    lambda: embstore.optim.SGD(lr=None),
    lambda: embstore.optim.SGD(lr="x"),
    lambda: embstore.optim.Adam(betas=None),
    lambda: embstore.optim.Adam(amsgrad="no"),  # was truthy: AMSGrad on
    lambda: embstore.optim.from_config("sgd", {"learning_rate": 0.1}),
    lambda: embstore.init.Uniform(low="a"),
    lambda: embstore.init.Uniform(seed=1.5),  # was cut to 1
    lambda: embstore.init.Uniform(seed=2**64),  # gave the rows of seed 0
    lambda: embstore.init.Normal(seed=-(2**63) - 1),
    lambda: embstore.init.Normal(std=None),
    lambda: embstore.init.Constant("x"),
    lambda: embstore.init.from_config("uniform", None),
])
def test_invalid_specs_raise_config_error(make):
    with pytest.raises(E.ConfigError):
        make()


class _NumpyConfig(embstore.init.Initializer):
    """A user's initializer whose settings are numpy scalars, which JSON cannot keep."""

    name = "numpy_config_for_test"
    listed = False

    def __call__(self, ids, dim, dtype):
        return np.zeros((len(ids), dim), dtype)

    def config(self):
        return {"value": np.float32(0.5)}


def test_settings_are_kept_as_the_manifest_keeps_them(tmp_path):
    options = {"sync_commits": True, "shape": (1, 2)}
    tier = TierSpec("lmdb", options=options)
    options["sync_commits"] = np.bool_(False)  # the caller's dict changes after: not the spec
    assert tier.options == {"sync_commits": True, "shape": [1, 2]}
    # numpy scalars in options are numbers as capacity and dim take them (they were refused)
    assert TierSpec("rocksdb", options={"block_cache_bytes": np.int64(1 << 20)}).options == {
        "block_cache_bytes": 1 << 20}
    assert type(TierSpec("dram", capacity=8, eviction="wtinylfu", eviction_options={
        "window_share": np.float32(0.25)}).eviction_options["window_share"]) is float
    spec = TableSpec("t", dim=4, num_embeddings=np.int64(100), precision=np.str_("fp16"))
    assert type(spec.num_embeddings) is int and type(spec.precision) is str
    nan_init = TableSpec("n", dim=2, init=embstore.init.Constant(float("nan")),
                         allow_nonfinite=True)
    with embstore.open(tmp_path / "s", tables=[spec, nan_init]) as store:
        store.update("t", np.arange(2), np.ones((2, 4), np.float32))
    # the same specs reopen it: each equals what the manifest kept (NaN included)
    with embstore.open(tmp_path / "s", tables=[spec, nan_init]) as store:
        assert store.lookup("t", np.arange(2)).sum() == 8
        assert np.isnan(store.lookup("n", np.arange(1))).all()


def test_adding_a_table_whose_spec_json_cannot_keep_changes_nothing(tmp_path):
    with embstore.open(tmp_path / "s", tables=[TableSpec("a", dim=4)]):
        pass
    files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "s").rglob("*"))
    with pytest.raises(E.ConfigError, match="JSON"):
        embstore.open(tmp_path / "s", tables=[TableSpec("b", dim=4, init=_NumpyConfig())])
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "s").rglob("*")) == files
    with embstore.open(tmp_path / "s", tables=[TableSpec("b", dim=8)]) as store:
        assert store.lookup("b", np.arange(1)).shape == (1, 8)


def test_unknown_backend_and_policy_names_are_config_errors(tmp_path):
    with pytest.raises(E.UnknownNameError, match="unknown backend 'tape'; registered"):
        embstore.open(None, tables=[TableSpec("t", dim=2)], tiers=[TierSpec("tape")])
    with pytest.raises(E.UnknownNameError, match="unknown policy 'nope'"):
        embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=2)],
                      tiers=[TierSpec("dram", capacity=4, eviction="nope"), TierSpec("lmdb")])
    assert not list(tmp_path.iterdir())  # the failed create left nothing behind


@pytest.mark.parametrize("tier", [
    lambda: TierSpec("dram", capacity=4, eviction="lru", eviction_options={"seed": -1}),
    lambda: TierSpec("dram", capacity=4, admission="frequency",
                     admission_options={"threshold": 1.5}),
    lambda: TierSpec("dram", capacity=4, options=[("chunk_rows_log2", 4)]),
    lambda: TierSpec("pmem", capacity="99999999TiB"),
])
def test_bad_tier_settings_are_config_errors_and_leave_nothing(tmp_path, tier):
    with pytest.raises(E.ConfigError):
        embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=2)],
                      tiers=[tier(), TierSpec("lmdb")])
    assert not list(tmp_path.iterdir())


def test_duplicate_table_names_are_rejected():
    with pytest.raises(E.ConfigError, match="unique"):
        embstore.open(None, tables=[TableSpec("t", dim=2), TableSpec("t", dim=3)])


def test_backend_needing_a_directory_in_a_memory_store_is_a_config_error():
    with pytest.raises(E.ConfigError, match="needs a directory"):
        embstore.open(None, tables=[TableSpec("t", dim=2)], tiers=[TierSpec("rocksdb")])


def test_an_unavailable_backend_says_what_to_install(monkeypatch):
    from embstore import registry

    sources = dict(registry._sources("backends"))
    sources["ghost"] = "embstore_no_such_dependency_xyz"
    monkeypatch.setattr(registry, "_sources", lambda kind: sources)
    with pytest.raises(E.BackendUnavailableError, match="pip install") as info:
        registry.load_backend("ghost")
    assert isinstance(info.value, ImportError)


def test_missing_store_without_tables_is_store_not_found(tmp_path):
    with pytest.raises(E.StoreNotFoundError, match="no embstore store"):
        embstore.open(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


def test_a_file_or_a_foreign_directory_is_refused(tmp_path):
    file = tmp_path / "file"
    file.write_text("hello")
    with pytest.raises(E.StoreNotFoundError, match="is a file"):
        embstore.open(file, tables=[TableSpec("t", dim=2)])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.bin").write_bytes(b"x")
    with pytest.raises(E.StoreNotFoundError, match="not an embstore store"):
        embstore.open(foreign, tables=[TableSpec("t", dim=2)])
    assert sorted(p.name for p in foreign.iterdir()) == ["data.bin"]


@pytest.mark.parametrize("content", [b"{not json", b'{"format": "other"}',
                                     b'{"format": "embstore", "version": 99}'])
def test_damaged_manifest_is_a_corrupt_store_error(tmp_path, content):
    path = tmp_path / "s"
    embstore.open(path, tables=[TableSpec("t", dim=2)]).close()
    (path / "MANIFEST.json").write_bytes(content)
    with pytest.raises(E.CorruptStoreError):
        embstore.open(path)


def test_damaged_dram_snapshot_is_detected_on_open(tmp_path):
    from embstore.backends import dram

    path = tmp_path / "s"
    with embstore.open(path, tables=[TableSpec("t", dim=2)]) as store:
        store.update("t", np.arange(10), np.ones((10, 2), np.float32))
    snap = path / "tier0-dram" / "t.dram"
    pristine = snap.read_bytes()
    for offset in (0, dram.OFFSET_CRC_BODY, dram.OFFSET_IDS + 3, len(pristine) - 1):
        data = bytearray(pristine)
        data[offset] ^= 0x10
        snap.write_bytes(bytes(data))
        with pytest.raises(E.CorruptStoreError):
            embstore.open(path)
    snap.write_bytes(pristine[:-4])
    with pytest.raises(E.CorruptStoreError, match="truncated"):
        embstore.open(path)


def test_every_error_class_derives_from_the_base():
    for name in E.__all__:
        cls = getattr(E, name)
        assert issubclass(cls, E.EmbstoreError), name


def test_a_size_that_is_no_size_says_what_each_reader_takes():
    from embstore.spec import parse_bytes

    with pytest.raises(E.ConfigError, match="whole number of bytes") as info:
        parse_bytes("12 parsecs")
    assert "row" not in str(info.value)  # budgets and byte options take bytes alone
    with pytest.raises(E.ConfigError, match="rows as an int"):
        TierSpec("dram", capacity="12 parsecs")  # a capacity takes rows too
