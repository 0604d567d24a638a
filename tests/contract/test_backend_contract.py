"""The contract every registered backend keeps. A new backends/<name>.py is tested here with no
edit to this file; tests that need a capability skip on the capability, never on a name.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from embstore import registry
from embstore.backend import Backend, BackendSpec
from embstore.errors import (
    BackendUnavailableError,
    ConfigError,
    DimensionMismatchError,
    DtypeMismatchError,
    InvalidIdsError,
    ReadOnlyError,
    StoreClosedError,
)

DIM = 8
EXTREME_IDS = np.array([0, 1, -1, 2**63 - 1, -(2**63), 2**31, -(2**31) - 1], dtype=np.int64)


def _open(name: str, path, *, table: str = "t", read_only: bool = False,
          dtype=np.float32) -> Backend:
    cls = registry.load_backend(name)
    return cls.open(BackendSpec(path=path, dim=DIM, dtype=dtype, table=table,
                                read_only=read_only))


@pytest.fixture(params=registry.backend_names(), ids=str)
def backend_name(request) -> str:
    try:
        registry.load_backend(request.param)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    return request.param


@pytest.fixture
def backend(backend_name, tmp_path):
    b = _open(backend_name, tmp_path / "tier")
    yield b
    b.close()


def _rows(n: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(dtype)


def test_an_unknown_option_is_a_config_error_and_creates_nothing(backend_name, tmp_path):
    cls = registry.load_backend(backend_name)
    with pytest.raises(ConfigError, match="no_such_option"):
        cls.open(BackendSpec(path=tmp_path / "tier", dim=DIM, table="t"), no_such_option=1)
    assert not (tmp_path / "tier").exists()


def test_put_then_get_returns_the_rows(backend):
    ids = np.arange(0, 5000, 3, dtype=np.int64) * 1_000_003
    rows = _rows(len(ids))
    backend.put(ids, rows)
    got, found = backend.get(ids)
    assert found.all()
    np.testing.assert_array_equal(got, rows)
    assert len(backend) == len(ids)


def test_get_of_absent_ids_reports_not_found_with_zero_rows(backend):
    backend.put(np.array([5], dtype=np.int64), _rows(1))
    got, found = backend.get(np.array([4, 5, 6], dtype=np.int64))
    assert found.tolist() == [False, True, False]
    assert not got[[0, 2]].any()


def test_extreme_int64_ids_round_trip(backend):
    rows = _rows(len(EXTREME_IDS), seed=1)
    backend.put(EXTREME_IDS, rows)
    got, found = backend.get(EXTREME_IDS[::-1].copy())
    assert found.all()
    np.testing.assert_array_equal(got, rows[::-1])


def test_put_overwrites_existing_rows(backend):
    ids = np.arange(100, dtype=np.int64)
    backend.put(ids, _rows(100, seed=1))
    new = _rows(50, seed=2)
    backend.put(ids[25:75].copy(), new)
    got, _ = backend.get(ids)
    np.testing.assert_array_equal(got[25:75], new)
    np.testing.assert_array_equal(got[:25], _rows(100, seed=1)[:25])
    assert len(backend) == 100


def test_get_with_duplicate_ids_returns_each(backend):
    rows = _rows(3)
    backend.put(np.array([10, 20, 30], dtype=np.int64), rows)
    got, found = backend.get(np.array([30, 10, 30, 30], dtype=np.int64))
    assert found.all()
    np.testing.assert_array_equal(got, rows[[2, 0, 2, 2]])


def test_delete_reports_which_ids_were_present(backend):
    ids = np.arange(10, dtype=np.int64)
    backend.put(ids, _rows(10))
    present = backend.delete(np.array([1, 3, 99], dtype=np.int64))
    assert present.tolist() == [True, True, False]
    assert len(backend) == 8
    assert backend.contains(np.array([1, 2, 3], dtype=np.int64)).tolist() == [False, True, False]
    _, found = backend.get(ids)
    assert found.sum() == 8


def test_deleted_id_can_be_written_again(backend):
    ids = np.arange(64, dtype=np.int64)
    backend.put(ids, _rows(64, seed=1))
    backend.delete(ids[::2].copy())
    backend.put(ids[::2].copy(), _rows(32, seed=5))
    got, found = backend.get(ids)
    assert found.all()
    np.testing.assert_array_equal(got[::2], _rows(32, seed=5))
    np.testing.assert_array_equal(got[1::2], _rows(64, seed=1)[1::2])


def test_ids_and_items_cover_every_row_once(backend):
    ids = np.random.default_rng(3).choice(10**9, size=3000, replace=False).astype(np.int64)
    rows = _rows(3000, seed=4)
    backend.put(ids, rows)
    assert sorted(backend.ids().tolist()) == sorted(ids.tolist())
    seen = {}
    for batch_ids, batch_rows in backend.items(batch_rows=700):
        for i, r in zip(batch_ids.tolist(), batch_rows, strict=True):
            assert i not in seen
            seen[i] = r
    assert len(seen) == 3000
    lookup = dict(zip(ids.tolist(), rows, strict=True))
    for i, r in seen.items():
        np.testing.assert_array_equal(r, lookup[i])


def test_put_does_not_retain_caller_buffer(backend):
    ids = np.arange(4, dtype=np.int64)
    rows = _rows(4)
    backend.put(ids, rows)
    expected = rows.copy()
    rows[:] = 123.0
    got, _ = backend.get(ids)
    np.testing.assert_array_equal(got, expected)


def test_get_returns_a_copy_the_caller_owns(backend):
    ids = np.arange(4, dtype=np.int64)
    backend.put(ids, _rows(4))
    got, _ = backend.get(ids)
    got[:] = 7.0
    again, _ = backend.get(ids)
    np.testing.assert_array_equal(again, _rows(4))


def test_empty_batches_are_accepted(backend):
    empty = np.zeros(0, dtype=np.int64)
    got, found = backend.get(empty)
    assert got.shape == (0, DIM) and found.shape == (0,)
    backend.put(empty, np.zeros((0, DIM), np.float32))
    assert backend.delete(empty).shape == (0,)
    assert len(backend) == 0


def test_noncontiguous_ids_and_rows_are_accepted(backend):
    ids = np.arange(20, dtype=np.int64)[::2]
    rows = _rows(20)[::2]
    backend.put(ids, rows)
    got, found = backend.get(ids)
    assert found.all()
    np.testing.assert_array_equal(got, rows)


@pytest.mark.parametrize("bad", [np.array([1.0]), np.array([[1]], dtype=np.int64),
                                 np.array([1], dtype=np.int32), [1, 2]])
def test_bad_ids_raise_and_change_nothing(backend, bad):
    with pytest.raises(InvalidIdsError):
        backend.put(bad, _rows(1))
    with pytest.raises(InvalidIdsError):
        backend.get(bad)
    assert len(backend) == 0


def test_wrong_row_dtype_or_shape_raises_and_changes_nothing(backend):
    ids = np.arange(2, dtype=np.int64)
    with pytest.raises(DtypeMismatchError):
        backend.put(ids, _rows(2).astype(np.float64))
    with pytest.raises(DimensionMismatchError):
        backend.put(ids, np.zeros((2, DIM + 1), np.float32))
    with pytest.raises(DimensionMismatchError):
        backend.put(ids, np.zeros((3, DIM), np.float32))
    assert len(backend) == 0


def test_every_call_after_close_raises(backend):
    assert not backend.is_closed
    backend.close()
    backend.close()  # idempotent
    assert backend.is_closed
    ids = np.arange(2, dtype=np.int64)
    for call in (lambda: backend.get(ids), lambda: backend.put(ids, _rows(2)),
                 lambda: backend.delete(ids), lambda: backend.contains(ids),
                 backend.ids, backend.flush, lambda: len(backend), backend.statistics,
                 lambda: list(backend.items())):
        with pytest.raises(StoreClosedError):
            call()


def test_statistics_report_rows_and_bytes(backend):
    backend.put(np.arange(10, dtype=np.int64), _rows(10))
    stats = backend.statistics()
    assert stats["backend"] == backend.name
    assert stats["rows"] == 10
    assert stats["bytes"] >= 10 * DIM * 4


# --- persistence --------------------------------------------------------------------------

def _require_persistence(name: str) -> None:
    if not registry.load_backend(name).supports_persistence:
        pytest.skip(f"{name} does not persist")


def test_flushed_rows_survive_reopen(backend_name, tmp_path):
    _require_persistence(backend_name)
    ids = np.arange(0, 3000, dtype=np.int64) * 17 - 5000
    rows = _rows(3000, seed=9)
    with _open(backend_name, tmp_path / "tier") as b:
        b.put(ids, rows)
        b.delete(ids[:10].copy())
        b.flush()
    with _open(backend_name, tmp_path / "tier") as b:
        got, found = b.get(ids)
        assert found.tolist() == [False] * 10 + [True] * 2990
        np.testing.assert_array_equal(got[10:], rows[10:])
        assert len(b) == 2990


def test_tables_sharing_a_directory_are_independent(backend_name, tmp_path):
    ids = np.arange(5, dtype=np.int64)
    a = _open(backend_name, tmp_path / "tier", table="a")
    b = _open(backend_name, tmp_path / "tier", table="b")
    try:
        a.put(ids, _rows(5, seed=1))
        b.put(ids[:2].copy(), _rows(2, seed=2))
        b.delete(ids[:1].copy())
        got, found = a.get(ids)
        assert found.all()
        np.testing.assert_array_equal(got, _rows(5, seed=1))
        assert len(b) == 1
    finally:
        a.close()
        b.close()


def test_read_only_backend_rejects_every_write(backend_name, tmp_path):
    _require_persistence(backend_name)
    ids = np.arange(3, dtype=np.int64)
    with _open(backend_name, tmp_path / "tier") as b:
        b.put(ids, _rows(3))
    with _open(backend_name, tmp_path / "tier", read_only=True) as b:
        with pytest.raises(ReadOnlyError):
            b.put(ids, _rows(3, seed=2))
        with pytest.raises(ReadOnlyError):
            b.delete(ids)
        got, found = b.get(ids)
        assert found.all()
        np.testing.assert_array_equal(got, _rows(3))


def test_a_read_only_handle_refreshed_sees_what_a_writer_in_another_process_flushed(
        backend_name, tmp_path):
    _require_persistence(backend_name)
    path = tmp_path / "tier"
    with _open(backend_name, path) as b:
        b.put(np.arange(3, dtype=np.int64), _rows(3))
    code = (f"import numpy as np\nfrom embstore import registry\n"
            f"from embstore.backend import BackendSpec\n"
            f"b = registry.load_backend({backend_name!r}).open(BackendSpec(path={str(path)!r}, "
            f"dim={DIM}, table='t'))\n"
            f"b.put(np.arange(3, 10), np.random.default_rng(5).standard_normal((7, {DIM}))"
            f".astype(np.float32))\nb.delete(np.array([0]))\nb.flush()\nb.close()\n")
    with _open(backend_name, path, read_only=True) as r:
        assert r.contains(np.arange(3, dtype=np.int64)).all()
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        r.refresh()
        got, found = r.get(np.arange(10, dtype=np.int64))
        assert found.tolist() == [False] + [True] * 9
        np.testing.assert_array_equal(got[3:], np.random.default_rng(5).standard_normal(
            (7, DIM)).astype(np.float32))
    with pytest.raises(StoreClosedError):
        r.refresh()


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_float_dtypes_round_trip(backend_name, tmp_path, dtype):
    ids = np.arange(50, dtype=np.int64)
    rows = _rows(50, dtype=dtype)
    with _open(backend_name, tmp_path / "tier", dtype=dtype) as b:
        b.put(ids, rows)
        got, found = b.get(ids)
        assert found.all() and got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, rows)
