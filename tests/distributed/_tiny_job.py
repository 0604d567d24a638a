"""A tiny click model for the distributed trainer's tests (spawned ranks import this module)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import embstore
import embstore.torch as et
from embstore.distributed import Placement, Plan

ROWS, DIM, DENSE, BATCH = 64, 4, 3, 32


class TinyJob:
    """Two tables (row-wise Adagrad, column-wise row-wise Adagrad), a two-layer MLP."""

    def __init__(self) -> None:
        self.tables = [
            embstore.TableSpec("ta", DIM, init=embstore.init.Uniform(-0.1, 0.1, seed=1),
                               optimizer=embstore.optim.Adagrad(0.1), num_embeddings=ROWS),
            embstore.TableSpec("tb", DIM, init=embstore.init.Uniform(-0.1, 0.1, seed=2),
                               optimizer=embstore.optim.RowWiseAdagrad(0.1), num_embeddings=ROWS),
        ]
        self.truth = np.random.default_rng(99).standard_normal((2, ROWS))

    def plan(self, world: int) -> Plan:
        ranks = tuple(range(world))
        cols = tuple(int(c) for c in np.linspace(0, DIM, min(world, DIM) + 1))
        return Plan(world, {"ta": Placement("row", ranks),
                            "tb": Placement("column", ranks[: len(cols) - 1], columns=cols)})

    def model(self, store: Any) -> torch.nn.Module:
        torch.manual_seed(0)
        ebc = et.EmbeddingBagCollection(store, {"a": "ta", "b": "tb"}, mode="sum")

        class Tiny(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ebc = ebc
                self.mlp = torch.nn.Sequential(torch.nn.Linear(2 * DIM + DENSE, 8),
                                               torch.nn.ReLU(), torch.nn.Linear(8, 1))

            def forward(self, dense: torch.Tensor, sparse: dict) -> torch.Tensor:
                x = torch.cat([self.ebc(sparse).values(), dense], dim=1)
                return self.mlp(x).squeeze(1)

        return Tiny()

    def optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.5)

    def staged_inputs(self, model: torch.nn.Module, args: tuple[Any, ...]) -> dict[Any, Any]:
        return {model.ebc: args[1]}

    def batch(self, step: int, rank: int, world: int) -> tuple[tuple[Any, ...], torch.Tensor]:
        rng = np.random.default_rng((7, step))
        dense = rng.standard_normal((BATCH, DENSE)).astype(np.float32)
        sparse, logit = {}, 2.0 * dense[:, 0].astype(np.float64)
        for k, f in enumerate("ab"):
            lengths = rng.integers(1, 4, BATCH)
            ids = rng.integers(0, ROWS, int(lengths.sum()))
            starts = np.concatenate([[0], np.cumsum(lengths)])
            logit += np.add.reduceat(self.truth[k, ids], starts[:-1])
            sparse[f] = (ids, lengths, starts)
        labels = (logit > 0).astype(np.float32)
        lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
        mine = {f: (torch.from_numpy(ids[starts[lo]:starts[hi]].astype(np.int64)),
                    torch.from_numpy(lengths[lo:hi].astype(np.int64)))
                for f, (ids, lengths, starts) in sparse.items()}
        return (torch.from_numpy(dense[lo:hi]), mine), torch.from_numpy(labels[lo:hi])


def tiny() -> TinyJob:
    """The job (the picklable callable the trainer gets)."""
    return TinyJob()
