"""The local table a rank holds for its shard of a global table.

Table-wise and row-wise shards are the global spec itself (the same initializer gives the
same row for an id on any rank). A column-wise shard of columns [start, stop) is a table of
``dim = stop - start`` whose initializer is the global one cut to those columns
(`ColumnSlice`), so never-written rows are bit-identical to the global table's. Row-wise
Adagrad needs the mean of g^2 over the whole row; its column shards use
`ColumnShardRowWiseAdagrad`, which takes that mean from the sharded store (combined exactly
from every shard's squares) instead of computing it over its own columns.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .. import init as init_mod
from .. import optim as optim_mod
from ..errors import ConfigError
from ..spec import TableSpec
from .plan import Placement

__all__ = ["ColumnShardRowWiseAdagrad", "ColumnSlice", "local_spec", "state_layout"]


class ColumnSlice(init_mod.Initializer):
    """Columns [start, stop) of `base` over a table of `dim` columns."""

    name: ClassVar[str] = "column_slice"
    listed: ClassVar[bool] = False

    def __init__(self, base: dict[str, Any], start: int, stop: int, dim: int) -> None:
        self.base = {"name": base["name"], "config": dict(base["config"])}
        self.start, self.stop, self.dim = int(start), int(stop), int(dim)
        self._init = init_mod.from_config(self.base["name"], self.base["config"])

    def __call__(self, ids: np.ndarray, dim: int, dtype: np.dtype) -> np.ndarray:
        # docstring inherited
        full = self._init(ids, self.dim, dtype)
        return np.ascontiguousarray(full[:, self.start:self.stop])

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"base": self.base, "start": self.start, "stop": self.stop, "dim": self.dim}


class ColumnShardRowWiseAdagrad(optim_mod.RowWiseAdagrad):
    """`RowWiseAdagrad` on a column shard: the row mean of g^2 comes from `pending_mean`.

    The sharded store sets `pending_mean` (float[U], the mean over the whole row, computed as
    the unsharded rule computes it) just before it applies the distinct rows' summed
    gradients, and clears it after. Updating such a shard any other way is refused.
    """

    name: ClassVar[str] = "rowwise_adagrad_column_shard"
    listed: ClassVar[bool] = False

    def __init__(self, lr: float = 0.01, *, eps: float = 1e-8, weight_decay: float = 0.0,
                 weight_decay_mode: str = "l2") -> None:
        super().__init__(lr, eps=eps, weight_decay=weight_decay,
                         weight_decay_mode=weight_decay_mode)
        self.pending_mean: np.ndarray | None = None

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        # docstring inherited; rules.rowwise_adagrad with the row mean given
        mean = self.pending_mean
        if mean is None or len(mean) != len(weights):
            raise ConfigError("a column shard of a row-wise Adagrad table is updated only "
                              "through embstore.distributed (it needs the whole row's mean)")
        t = weights.dtype.type
        acc = state[:, 0]
        acc += mean
        multiplier = np.sqrt(acc)
        multiplier += t(self.eps)
        np.divide(t(self.lr), multiplier, out=multiplier)
        if self.weight_decay and self.weight_decay_mode == "l2":
            weights *= (t(1) - multiplier * t(self.weight_decay))[:, None]
        elif self.weight_decay:
            weights *= t(1) - t(self.lr) * t(self.weight_decay)
        weights -= grads * multiplier[:, None]


def local_spec(spec: TableSpec, placement: Placement, rank: int) -> TableSpec:
    """The spec of `rank`'s local table for its shard of `spec`."""
    if placement.kind != "column":
        return spec
    if spec.precision != "fp32":  # Plan.check refuses it first, on every rank
        raise ConfigError(f"table {spec.name!r} stores {spec.precision} weights, which cannot "
                          "be sharded column-wise; shard it table-wise or row-wise")
    start, stop = placement.column_range(rank)
    init = ColumnSlice({"name": spec.init.name, "config": spec.init.config()}, start, stop,
                       spec.dim)
    opt = spec.optimizer
    if type(opt) is optim_mod.RowWiseAdagrad:
        opt = ColumnShardRowWiseAdagrad(**opt.config())
    elif not isinstance(opt, (optim_mod.SGD, optim_mod.Adagrad, optim_mod.Adam)):
        raise ConfigError(f"table {spec.name!r}: column-wise sharding supports SGD, Adagrad, "
                          f"Adam(W) and RowWiseAdagrad, not {type(opt).__name__}; shard it "
                          "table-wise or row-wise")
    return TableSpec(spec.name, stop - start, spec.dtype, init, opt, spec.num_embeddings,
                     spec.allow_nonfinite, spec.tiers)


def needs_row_mean(spec: TableSpec, placement: Placement) -> bool:
    """Whether updates of this column-wise table need the whole row's mean of g^2."""
    return placement.kind == "column" and isinstance(spec.optimizer, optim_mod.RowWiseAdagrad)


def state_layout(spec: TableSpec) -> tuple[int, int]:
    """Split a table's optimizer state into per-column blocks and a per-row tail.

    Returns (blocks, tail): the state is `blocks` blocks of `dim` elements followed by `tail`
    per-row elements (Adam: 2 or 3 blocks, tail 1; row-wise Adagrad: 0, 1).
    """
    if isinstance(spec.optimizer, optim_mod.RowWiseAdagrad):
        return 0, 1
    w1, w2 = spec.optimizer.state_width(1), spec.optimizer.state_width(2)
    return w2 - w1, w1 - (w2 - w1)
