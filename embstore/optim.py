"""Fused sparse optimizers whose state is stored beside each row.

A table's stored row is ``[weights (dim) | state (state_width(dim))]``. The store sums the
gradients of duplicate ids in a fixed order (sort by id, then position), gathers each distinct
row once, and calls `step` with views of the weights and the state; `step` updates both in
place with elementwise numpy operations only, so the result is bit-identical on every tier
layout, cache size and run. On float32 tables the store runs SGD, Adagrad and RowWiseAdagrad
through one C kernel (`embstore/_fused.py`) that performs the same float32 operations in the
same order, so it gives the same bits as `step`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from . import _optim_rules as rules
from ._named import Named, number_setting
from .errors import ConfigError, DtypeMismatchError

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Optimizer",
    "RowWiseAdagrad",
    "from_config",
    "optimizer_names",
]

class Optimizer(Named):
    """A fused update rule for the rows of one table.

    Subclasses take keyword-only, JSON-serialisable settings and return them from `config()`.
    """

    _family: ClassVar[str] = "optimizer"
    _registry: ClassVar[dict[str, type[Named]]] = {}

    def state_width(self, dim: int) -> int:
        """Elements of optimizer state stored after the `dim` weights of each row."""
        return 0

    def dtype_problem(self, dtype: np.dtype) -> str | None:
        """Why this rule cannot step a table of `dtype`, or None where it can."""
        return None

    def check_dtype(self, table: str, dtype: np.dtype) -> None:
        """Refuse a new table of `dtype` that this rule cannot step (`dtype_problem`).

        Raises:
            ConfigError: the rule needs a wider dtype, or a setting vanishes in this one.
        """
        problem = self.dtype_problem(np.dtype(dtype))
        if problem is not None:
            raise ConfigError(f"table {table!r}: {problem}")

    def _check_step_dtype(self, weights: np.ndarray) -> None:
        """Refuse to step a table made before new tables were checked (`check_dtype`)."""
        problem = self.dtype_problem(weights.dtype)
        if problem is not None:
            raise DtypeMismatchError(problem)

    def initial_state(self, n: int, dim: int, dtype: np.dtype) -> np.ndarray:
        """State of `n` rows that were never updated: array[n, state_width(dim)]."""
        return np.zeros((n, self.state_width(dim)), dtype=dtype)

    def unreachable_state(self, state: np.ndarray, dim: int) -> np.ndarray:
        """bool[N]: rows of `state` [N, state_width(dim)] that no sequence of steps reaches.

        A state from outside (a bulk load, an import) is checked with it: a negative sum of
        squares would make the row's next step NaN, which the store then refuses, so the
        row could never be trained again. None by default.
        """
        return np.zeros(len(state), dtype=bool)

    @abstractmethod
    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        """Update `weights` [N, dim] and `state` [N, state_width] in place from `grads` [N, dim].

        Rows are distinct; `grads` already hold the summed gradient of each row.
        """



def _eps_vanishes(optimizer: Adagrad | RowWiseAdagrad | Adam, dtype: np.dtype) -> str | None:
    """Why `optimizer` cannot step a table of `dtype` where its eps rounds to 0 there."""
    if np.dtype(dtype).kind != "f" or np.dtype(dtype).type(optimizer.eps) != 0:
        return None
    tiny = float(np.finfo(dtype).smallest_subnormal)
    # sqrt(G) + eps is then 0 for a row or element never given a gradient, and a zero
    # gradient steps it to 0 / 0
    half = np.dtype(dtype).itemsize < 4
    return (f"{type(optimizer).__name__}'s eps {optimizer.eps:g} is 0 in {np.dtype(dtype)}, "
            f"so a zero gradient would make a fresh row NaN; give eps >= {tiny:g}"
            + (", or keep the table float32 and store its rows in 16 bits with "
               "precision='fp16'" if half else ""))


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    value = number_setting(name, value)
    if not np.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be finite and {bound}, got {value!r}")
    return value


class SGD(Optimizer):
    """Plain stochastic gradient descent: ``w -= lr * (g + weight_decay * w)``.

    Args:
        lr: learning rate.
        weight_decay: L2 penalty folded into the gradient, as torch.optim.SGD does.
    """

    name: ClassVar[str] = "sgd"

    def __init__(self, lr: float = 0.01, *, weight_decay: float = 0.0) -> None:
        self.lr = _check_positive("lr", lr)
        self.weight_decay = _check_positive("weight_decay", weight_decay, allow_zero=True)

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        # docstring inherited
        dtype = weights.dtype.type
        if self.weight_decay:
            grads = grads + dtype(self.weight_decay) * weights
        weights -= dtype(self.lr) * grads

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"lr": self.lr, "weight_decay": self.weight_decay}


def _check_beta(name: str, value: float) -> float:
    value = number_setting(name, value)
    if not 0.0 <= value < 1.0:  # also rejects NaN
        raise ConfigError(f"{name} must be in [0, 1), got {value!r}")
    return value


class Adagrad(Optimizer):
    """Per-element Adagrad, as torch.optim.Adagrad: ``G += g*g; w -= lr * g / (sqrt(G) + eps)``.

    State per row: ``[G (dim)]``, the running sum of squared gradients, starting at
    `initial_accumulator_value`. torch's `lr_decay` is not offered: torch counts steps per
    parameter tensor, including steps where a row's gradient is zero, which a per-row count
    cannot reproduce for rows that are not updated at every step.

    Args:
        lr: learning rate, > 0.
        weight_decay: L2 penalty folded into the gradient (``g + weight_decay * w``), >= 0.
        initial_accumulator_value: starting value of every element of G, >= 0.
        eps: added to ``sqrt(G)``, > 0.

    Raises:
        ConfigError: a setting out of range.
    """

    name: ClassVar[str] = "adagrad"

    def __init__(self, lr: float = 0.01, *, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> None:
        self.lr = _check_positive("lr", lr)
        self.weight_decay = _check_positive("weight_decay", weight_decay, allow_zero=True)
        self.initial_accumulator_value = _check_positive(
            "initial_accumulator_value", initial_accumulator_value, allow_zero=True)
        self.eps = _check_positive("eps", eps)

    def state_width(self, dim: int) -> int:
        # docstring inherited
        return dim

    def initial_state(self, n: int, dim: int, dtype: np.dtype) -> np.ndarray:
        # docstring inherited
        return np.full((n, dim), self.initial_accumulator_value, dtype=dtype)

    def unreachable_state(self, state: np.ndarray, dim: int) -> np.ndarray:
        # docstring inherited
        return np.asarray((state < 0).any(axis=1))

    def dtype_problem(self, dtype: np.dtype) -> str | None:
        # docstring inherited
        return _eps_vanishes(self, dtype)

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        # docstring inherited
        self._check_step_dtype(weights)
        rules.adagrad(weights, state, grads, lr=self.lr, eps=self.eps,
                      weight_decay=self.weight_decay)

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"lr": self.lr, "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value, "eps": self.eps}


class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad, FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row.

    ``G += mean(g*g over the row); w -= lr * g / (sqrt(G) + eps)``. State per row: ``[G]``
    (one element), which is why this is the usual choice for large embedding tables.

    Args:
        lr: learning rate, > 0.
        eps: added to ``sqrt(G)``, > 0.
        weight_decay: decay strength, >= 0.
        weight_decay_mode: ``"l2"`` (FBGEMM's L2: ``g + weight_decay * w`` feeds G and the
            step) or ``"decoupled"`` (FBGEMM's DECOUPLE: ``w *= 1 - lr * weight_decay``).

    Raises:
        ConfigError: a setting out of range or an unknown `weight_decay_mode`.
    """

    name: ClassVar[str] = "rowwise_adagrad"
    _MODES: ClassVar[tuple[str, ...]] = ("l2", "decoupled")

    def __init__(self, lr: float = 0.01, *, eps: float = 1e-8, weight_decay: float = 0.0,
                 weight_decay_mode: str = "l2") -> None:
        self.lr = _check_positive("lr", lr)
        self.eps = _check_positive("eps", eps)
        self.weight_decay = _check_positive("weight_decay", weight_decay, allow_zero=True)
        if not isinstance(weight_decay_mode, str) or weight_decay_mode not in self._MODES:
            raise ConfigError(f"weight_decay_mode must be one of {self._MODES!r}, "
                              f"got {weight_decay_mode!r}")
        self.weight_decay_mode = str(weight_decay_mode)

    def state_width(self, dim: int) -> int:
        # docstring inherited
        return 1

    def unreachable_state(self, state: np.ndarray, dim: int) -> np.ndarray:
        # docstring inherited
        return np.asarray(state[:, 0] < 0)

    def dtype_problem(self, dtype: np.dtype) -> str | None:
        # docstring inherited
        return _eps_vanishes(self, dtype)

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        # docstring inherited
        self._check_step_dtype(weights)
        rules.rowwise_adagrad(weights, state[:, 0], grads, lr=self.lr, eps=self.eps,
                              weight_decay=self.weight_decay,
                              decoupled=self.weight_decay_mode == "decoupled")

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"lr": self.lr, "eps": self.eps, "weight_decay": self.weight_decay,
                "weight_decay_mode": self.weight_decay_mode}


