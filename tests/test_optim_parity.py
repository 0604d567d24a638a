"""Every fused optimizer against torch, step by step, plus determinism and settings checks.

Two torch references, because no single one has the store's semantics for every row:

- dense: an nn.Embedding (sparse=False) and torch.optim.X over the whole table. torch steps
  every row at every step (a zero gradient still moves Adam's moments and count, and still
  applies weight decay), so it is the reference only for rows touched at every step, where a
  per-row count equals torch's per-tensor count.
- per-row: one torch parameter and one torch optimizer per row, stepped only when the row is
  in the batch. This is the store's lazy semantics exactly (a row's state, step count and decay
  advance only when the row gets a gradient), computed by torch's own code, so it checks every
  row, including rows touched at some steps only. torch.optim.SparseAdam is not used: it keeps
  one step count per tensor and has no weight decay, so it disagrees with per-row counts on
  intermittent rows by design.

Both references get their gradient from nn.Embedding's backward, which sums the gradients of
duplicate ids; embstore sums them itself, in position order. torch has no
row-wise Adagrad, so `TorchRowWiseAdagrad` below writes FBGEMM's rule in torch ops.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import numpy as np
import pytest

import embstore
import embstore.optim as optim
from embstore.errors import ConfigError, DtypeMismatchError

torch = pytest.importorskip("torch")

ROWS, DIM, STEPS = 40, 20, 8  # DIM 20: a SIMD body and a scalar tail in torch's kernels
CORE = np.arange(8)  # ids present in every batch
WEIGHT_RTOL, STATE_RTOL = 1e-5, 1e-6


class TorchRowWiseAdagrad(torch.optim.Optimizer):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD in torch ops; the last dimension of a parameter is a row."""

    def __init__(self, params: Iterable, lr: float, eps: float, weight_decay: float,
                 weight_decay_mode: str) -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay,
                                  "mode": weight_decay_mode})

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        for group in self.param_groups:
            lr, eps, wd, mode = group["lr"], group["eps"], group["weight_decay"], group["mode"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["sum"] = torch.zeros(p.shape[:-1], dtype=p.dtype)
                g = p.grad
                gd = g + wd * p if wd and mode == "l2" else g
                state["sum"] += (gd * gd).mean(dim=-1)
                mult = lr / (state["sum"].sqrt() + eps)
                if wd and mode == "l2":
                    corr = 1.0 - mult * wd
                elif wd:
                    corr = torch.tensor(1.0 - lr * wd, dtype=p.dtype)
                else:
                    corr = torch.tensor(1.0, dtype=p.dtype)
                p.copy_(corr.unsqueeze(-1) * p - mult.unsqueeze(-1) * g)


def _torch_optimizer(opt: optim.Optimizer, params: list) -> torch.optim.Optimizer:
    c = opt.config()
    if isinstance(opt, optim.SGD):
        return torch.optim.SGD(params, **c)
    if isinstance(opt, optim.Adagrad):
        return torch.optim.Adagrad(params, **c)
    if isinstance(opt, optim.RowWiseAdagrad):
        return TorchRowWiseAdagrad(params, **c)
    if isinstance(opt, optim.AdamW):
        return torch.optim.AdamW(params, **{**c, "betas": tuple(c["betas"])})
    if isinstance(opt, optim.Adam):
        return torch.optim.Adam(params, **{**c, "betas": tuple(c["betas"])})
    raise AssertionError(f"no torch reference for {opt!r}")


def _torch_state(opt: optim.Optimizer, t_opt: torch.optim.Optimizer, p) -> np.ndarray:
    """The torch optimizer's state of `p` in embstore's layout, [rows, state_width]."""
    rows = p.reshape(-1, DIM).shape[0]
    state = t_opt.state[p]
    if isinstance(opt, optim.SGD):
        return np.zeros((rows, 0), dtype=np.float32)
    if isinstance(opt, optim.Adagrad):
        return state["sum"].reshape(rows, DIM).numpy()
    if isinstance(opt, optim.RowWiseAdagrad):
        return state["sum"].reshape(rows, 1).numpy()
    parts = [state["exp_avg"], state["exp_avg_sq"]]
    if opt.amsgrad:
        parts.append(state["max_exp_avg_sq"])
    parts = [x.reshape(rows, DIM) for x in parts]
    parts.append(state["step"].expand(rows, 1))
    return torch.cat(parts, dim=1).numpy()


def _batches(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, per-occurrence grads): CORE ids 1-3 times each, plus duplicated extra ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        core = np.repeat(CORE, rng.integers(1, 4, size=len(CORE)))
        extra = rng.choice(np.arange(len(CORE), ROWS - 4), size=12)  # the last 4 rows: never
        ids = rng.permutation(np.concatenate([core, extra, extra[:3]])).astype(np.int64)
        grads = rng.normal(0.0, 1.0, size=(len(ids), DIM)).astype(np.float32)
        out.append((ids, grads))
    return out


def _initial_weights() -> np.ndarray:
    return np.random.default_rng(1).uniform(-0.1, 0.1, size=(ROWS, DIM)).astype(np.float32)


def sum_duplicates(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids (sorted) and their gradients summed in position order, as the store does.

    np.add.at is unbuffered and adds in index order; np.add.reduceat would not do here: along
    axis 0 it associates a group's rows in an order of numpy's choosing.
    """
    uids, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((len(uids), grads.shape[1]), dtype=grads.dtype)
    np.add.at(summed, inverse, grads)
    return uids, summed


def _run_embstore(opt: optim.Optimizer, batches) -> np.ndarray:
    """Train through `opt.step` as the store does: one gathered payload row per distinct id,
    weights and state as strided views of it. Returns the payload [ROWS, DIM + width].
    """
    payload = np.concatenate(
        [_initial_weights(), opt.initial_state(ROWS, DIM, np.dtype(np.float32))], axis=1)
    for ids, grads in batches:
        uids, summed = sum_duplicates(ids, grads)
        rows = payload[uids]
        opt.step(rows[:, :DIM], rows[:, DIM:], summed)
        payload[uids] = rows
    return payload


def _run_store(opt: optim.Optimizer, batches, tiers: list | None = None) -> np.ndarray:
    """Train through `store.apply_gradients`, which sums duplicates itself. Returns the
    payload read back with `lookup` and `lookup_state`.
    """
    all_ids = np.arange(ROWS, dtype=np.int64)
    spec = embstore.TableSpec("t", dim=DIM, optimizer=opt)
    with embstore.open(None, tables=[spec], tiers=tiers) as store:
        store.update("t", all_ids, _initial_weights())
        for ids, grads in batches:
            store.apply_gradients("t", ids, grads)
        return np.concatenate([store.lookup("t", all_ids), store.lookup_state("t", all_ids)], 1)


def _run_dense_torch(opt: optim.Optimizer, batches) -> np.ndarray:
    emb = torch.nn.Embedding(ROWS, DIM, sparse=False)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(_initial_weights()))
    t_opt = _torch_optimizer(opt, list(emb.parameters()))
    for ids, grads in batches:
        t_opt.zero_grad()
        (emb(torch.from_numpy(ids)) * torch.from_numpy(grads)).sum().backward()
        t_opt.step()
    state = _torch_state(opt, t_opt, emb.weight)
    return np.concatenate([emb.weight.detach().numpy(), state], axis=1)


def _run_per_row_torch(opt: optim.Optimizer, batches) -> np.ndarray:
    init = _initial_weights()
    params = [torch.nn.Parameter(torch.from_numpy(init[r].copy())) for r in range(ROWS)]
    opts = [_torch_optimizer(opt, [p]) for p in params]
    emb = torch.nn.Embedding(ROWS, DIM, sparse=False)  # only to sum duplicate gradients
    for ids, grads in batches:
        emb.zero_grad()
        (emb(torch.from_numpy(ids)) * torch.from_numpy(grads)).sum().backward()
        for r in np.unique(ids):
            params[r].grad = emb.weight.grad[r].clone()
            opts[r].step()
    width = opt.state_width(DIM)
    payload = np.empty((ROWS, DIM + width), dtype=np.float32)
    for r in range(ROWS):
        payload[r, :DIM] = params[r].detach().numpy()
        payload[r, DIM:] = (_torch_state(opt, opts[r], params[r]) if opts[r].state
                            else opt.initial_state(1, DIM, np.dtype(np.float32)))
    return payload


def _assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    # An element that is the small difference of larger terms (w - lr * g / std) carries the
    # rounding of those terms, so the absolute tolerance scales with the array's magnitude:
    # a tenth of rtol times its largest element, a few float32 ulps of it.
    for part, rtol, what in ((np.s_[:, :DIM], WEIGHT_RTOL, "weights"),
                             (np.s_[:, DIM:], STATE_RTOL, "state")):
        scale = float(np.abs(expected[part]).max(initial=0.0))
        np.testing.assert_allclose(actual[part], expected[part], rtol=rtol,
                                   atol=0.1 * rtol * scale, err_msg=what)


CASES = [
    optim.SGD(0.1),
    optim.SGD(0.1, weight_decay=0.05),
    optim.Adagrad(0.1),
    optim.Adagrad(0.1, weight_decay=0.05, initial_accumulator_value=0.1, eps=1e-6),
    optim.RowWiseAdagrad(0.1),
    optim.RowWiseAdagrad(0.1, weight_decay=0.05, weight_decay_mode="l2"),
    optim.RowWiseAdagrad(0.1, weight_decay=0.05, weight_decay_mode="decoupled", eps=1e-6),
    optim.Adam(0.01),
    optim.Adam(0.01, betas=(0.3, 0.9), weight_decay=0.05, amsgrad=True),  # beta1 < 0.5: the
    optim.AdamW(0.01, betas=(0.8, 0.99), weight_decay=0.1),  # other lerp formula in torch
]


@pytest.fixture(scope="module")
def batches():
    return _batches()


@pytest.mark.parametrize("opt", CASES, ids=repr)
def test_step_matches_torch_per_row_reference_on_every_row(opt, batches) -> None:
    ours = _run_embstore(opt, batches)
    _assert_close(ours, _run_per_row_torch(opt, batches))
    never = np.arange(ROWS - 4, ROWS)
    init = np.concatenate([_initial_weights(), opt.initial_state(ROWS, DIM, np.float32)], 1)
    assert np.array_equal(ours[never], init[never])  # untouched rows: no decay, no state


@pytest.mark.parametrize("opt", CASES, ids=repr)
def test_step_matches_dense_torch_on_rows_touched_every_step(opt, batches) -> None:
    ours = _run_embstore(opt, batches)
    _assert_close(ours[CORE], _run_dense_torch(opt, batches)[CORE])
    assert not np.allclose(ours[CORE, :DIM], _initial_weights()[CORE])  # training moved them


@pytest.mark.parametrize("opt", CASES, ids=repr)
def test_store_apply_gradients_matches_torch_and_the_direct_step(opt, batches) -> None:
    through_store = _run_store(opt, batches)
    _assert_close(through_store, _run_per_row_torch(opt, batches))
    # The store sums duplicates in position order, as sum_duplicates does: equal bits.
    assert through_store.tobytes() == _run_embstore(opt, batches).tobytes()


@pytest.mark.parametrize("opt", [optim.RowWiseAdagrad(0.1, weight_decay=0.05),
                                 optim.Adam(0.01, amsgrad=True)], ids=repr)
def test_store_result_does_not_depend_on_the_tier_chain(opt, batches) -> None:
    # A 5-row LRU cache over DRAM evicts and reloads rows (and their state) between steps.
    tiers = [embstore.TierSpec("dram", capacity=5), embstore.TierSpec("dram")]
    assert _run_store(opt, batches, tiers).tobytes() == _run_store(opt, batches).tobytes()


@pytest.mark.parametrize("opt", CASES, ids=repr)
def test_same_inputs_give_bit_identical_rows(opt, batches) -> None:
    first, second = _run_embstore(opt, batches), _run_embstore(opt, batches)
    assert first.tobytes() == second.tobytes()


@pytest.mark.parametrize("opt", CASES, ids=repr)
def test_step_does_not_write_caller_gradients(opt, batches) -> None:
    ids, grads = batches[0]
    uids, summed = sum_duplicates(ids, grads)
    kept = summed.copy()
    payload = np.concatenate([_initial_weights()[uids],
                              opt.initial_state(len(uids), DIM, np.dtype(np.float32))], 1)
    opt.step(payload[:, :DIM], payload[:, DIM:], summed)
    assert np.array_equal(summed, kept)


@pytest.mark.parametrize("opt", CASES, ids=repr)
def test_step_on_an_empty_batch_changes_nothing(opt) -> None:
    with embstore.open(None, tables=[embstore.TableSpec("t", dim=DIM, optimizer=opt)]) as store:
        ids = np.arange(5, dtype=np.int64)
        store.apply_gradients("t", ids, np.ones((5, DIM), dtype=np.float32))
        weights, state = store.lookup("t", ids), store.lookup_state("t", ids)
        store.apply_gradients("t", np.zeros(0, np.int64), np.zeros((0, DIM), np.float32))
        assert store.num_rows("t") == 5
        np.testing.assert_array_equal(store.lookup("t", ids), weights)
        np.testing.assert_array_equal(store.lookup_state("t", ids), state)


def test_adam_step_count_is_exact_and_saturates_at_2_pow_24_like_torch() -> None:
    opt = optim.Adam(0.01)
    rng = np.random.default_rng(3)
    w = rng.normal(size=(2, DIM)).astype(np.float32)
    g = rng.normal(size=(2, DIM)).astype(np.float32)
    state = opt.initial_state(2, DIM, np.dtype(np.float32))
    state[:, :2 * DIM] = np.abs(rng.normal(size=(2, 2 * DIM))) * 0.01
    state[:, -1] = [2**24 - 2, 1000]
    p = torch.nn.Parameter(torch.from_numpy(w[0].copy()))
    t_opt = torch.optim.Adam([p], lr=0.01)
    t_opt.state[p] = {"step": torch.tensor(float(2**24 - 2)),
                      "exp_avg": torch.from_numpy(state[0, :DIM].copy()),
                      "exp_avg_sq": torch.from_numpy(state[0, DIM:2 * DIM].copy())}
    for _ in range(3):
        opt.step(w, state, g)
        p.grad = torch.from_numpy(g[0].copy())
        t_opt.step()
    assert state[:, -1].tolist() == [2**24, 1003]
    assert t_opt.state[p]["step"].item() == 2**24
    np.testing.assert_allclose(w[0], p.detach().numpy(), rtol=WEIGHT_RTOL)


def test_power_by_squaring_matches_float64_pow() -> None:
    from embstore._optim_rules import power_by_squaring

    steps = np.array([0, 1, 2, 3, 1000, 2**24], dtype=np.float32)
    expected = np.array([0.999 ** float(s) for s in steps])
    np.testing.assert_allclose(power_by_squaring(0.999, steps), expected, rtol=1e-13)


@pytest.mark.parametrize("make", [optim.Adagrad, optim.RowWiseAdagrad])
def test_adagrad_refuses_a_half_precision_table_where_its_eps_is_zero(make) -> None:
    # eps 1e-10 or 1e-8 is 0 in float16: sqrt(0) + 0 made a zero gradient's step 0 / 0
    w = np.zeros((1, 4), dtype=np.float16)
    with pytest.raises(DtypeMismatchError, match="eps .* is 0 in float16"):
        make(0.1).step(w, np.zeros((1, make(0.1).state_width(4)), np.float16), w.copy())
    with pytest.raises(ConfigError, match="'t'.*is 0 in float16"):
        embstore.open(None, tables=[embstore.TableSpec("t", dim=4, dtype=np.float16,
                                                       optimizer=make(0.1))])
    with embstore.open(None, tables=[embstore.TableSpec(
            "t", dim=4, dtype=np.float16, optimizer=make(0.1, eps=1e-4))]) as store:
        grads = np.array([[0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float16)
        store.apply_gradients("t", np.array([1, 2]), grads)
        assert np.isfinite(store.lookup("t", np.array([1, 2]))).all()


def test_adam_refuses_a_table_where_its_eps_is_zero() -> None:
    # Adam(eps=1e-320) on float32: a fresh row's zero gradient stepped it to 0 / 0
    with pytest.raises(ConfigError, match="eps .* is 0 in float32"):
        embstore.open(None, tables=[embstore.TableSpec("t", dim=4,
                                                       optimizer=optim.Adam(eps=1e-320))])
    w = np.zeros((1, 4), dtype=np.float32)
    opt = optim.Adam(eps=1e-320)
    with pytest.raises(DtypeMismatchError, match="is 0 in float32"):
        opt.step(w, np.zeros((1, opt.state_width(4)), np.float32), w.copy())


def test_adam_rejects_half_precision_tables() -> None:
    opt = optim.Adam()
    w = np.zeros((1, 4), dtype=np.float16)
    with pytest.raises(DtypeMismatchError, match="float32"):
        opt.step(w, np.zeros((1, opt.state_width(4)), np.float16), w.copy())


@pytest.mark.parametrize("make", [
    lambda: optim.Adagrad(-0.1),
    lambda: optim.Adagrad(0.1, eps=0.0),
    lambda: optim.Adagrad(0.1, initial_accumulator_value=-1.0),
    lambda: optim.RowWiseAdagrad(float("nan")),
    lambda: optim.RowWiseAdagrad(0.1, eps=-1e-8),
    lambda: optim.RowWiseAdagrad(0.1, weight_decay=-0.1),
    lambda: optim.RowWiseAdagrad(0.1, weight_decay_mode="counter"),
    lambda: optim.Adam(0.0),
    lambda: optim.Adam(0.1, betas=(1.0, 0.999)),
    lambda: optim.Adam(0.1, betas=(0.9, -0.1)),
    lambda: optim.Adam(0.1, betas=(0.9,)),
    lambda: optim.AdamW(0.1, eps=0.0),
])
def test_invalid_settings_raise_config_error(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_registered_names_and_json_round_trip() -> None:
    assert {"sgd", "adagrad", "rowwise_adagrad", "adam", "adamw"} <= set(optim.optimizer_names())
    for opt in CASES:
        config = json.loads(json.dumps(opt.config()))
        again = optim.from_config(opt.name, config)
        assert again == opt and hash(again) == hash(opt)
        assert again.config() == config
    assert optim.Adam() != optim.AdamW(weight_decay=0.0)


def test_state_widths() -> None:
    assert optim.SGD().state_width(DIM) == 0
    assert optim.Adagrad().state_width(DIM) == DIM
    assert optim.RowWiseAdagrad().state_width(DIM) == 1
    assert optim.Adam().state_width(DIM) == 2 * DIM + 1
    assert optim.Adam(amsgrad=True).state_width(DIM) == 3 * DIM + 1
    init = optim.Adagrad(initial_accumulator_value=0.5).initial_state(3, DIM, np.float32)
    assert init.shape == (3, DIM) and (init == 0.5).all()


@pytest.mark.parametrize("opt, column, value", [
    (optim.Adagrad(lr=0.1), 3, -1e-6),  # a sum of squares below 0
    (optim.RowWiseAdagrad(lr=0.1), 0, -5.0),
    (optim.Adam(lr=0.1), 4 + 1, -1e-3),  # a second moment below 0
    (optim.Adam(lr=0.1), -1, 2.5),  # a step count that is not whole
    (optim.Adam(lr=0.1, amsgrad=True), 8 + 2, -1.0),  # a running maximum below 0
])
def test_a_state_no_step_reaches_is_told_from_every_state_steps_reach(opt, column, value):
    dim, rng = 4, np.random.default_rng(0)
    weights = rng.standard_normal((64, dim)).astype(np.float32)
    state = opt.initial_state(64, dim, np.dtype(np.float32))
    for _ in range(5):  # signed gradients: momentum goes negative, second moments do not
        opt.step(weights, state, rng.standard_normal((64, dim)).astype(np.float32))
    assert not opt.unreachable_state(state, dim).any()
    state[7, column] = value
    assert opt.unreachable_state(state, dim).tolist() == [i == 7 for i in range(64)]
