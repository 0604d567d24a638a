"""Data-parallel training over a sharded store: N local processes on loopback gloo.

`train_distributed(build, nproc, steps)` spawns `nproc` processes (torch.multiprocessing);
each calls ``build()`` for a `Job` (the model and its data, from a picklable, module-level
callable), opens the job's tables with `embstore.distributed.open`, and trains:

- each rank takes its slice of the global batch of every step (`Job.batch`);
- the sparse part (embstore.torch modules over the sharded store) applies its fused
  optimizer in the store during backward, collectively, exactly as one store fed the ranks'
  slices in rank order would;
- the dense part is data-parallel: its gradients are summed over the ranks with an
  all-reduce (the loss is each rank's summed loss over the global batch size, so the summed
  gradient is the global batch's mean gradient, as with one process), then every rank takes
  the same optimizer step.

It returns the digest of the tables and dense weights (the same on every rerun with the same
arguments), the loss curve (the global batch's mean loss per step), steps per second and the
bytes the store exchanged per step against the minimum.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

import embstore.distributed as ed
from embstore.distributed import launch
from embstore.torch import TrainPipeline

__all__ = ["DistributedResult", "Job", "train_distributed"]


class Job(Protocol):
    """What `train_distributed` needs from a model and its data."""

    tables: list[Any]
    """The TableSpecs of the sparse part."""

    def plan(self, world: int) -> ed.Plan | None:
        """The sharding plan for `world` ranks (None: row-wise by hash)."""

    def model(self, store: Any) -> torch.nn.Module:
        """The model over `store` (same dense initial weights on every rank: seed inside)."""

    def optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The dense part's optimizer."""

    def batch(self, step: int, rank: int, world: int) -> tuple[tuple[Any, ...], torch.Tensor]:
        """This rank's slice of step `step`'s global batch: (model arguments, labels [b])."""

    def staged_inputs(self, model: torch.nn.Module, args: tuple[Any, ...]) -> dict[Any, Any]:
        """For `TrainPipeline` (``pipeline=True``): {embstore module: its arguments}."""


@dataclass
class DistributedResult:
    """What a distributed training run gives back (rank 0's view; all ranks agree)."""

    nproc: int
    digest: str
    losses: list[float]
    steps_per_s: float
    bytes_per_step: float
    """Bytes the store sent between ranks per step (all ranks together)."""
    min_bytes_per_step: float
    """The minimum for the same calls: each distinct id and row sent once per owner."""
    per_rank_digests: list[str] = field(default_factory=list)


def train_distributed(build: Callable[[], Job], nproc: int, steps: int, *,
                      path: str | None = None, timeout_s: float = 300.0,
                      warmup: int = 1, pipeline: bool = False) -> DistributedResult:
    """Train `build()`'s job for `steps` steps on `nproc` processes (see the module doc).

    Args:
        build: picklable callable returning the job, called once in every process.
        nproc: processes (ranks), 1 or more.
        steps: training steps (each a global batch split over the ranks).
        path: directory of the sharded store (None: DRAM only).
        timeout_s: bound on the whole run and on each collective.
        warmup: steps excluded from the timing.
        pipeline: feed the batches through `embstore.torch.TrainPipeline` (results are the
            same bit for bit; `Job.staged_inputs` names the modules and their arguments).

    Raises:
        PeerFailedError: a rank failed (its error is in the message).
    """
    results = launch.run(_rank_main, nproc, build, steps, path, timeout_s, warmup, pipeline,
                         timeout_s=timeout_s)
    first = results[0]
    return DistributedResult(nproc, first["digest"], first["losses"], first["steps_per_s"],
                             sum(r["sent"] for r in results) / steps,
                             sum(r["minimum"] for r in results) / steps,
                             [r["digest"] for r in results])


def _rank_main(rank: int, world: int, build: Callable[[], Job], steps: int, path: str | None,
               timeout_s: float, warmup: int, pipeline: bool) -> dict[str, Any]:
    job = build()
    store = ed.open(path, tables=job.tables, plan=job.plan(world), timeout_s=timeout_s)
    try:
        model = job.model(store)
        opt = job.optimizer([p for p in model.parameters() if p.requires_grad])
        losses, touched = [], {s.name: [] for s in job.tables}
        batches: Any = (job.batch(step, rank, world) for step in range(steps))
        if pipeline:
            batches = TrainPipeline(batches, lambda b: job.staged_inputs(model, b[0]))
        start = time.perf_counter()
        for step, (args, labels) in enumerate(batches):
            if step == warmup:
                start = time.perf_counter()
            _record_ids(args, model, touched)
            total = torch.tensor([float(labels.shape[0])], dtype=torch.float64)
            dist.all_reduce(total)
            logits = model(*args)
            loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(
                logits, labels, reduction="sum")
            opt.zero_grad()
            (loss_sum / float(total[0])).backward()  # sparse: updated in the store here
            _all_reduce_grads(model)
            opt.step()
            reported = loss_sum.detach().double().reshape(1)
            dist.all_reduce(reported)
            losses.append(float(reported[0] / total[0]))
        if pipeline:
            batches.close()
        timed = max(1, steps - warmup)
        rate = timed / (time.perf_counter() - start)
        traffic = (store.traffic.sent, store.traffic.minimum)
        digest = _digest(store, model, touched)
    finally:
        store.close()
    return {"digest": digest, "losses": losses, "steps_per_s": rate, "sent": traffic[0],
            "minimum": traffic[1]}


def _all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum the dense gradients over the ranks (one flat all-reduce)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def _record_ids(args: tuple[Any, ...], model: torch.nn.Module,
                touched: dict[str, list[np.ndarray]]) -> None:
    """Remember the ids this rank sends to each table (for the digest)."""
    for module in model.modules():
        tables = getattr(module, "tables", None)
        if not isinstance(tables, dict) or not hasattr(module, "prepare_forward"):
            continue
        for arg in args:
            if isinstance(arg, dict):
                for feature, value in arg.items():
                    if feature in tables:
                        touched[tables[feature]].append(np.unique(value[0].numpy()))


def _digest(store: ed.ShardedStore, model: torch.nn.Module,
            touched: dict[str, list[np.ndarray]]) -> str:
    """sha256 of the dense weights and, per table, of every touched id's row and state."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0" + tensor.detach().contiguous().numpy().tobytes())
    mine = {t: np.unique(np.concatenate(v)) if v else np.empty(0, np.int64)
            for t, v in touched.items()}
    everyone = store._comm.gather_objects(mine, "digest ids")
    for name in sorted(mine):
        ids = np.unique(np.concatenate([e[name] for e in everyone]))  # type: ignore[index]
        ask = ids if store.rank == 0 else ids[:0]
        rows = store.lookup(name, ask)
        state = store.lookup_state(name, ask)
        if store.rank == 0:
            h.update(name.encode() + b"\0" + ids.tobytes() + rows.tobytes() + state.tobytes())
    out = [h.hexdigest()]
    dist.broadcast_object_list(out, src=0)
    return str(out[0])
