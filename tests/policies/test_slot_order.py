"""The C radix order that keeps a policy's log independent of the order of ids in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from embstore.policies._tracked import slots_by_id


@pytest.mark.parametrize("ids", [
    np.arange(0, 50_000, 3),  # small ids: most digits shared and skipped
    np.array([5, -3, 2**62, -(2**63), 0, 2**63 - 1, -1]),  # the sign and both ends of int64
    np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64),
    np.array([7]),
    np.zeros(0, dtype=np.int64),
], ids=["small", "extremes", "random int64", "one", "empty"])
def test_slots_come_back_in_ascending_order_of_their_ids(ids: np.ndarray) -> None:
    rng = np.random.default_rng(2)
    ids = rng.permutation(np.unique(ids.astype(np.int64)))
    slots = rng.permutation(3 * len(ids) + 1)[: len(ids)].astype(np.int32)
    np.testing.assert_array_equal(slots_by_id(ids, slots), slots[np.argsort(ids)])