class Adam(Optimizer):
    """Per-element Adam, as torch.optim.Adam, with the step count kept per row.

    State per row: ``[m (dim) | v (dim) | v_max (dim), only with amsgrad | t (1)]``. ``t``
    counts the updates of that row, so a row's bias correction follows its own history (a
    dense torch.optim.Adam counts steps per tensor; both agree on rows updated at every step).
    ``t`` is stored as a float of the table dtype, not as int32 bits: a float32 count is exact
    up to 2**24 updates of one row and then stays at 2**24, which is what torch's own float32
    step tensor does; by then both bias corrections round to 1.0 in float32 for betas up to
    0.999999, so the update is the same as with the true count. Unlike int32 bits (subnormal
    or NaN patterns as floats), a float count survives any float handling of stored rows
    (finiteness checks, dtype casts, denormal flushing).

    Args:
        lr: learning rate, > 0.
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to the bias-corrected ``sqrt(v)``, > 0.
        weight_decay: L2 penalty folded into the gradient (``g + weight_decay * w``), >= 0.
        amsgrad: normalise by the running maximum of v (AMSGrad); adds dim state elements.

    Raises:
        ConfigError: a setting out of range.
        DtypeMismatchError: from `step`, on a table narrower than float32 (the step count
            would stop being exact after 2048 updates).
    """

    name: ClassVar[str] = "adam"
    _decoupled: ClassVar[bool] = False

    def __init__(self, lr: float = 0.001, *, betas: Sequence[float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        self.lr = _check_positive("lr", lr)
        if not isinstance(betas, (list, tuple, np.ndarray)) or len(betas) != 2:
            raise ConfigError(f"betas must be two floats (beta1, beta2), got {betas!r}")
        self.betas = (_check_beta("betas[0]", betas[0]), _check_beta("betas[1]", betas[1]))
        self.eps = _check_positive("eps", eps)
        self.weight_decay = _check_positive("weight_decay", weight_decay, allow_zero=True)
        if not isinstance(amsgrad, (bool, np.bool_)):
            raise ConfigError(f"amsgrad must be True or False, got {amsgrad!r}")
        self.amsgrad = bool(amsgrad)

    def state_width(self, dim: int) -> int:
        # docstring inherited
        return (3 if self.amsgrad else 2) * dim + 1

    def unreachable_state(self, state: np.ndarray, dim: int) -> np.ndarray:
        # docstring inherited: second moments (and their maxima) >= 0, a whole step count
        steps = state[:, -1]
        return np.asarray((state[:, dim:-1] < 0).any(axis=1) | (steps < 0)
                          | (steps != np.floor(steps)))

    def dtype_problem(self, dtype: np.dtype) -> str | None:
        # docstring inherited
        if dtype.itemsize < 4:
            return (f"{type(self).__name__} needs a float32 or float64 table to count steps "
                    f"exactly, got {dtype}; use RowWiseAdagrad or a wider dtype")
        return _eps_vanishes(self, dtype)

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        # docstring inherited
        self._check_step_dtype(weights)
        dim = weights.shape[1]
        rules.adam(weights, state[:, :dim], state[:, dim:2 * dim],
                   state[:, 2 * dim:3 * dim] if self.amsgrad else None, state[:, -1], grads,
                   lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                   weight_decay=self.weight_decay, decoupled=self._decoupled)

    def config(self) -> dict[str, Any]:
        # docstring inherited
        # betas as a list: the manifest stores JSON, and a list round-trips unchanged.
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "amsgrad": self.amsgrad}


class AdamW(Adam):
    """Adam with decoupled weight decay, as torch.optim.AdamW: ``w *= 1 - lr * weight_decay``.

    Same settings, state layout and step count as `Adam`; only the default `weight_decay`
    (0.01, torch's) and where the decay applies differ.
    """

    name: ClassVar[str] = "adamw"
    _decoupled: ClassVar[bool] = True

    def __init__(self, lr: float = 0.001, *, betas: Sequence[float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, amsgrad: bool = False) -> None:
        super().__init__(lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


optimizer_names = Optimizer.registered_names
from_config = Optimizer.from_config
