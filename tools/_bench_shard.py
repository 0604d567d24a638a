"""Benchmark of the sharded demo: steps per second at 1, 2 and 4 processes, and bytes exchanged.

``embstore bench shard [--nproc 1 2 4] [--steps 30] [--quick] [--json]``

Trains the demo's DLRM (tools/_dlrm.py: 8 sparse features, one row-wise Adagrad table each)
with `train_distributed` on N local processes (gloo on loopback), all tables row-wise by hash
over every rank, and reports steps per second (the global batch split over the ranks) and the
bytes the store sent between ranks per step against the minimum (each distinct id and each
row or gradient row sent once per owner). On a machine with fewer cores than processes this
is a functional scaling check, not a speed-up measurement.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import embstore
from embstore.tools import _dlrm
from embstore.tools._args import (
    MAX_PROCESSES,
    PROCESSES_WHY,
    Parser,
    bench_size,
    quick_sizes,
    whole_up_to,
)
from embstore.tools._demo_distributed import train_distributed


@dataclass
class DLRMJob:
    """The demo's DLRM and click stream as a `Job` of the distributed trainer."""

    rows: int = 20_000
    batch_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        self.cfg = _dlrm.DemoConfig(rows=self.rows, seed=self.seed)
        self.stream = _dlrm.ClickStream(self.cfg)
        self.tables = [embstore.TableSpec(
            name, dim=self.cfg.dim, init=embstore.init.Uniform(-0.05, 0.05,
                                                               seed=self.seed * 1000 + i),
            optimizer=embstore.optim.RowWiseAdagrad(lr=self.cfg.lr))
            for i, name in enumerate(self.cfg.table_names())]

    def plan(self, world: int) -> None:
        return None  # row-wise by hash over every rank

    def model(self, store: Any) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        ebc = embstore.torch.EmbeddingBagCollection(store, self.cfg.feature_tables())
        return _dlrm.build_model(self.cfg, ebc)

    def optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.cfg.dense_lr)

    def staged_inputs(self, model: torch.nn.Module, args: tuple[Any, ...]) -> dict[Any, Any]:
        return {model.ebc: args[0].sparse}

    def batch(self, step: int, rank: int, world: int) -> tuple[tuple[Any, ...], torch.Tensor]:
        full = self.stream.batch(step, self.batch_size)
        lo, hi = rank * self.batch_size // world, (rank + 1) * self.batch_size // world
        sparse = {}
        for f, (values, lengths) in full.sparse.items():
            starts = np.concatenate([[0], np.cumsum(lengths.numpy())])
            sparse[f] = (values[int(starts[lo]):int(starts[hi])], lengths[lo:hi])
        part = _dlrm.Batch(full.dense[lo:hi], sparse, full.labels[lo:hi])
        return (part,), part.labels


QUICK_NPROC, QUICK_STEPS = (1, 2), 4


def dlrm_job() -> DLRMJob:
    """The benchmark's job (module-level, so spawned ranks can build it)."""
    return DLRMJob()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench shard`."""
    parser.add_argument("--nproc", type=whole_up_to(MAX_PROCESSES, PROCESSES_WHY), nargs="+",
                        default=[1, 2, 4],
                        help="process counts to run (1 2 4)")
    parser.add_argument("--steps", type=bench_size, default=30,
                        help="timed steps per run (30)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke test: {QUICK_STEPS} steps at 1 and 2 processes")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    quick_sizes(parser, nproc=list(QUICK_NPROC), steps=QUICK_STEPS)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry (``python -m``): parse `argv` and `run`."""
    ap = Parser(description=__doc__.splitlines()[0])  # which fills in --quick's sizes
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Train at each process count and print the figures."""
    rows = []
    for n in args.nproc:
        res = train_distributed(dlrm_job, n, args.steps, timeout_s=600, warmup=3)
        rows.append({"nproc": n, "steps_per_s": round(res.steps_per_s, 2),
                     "bytes_per_step": round(res.bytes_per_step),
                     "min_bytes_per_step": round(res.min_bytes_per_step),
                     "over_minimum": round(res.bytes_per_step / res.min_bytes_per_step, 3)
                     if res.min_bytes_per_step else None,
                     "final_loss": round(float(np.mean(res.losses[-5:])), 4),
                     "digest": res.digest[:16]})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            # one process exchanges nothing: there is no minimum to compare with
            exchanged = (f"{r['bytes_per_step']} B/step exchanged (minimum "
                         f"{r['min_bytes_per_step']}, x{r['over_minimum']})"
                         if r["over_minimum"] is not None
                         else f"{r['bytes_per_step']} B/step exchanged (nothing to exchange)")
            print(f"nproc {r['nproc']}: {r['steps_per_s']:.2f} steps/s, {exchanged}, "
                  f"loss(last 5) {r['final_loss']}, digest {r['digest']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
