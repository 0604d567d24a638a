"""Fused sparse optimizers whose state is stored beside each row.

A table's stored row is ``[weights (dim) | state (state_width(dim))]``. The store sums the
gradients of duplicate ids in a fixed order (sort by id, then position), gathers each distinct
row once, and calls `step` with views of the weights and the state; `step` updates both in
place with elementwise numpy operations only, so the result is bit-identical on every tier
layout, cache size and run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from .errors import ConfigError, UnknownNameError

__all__ = ["SGD", "Optimizer", "from_config", "optimizer_names"]

_OPTIMIZERS: dict[str, type[Optimizer]] = {}


class Optimizer(ABC):
    """A fused update rule for the rows of one table.

    Subclasses take keyword-only, JSON-serialisable settings and return them from `config()`.
    """

    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            if cls.name in _OPTIMIZERS:
                raise ConfigError(f"optimizer name {cls.name!r} is registered twice")
            _OPTIMIZERS[cls.name] = cls

    def state_width(self, dim: int) -> int:
        """Elements of optimizer state stored after the `dim` weights of each row."""
        return 0

    def initial_state(self, n: int, dim: int, dtype: np.dtype) -> np.ndarray:
        """State of `n` rows that were never updated: array[n, state_width(dim)]."""
        return np.zeros((n, self.state_width(dim)), dtype=dtype)

    @abstractmethod
    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        """Update `weights` [N, dim] and `state` [N, state_width] in place from `grads` [N, dim].

        Rows are distinct; `grads` already hold the summed gradient of each row.
        """

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """Constructor settings; `type(self)(**config())` recreates the optimizer."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.config() == self.config()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.config().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    value = float(value)
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


def optimizer_names() -> list[str]:
    """Names of every registered optimizer."""
    return sorted(_OPTIMIZERS)


def from_config(name: str, config: dict[str, Any]) -> Optimizer:
    """Recreate an optimizer from its registered name and `config()`.

    Raises:
        UnknownNameError: no optimizer of that name.
    """
    if name not in _OPTIMIZERS:
        raise UnknownNameError(f"unknown optimizer {name!r}; registered: {optimizer_names()!r}")
    return _OPTIMIZERS[name](**config)
