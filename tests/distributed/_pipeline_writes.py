"""What each rank runs in test_pipeline_writes (module-level, so spawned processes find it)."""

from __future__ import annotations

import numpy as np

import embstore
import embstore.distributed as ed
from embstore import optim


def _batches(rank: int) -> list:
    import torch

    out = []
    for step in range(4):
        rng = np.random.default_rng([step, rank])
        out.append((torch.from_numpy(rng.integers(0, 6, 6)), torch.tensor([0, 2, 4])))
    return out


def _train(rank: int, store: ed.ShardedStore, pipelined: bool, variant: str) -> bytes:
    import embstore.torch as et

    first = et.EmbeddingBag(store, "u", mode="sum")
    second = et.EmbeddingBag(store, "u", mode="sum")

    def step(batch: tuple) -> None:
        if variant == "own write":  # the trainer's own write, after the batch was handed out
            store.apply_gradients("u", np.arange(6), np.ones((6, 4), np.float32))
            (first(*batch) ** 2).sum().backward()
        else:  # a module's backward changes the rows that the next module's forward reads
            (first(*batch) ** 2).sum().backward()
            (second(*batch) ** 2).sum().backward()

    if pipelined:
        modules = [first] if variant == "own write" else [first, second]
        with et.TrainPipeline(_batches(rank), inputs=lambda b: dict.fromkeys(modules, b)) as p:
            for batch in p:
                step(batch)
    else:
        for batch in _batches(rank):
            step(batch)
    return store.lookup("u", np.arange(6)).tobytes() + store.lookup_state(
        "u", np.arange(6)).tobytes()


def pipelined_equals_loop(rank: int, world: int, variant: str) -> bool:
    """Whether the pipeline leaves the sharded table as the loop without it does."""
    spec = embstore.TableSpec("u", 4, init=embstore.init.Uniform(seed=1),
                              optimizer=optim.Adagrad(0.5))
    tables = []
    for pipelined in (False, True):
        with ed.open(None, tables=[spec], timeout_s=30) as store:
            tables.append(_train(rank, store, pipelined, variant))
    return tables[0] == tables[1]
