"""Hypothesis runs random tier chains (every backend and policy, tiny capacities) beside a plain
dict model: every lookup must equal the model bit for bit, nothing may be lost on eviction,
and flush + reopen must restore the model exactly.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import embstore
from embstore import TableSpec, TierSpec, fsck, registry

BACKENDS = registry.available_backend_names()
EVICTIONS = registry.policy_names("eviction")
ADMISSIONS = registry.policy_names("admission")
OPTIMIZERS = embstore.optim.optimizer_names()
ID_POOL = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, 2**63 - 1, -(2**63), 123456789012]
DIM = 3

cache_tier = st.builds(
    TierSpec, backend=st.sampled_from(BACKENDS), capacity=st.integers(1, 6),
    eviction=st.sampled_from(EVICTIONS), admission=st.sampled_from(ADMISSIONS),
)
chains = st.tuples(st.lists(cache_tier, min_size=0, max_size=2), st.sampled_from(BACKENDS))
id_batches = st.lists(st.sampled_from(ID_POOL), min_size=0, max_size=12)


class StoreAgainstDict(RuleBasedStateMachine):
    """The store and a dict of full rows (weights + optimizer state) receive the same calls."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="embstore-model-"))
        self.store: embstore.EmbeddingStore | None = None
        self.model: dict[int, np.ndarray] = {}

    @initialize(chain=chains, optimizer=st.sampled_from(OPTIMIZERS))
    def open_store(self, chain, optimizer) -> None:
        caches, bottom = chain
        self.spec = TableSpec("t", dim=DIM, init=embstore.init.Uniform(-1, 1, seed=5),
                              optimizer=embstore.optim.from_config(optimizer, {}))
        self.tiers = [*caches, TierSpec(bottom)]
        self.store = embstore.open(self.dir / "s", tables=[self.spec], tiers=self.tiers)

    def teardown(self) -> None:
        if self.store is not None:
            assert fsck.check(self.store) == []  # fsck is the oracle: a clean bill at the end
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _model_rows(self, ids: np.ndarray) -> np.ndarray:
        width = self.spec.row_width
        out = np.empty((len(ids), width), dtype=np.float32)
        init = self.spec.init(ids, DIM, np.dtype(np.float32))
        state0 = self.spec.optimizer.initial_state(1, DIM, np.dtype(np.float32))
        for k, i in enumerate(ids.tolist()):
            if i in self.model:
                out[k] = self.model[i]
            else:
                out[k, :DIM] = init[k]
                out[k, DIM:] = state0[0]
        return out

    @rule(ids=id_batches)
    def lookup(self, ids) -> None:
        ids = np.array(ids, dtype=np.int64)
        expected = self._model_rows(ids)
        np.testing.assert_array_equal(self.store.lookup("t", ids), expected[:, :DIM])
        np.testing.assert_array_equal(self.store.lookup_state("t", ids), expected[:, DIM:])

    @rule(ids=id_batches, seed=st.integers(0, 2**16))
    def update(self, ids, seed) -> None:
        ids = np.array(ids, dtype=np.int64)
        rows = np.random.default_rng(seed).uniform(-2, 2, (len(ids), DIM)).astype(np.float32)
        current = self._model_rows(ids)
        self.store.update("t", ids, rows)
        for k, i in enumerate(ids.tolist()):
            full = current[k].copy() if i not in self.model else self.model[i].copy()
            full[:DIM] = rows[k]
            self.model[i] = full

    @rule(ids=id_batches, seed=st.integers(0, 2**16))
    def apply_gradients(self, ids, seed) -> None:
        ids = np.array(ids, dtype=np.int64)
        grads = np.random.default_rng(seed).uniform(-1, 1, (len(ids), DIM)).astype(np.float32)
        self.store.apply_gradients("t", ids, grads)
        # the model: sum each id's gradients in position order, then one step per id
        order = list(dict.fromkeys(ids.tolist()))
        summed = np.zeros((len(order), DIM), dtype=np.float32)
        for k, i in enumerate(ids.tolist()):
            summed[order.index(i)] += grads[k]
        full = self._model_rows(np.array(order, dtype=np.int64))
        self.spec.optimizer.step(full[:, :DIM], full[:, DIM:], summed)
        for k, i in enumerate(order):
            self.model[i] = full[k]

    @rule(ids=id_batches)
    def delete(self, ids) -> None:
        ids = np.array(ids, dtype=np.int64)
        present = {i for i in ids.tolist() if i in self.model}
        assert self.store.delete("t", ids) == len(present)
        for i in present:
            del self.model[i]

    @rule()
    def flush(self) -> None:
        self.store.flush()

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = embstore.open(self.dir / "s")

    @precondition(lambda self: self.store is not None)
    @rule()
    def stored_rows_match_the_model(self) -> None:
        assert self.store.num_rows("t") == len(self.model)
        seen = {}
        for ids, weights, state in self.store.items("t"):
            for k, i in enumerate(ids.tolist()):
                seen[i] = np.concatenate([weights[k], state[k]])
        assert set(seen) == set(self.model)
        for i, row in seen.items():
            np.testing.assert_array_equal(row, self.model[i])


TestStoreAgainstDict = StoreAgainstDict.TestCase
