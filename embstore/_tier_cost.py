"""Predicted time of a training step's tier accesses, from a tier model (`embstore.tiers`).

One formula serves `embstore plan` (one host) and the sharding planner (every rank). With
L the distinct ids a step looks up, r the stored row bytes, m_i the miss ratio below the i-th
cache of a chain (so L m_i rows reach tier i+1) and cost(tier, op, k) = latency +
k x r / throughput (0 for k = 0)::

    lookup       cost(top, read, L) + sum_i cost(tier i+1, read, L m_i)
    promotions   cost(top, write, L m_0) (+ cost(tier i, write, L m_i) below the top)
    update       cost(top', read, L) + cost(top, write, L)   (top' is DRAM when the top is
                 rocksdb or lmdb: their block and page caches serve a row read again)
    write-backs  sum_i cost(tier i+1, write, L m_i)   (every looked-up row is trained, so
                 every eviction writes a dirty row back)

`DEFAULT_TIER_MODEL` is the model used when none is given: a host with Optane persistent
memory and an NVMe SSD, from published figures (the same as tests/data/tiers_optane_nvme.json),
not a measurement of this machine; `embstore bench tiers` measures one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DEFAULT_TIER_MODEL", "SSD_TIERS", "op_seconds", "step_seconds"]

SSD_TIERS = ("rocksdb", "lmdb")
"""Tiers whose own caches serve a row read again within a step."""

DEFAULT_TIER_MODEL: dict[str, Any] = {
    "format": "embstore.tiers", "version": 1,
    "host": "default, not measured: Optane DC PMem 100 (App Direct) and an NVMe SSD, from "
            "Izraelevitz et al., arXiv:1903.05714 (2019) and a data-center NVMe datasheet",
    "row_bytes": 260,
    "tiers": {
        "dram": {"read": {"bytes_per_s": 1.0e10, "batch_latency_s": 5e-6},
                 "write": {"bytes_per_s": 8.0e9, "batch_latency_s": 5e-6},
                 "overhead_bytes_per_row": 21},
        "pmem": {"read": {"bytes_per_s": 3.3e9, "batch_latency_s": 1e-5},
                 "write": {"bytes_per_s": 1.3e9, "batch_latency_s": 1e-5},
                 "overhead_bytes_per_row": 24},
        "rocksdb": {"read": {"bytes_per_s": 1.3e8, "batch_latency_s": 1e-4},
                    "write": {"bytes_per_s": 3.0e8, "batch_latency_s": 5e-5},
                    "overhead_bytes_per_row": 0},
        "lmdb": {"read": {"bytes_per_s": 1.5e8, "batch_latency_s": 1e-4},
                 "write": {"bytes_per_s": 6.0e7, "batch_latency_s": 1e-3},
                 "overhead_bytes_per_row": 0},
    },
}


def op_seconds(model: dict[str, Any], tier: str, op: str, rows: Any, row_bytes: Any) -> Any:
    """Seconds for one batched `op` ("read" or "write") of `rows` rows on `tier` (0 for none).

    `rows` and `row_bytes` may be numpy arrays (broadcast); a float comes back for scalars.
    """
    o = model["tiers"][tier][op]
    rows = np.asarray(rows, dtype=np.float64)
    secs = np.where(rows > 0, o["batch_latency_s"] + rows * row_bytes / o["bytes_per_s"], 0.0)
    return float(secs) if secs.ndim == 0 else secs


def step_seconds(model: dict[str, Any], backends: list[str] | tuple[str, ...], distinct: Any,
                 row_bytes: Any, misses: list[Any] | tuple[Any, ...]) -> Any:
    """Predicted seconds of one step's lookup and update through a chain (module docstring).

    Args:
        model: the tier model document.
        backends: the chain's tiers, top first.
        distinct: distinct ids looked up per step (L).
        row_bytes: stored bytes per row (weights and optimizer state).
        misses: one miss ratio per cache tier (all but the bottom), cumulative: the share of
            the L ids that none of the caches down to that one holds.
    """
    top = backends[0]
    again = "dram" if top in SSD_TIERS and "dram" in model["tiers"] else top
    secs = (op_seconds(model, top, "read", distinct, row_bytes)
            + op_seconds(model, again, "read", distinct, row_bytes)
            + op_seconds(model, top, "write", distinct, row_bytes))
    for i in range(1, len(backends)):
        reach = np.asarray(distinct, dtype=np.float64) * misses[i - 1]
        secs = secs + op_seconds(model, backends[i], "read", reach, row_bytes)
        # the promoted rows are written into the tier above the one that served them
        secs = secs + op_seconds(model, backends[i - 1], "write", reach, row_bytes)
        secs = secs + op_seconds(model, backends[i], "write", reach, row_bytes)  # write-backs
    return secs
