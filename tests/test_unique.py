"""The sort-based distinct-id helpers equal numpy's np.unique, which they replace on hot paths."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from embstore._unique import unique_first, unique_sorted

_ids = st.one_of(
    hnp.arrays(np.int64, st.integers(0, 300), elements=st.integers(-(2**63), 2**63 - 1)),
    hnp.arrays(np.int64, st.integers(0, 300), elements=st.integers(-5, 5)),  # many repeats
    hnp.arrays(np.int32, st.integers(0, 300), elements=st.integers(0, 40)),
)


@settings(max_examples=300, deadline=None)
@given(_ids)
def test_unique_sorted_equals_np_unique(values: np.ndarray) -> None:
    got = unique_sorted(values)
    want = np.unique(values)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@settings(max_examples=300, deadline=None)
@given(_ids)
def test_unique_first_gives_each_values_first_position(values: np.ndarray) -> None:
    got, first = unique_first(values)
    want, want_first = np.unique(values, return_index=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(first, want_first)
    assert first.dtype == want_first.dtype


def test_a_two_dimensional_array_is_flattened_as_np_unique_does() -> None:
    values = np.array([[3, 1], [3, 2]], dtype=np.int64)
    np.testing.assert_array_equal(unique_sorted(values), [1, 2, 3])
    np.testing.assert_array_equal(unique_first(values)[1], [1, 3, 0])
