"""The plan of one forward of the torch modules: each table's distinct ids and their rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..index import IdGroups
from ._inputs import BagInput

__all__ = ["FeaturePlan", "ForwardPlan", "TablePlan"]


@dataclass
class FeaturePlan:
    """One feature's ids within its table's lookup."""

    name: str
    bags: BagInput
    start: int
    """Position of the feature's first id among the table's concatenated ids."""


@dataclass
class TablePlan:
    """The distinct ids one forward needs from one table, and (once fetched) their rows."""

    table: str
    features: list[FeaturePlan]
    groups: IdGroups
    padding: int | None
    """Index into `groups.unique` of the padding id, None when absent or not set."""
    ids: np.ndarray | None = None
    """int64[N]: the ids of every position, as the forward used them (`groups` groups them)."""
    rows: torch.Tensor | None = None
    """[U, dim] rows of `groups.unique` on the module's device, once fetched."""
    inverse: torch.Tensor | None = None
    """int64[N] on the module's device: the distinct row of each position."""
    ready: Any = None
    """A CUDA event the consumer waits on before using `rows`, or None."""
    fetched_at: int = 0
    """The pipeline's update count when the rows were read (for refreshing them)."""
    pinned: Any = None
    """Pinned host copies being transferred to the device: kept alive until they land."""
    in_store: bool = False
    """Pooled straight from the store's DRAM tier when it runs (`pool_rows_in_store`): no rows
    are fetched for it."""


@dataclass
class ForwardPlan:
    """Everything one forward of one module needs: its tables' plans, in feature order."""

    args: tuple[Any, ...]
    """The forward's arguments, as given: a staged plan serves the call with these objects."""
    tables: list[TablePlan]
    order: list[str]
    """Feature names in output order."""
    snapshot: list[Any] | None = None
    """What the tensors in `args` held when the plan was made (`modules._snapshot`)."""
    catch_up: Any = None
    """Called as catch_up(module, plan) when a forward takes the staged plan: brings its
    staged rows up to date with writes made after the pipeline handed it over."""
