"""The slot API (`SupportsSlots`) that cache tiers rely on, for every registered backend that
has it; the others skip, saying so. A new backend file is tested here with no edit.
"""

from __future__ import annotations

import numpy as np
import pytest

from embstore import registry
from embstore.backend import BackendSpec, SupportsSlots
from embstore.errors import (
    BackendUnavailableError,
    DimensionMismatchError,
    DtypeMismatchError,
    StoreClosedError,
)

DIM = 4


@pytest.fixture(params=registry.backend_names(), ids=str)
def backend(request, tmp_path):
    try:
        cls = registry.load_backend(request.param)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    b = cls.open(BackendSpec(path=tmp_path / "tier", dim=DIM, table="t"))
    if not isinstance(b, SupportsSlots):
        b.close()
        pytest.skip(f"the {request.param} backend has no slot API (SupportsSlots)")
    yield b
    b.close()


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM), dtype=np.float32)


def test_put_with_slots_reports_slots_and_insertions_that_reads_agree_with(backend):
    ids = np.array([7, -3, 11], dtype=np.int64)
    slots, inserted = backend.put_with_slots(ids, _rows(3, 0))
    assert inserted.tolist() == [True, True, True]
    assert len(set(slots.tolist())) == 3
    again, inserted = backend.put_with_slots(np.array([11, 5], dtype=np.int64), _rows(2, 1))
    assert inserted.tolist() == [False, True]
    assert again[0] == slots[2]  # a rewritten row keeps its slot
    rows, found, got_slots = backend.get_with_slots(np.array([7, -3, 11, 5, 99], np.int64))
    assert found.tolist() == [True, True, True, True, False]
    np.testing.assert_array_equal(got_slots[:4], [slots[0], slots[1], again[0], again[1]])
    assert got_slots[4] == -1
    np.testing.assert_array_equal(backend.rows_at(got_slots[:4]), rows[:4])
    np.testing.assert_array_equal(rows[2], _rows(2, 1)[0])


def test_put_with_slots_rejects_bad_rows_and_changes_nothing(backend):
    ids = np.array([1, 2], dtype=np.int64)
    with pytest.raises(DtypeMismatchError):
        backend.put_with_slots(ids, _rows(2, 0).astype(np.float64))
    with pytest.raises(DimensionMismatchError):
        backend.put_with_slots(ids, np.zeros((2, DIM + 1), dtype=np.float32))
    assert len(backend) == 0 and not backend.contains(ids).any()


def test_slot_api_refuses_a_closed_backend(backend):
    slots, _ = backend.put_with_slots(np.array([1], dtype=np.int64), _rows(1, 0))
    backend.close()
    with pytest.raises(StoreClosedError):
        backend.rows_at(slots)
    with pytest.raises(StoreClosedError):
        backend.put_with_slots(np.array([2], dtype=np.int64), _rows(1, 0))
