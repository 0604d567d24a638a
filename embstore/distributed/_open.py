"""Opening, checkpointing and resharding sharded stores (all collective).

Layout of a sharded store's directory (and of a checkpoint of one)::

    sharded.json     world size, plan, table specs, default tiers (and the step)
    rank0/ rank1/    each rank's own embstore store of its shards

A checkpoint is complete once rank 0 has written its ``sharded.json``, after every rank has
written its shard. `restore` opens a new sharded store from a checkpoint with any number of
ranks and any plan: every rank reads the rows it now owns from the old shards (joining the
column shards of a row) and writes them, weights and optimizer state, bit for bit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from .. import _open as base_open
from .._access_log import AccessRecorder, check_rates
from ..errors import ConfigError, StoreNotFoundError
from ..manifest import make_dirs, write_atomic
from ..spec import TableSpec, TierSpec
from ..store import EmbeddingStore
from ._checkpoint import META, checkpoint_sharded
from ._comm import Comm
from ._shards import local_spec, state_layout
from .plan import Plan, default_plan
from .store import ShardedStore

__all__ = ["checkpoint_sharded", "open", "restore"]

_PLACEHOLDER = TableSpec("_no_shards", dim=1)


def _comm(group: dist.ProcessGroup | None, timeout_s: float) -> Comm:
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("embstore.distributed needs torch.distributed initialised: call "
                          "torch.distributed.init_process_group(...) on every rank first")
    if group is None:  # numpy rows travel on the CPU: a gloo group of its own, with a timeout
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return Comm(group, timeout_s)


def _read_meta(directory: Path) -> dict[str, Any] | None:
    file = directory / META
    return json.loads(file.read_text()) if file.exists() else None


def _agree(comm: Comm, value: Any, what: str) -> None:
    seen = comm.gather_objects(json.dumps(value, sort_keys=True), what)
    if len(set(seen)) != 1:
        raise ConfigError(f"ranks disagree on the {what}; every rank must open the sharded "
                          "store with the same tables, tiers and plan")


def open(path: str | os.PathLike[str] | None, tables: list[TableSpec] | None = None,
         tiers: list[TierSpec] | None = None, plan: Plan | None = None,
         group: dist.ProcessGroup | None = None, *, timeout_s: float = 300.0,
         record_accesses: str | os.PathLike[str] | None = None,
         record_sample: float | Mapping[str, float] = 1.0) -> ShardedStore:
    """Open or create a sharded store; called by every rank of the group.

    Args:
        path: the store's directory (each rank keeps ``path/rank<r>``), or None for DRAM.
        tables: global table specs (required to create; on reopen, as stored or omitted).
        tiers: the default tier chain of every rank's local store.
        plan: placement of every table (default: the stored plan, else row-wise by hash
            over all ranks); its `Plan.tiers` give a rank's shards their own chains.
            Reopening with another plan or world size needs `restore`.
        group: the process group (default: a new gloo group of all ranks with `timeout_s`).
        timeout_s: seconds a collective waits for the other ranks before PeerFailedError.
        record_accesses: a directory where each rank r logs the ids its callers pass, by
            global table, to the access log ``rank<r>`` (as `embstore.open` records them);
            ``embstore profile`` reads the directory as the log of one store called by
            rank 0, 1, ... in turn, which is what the sharded store computes.
        record_sample: the share of ids the logs keep (see `embstore.open`).

    Raises:
        ConfigError: torch.distributed not initialised, ranks that disagree, a plan that does
            not fit the tables or the stored plan.
    """
    if path is None and plan is not None:  # refused on every rank alike, before any collective
        disk = sorted({t.backend for per in plan.tiers.values() for chain in per.values()
                       for t in chain} - {"dram"})
        if disk:
            raise ConfigError(f"the plan puts shards on {disk} tiers, which need a directory; "
                              "open the sharded store with a path")
    if record_accesses is not None:
        check_rates(record_sample)  # on every rank alike, before any collective
    comm = _comm(group, timeout_s)
    directory = None if path is None else Path(path)
    meta = None if directory is None else _read_meta(directory)
    specs = list(tables or [])
    if meta is not None:
        stored = [TableSpec.from_json(t) for t in meta["tables"]]
        stored_plan = Plan.from_json(meta["plan"])
        if specs and specs != stored:
            raise ConfigError(f"{directory} holds tables {[s.name for s in stored]} with other "
                              "specs; omit tables= to use the stored ones")
        if plan is not None and plan != stored_plan or stored_plan.world_size != comm.world:
            raise ConfigError(f"{directory} was sharded for {stored_plan.world_size} ranks with "
                              "another plan; checkpoint it and embstore.distributed.restore "
                              "the checkpoint with the new world size or plan")
        specs, plan = stored, stored_plan
        tier_specs = (None if meta["tiers"] is None
                      else [TierSpec.from_json(t) for t in meta["tiers"]])
    else:
        if not specs:
            raise StoreNotFoundError(f"no sharded store at {directory} and no tables= to "
                                     "create one")
        plan = plan or default_plan(specs, comm.world)
        tier_specs = tiers
    if plan.world_size != comm.world:
        raise ConfigError(f"the plan is for {plan.world_size} ranks, the group has "
                          f"{comm.world}")
    plan.check(specs)
    tier_json = None if tier_specs is None else [t.to_json() for t in tier_specs]
    doc = {"world_size": comm.world, "plan": plan.to_json(),
           "tables": [s.to_json() for s in specs], "tiers": tier_json}
    _agree(comm, doc, "sharded store's tables, tiers and plan")
    if directory is not None and meta is None and comm.rank == 0:
        make_dirs(directory)  # its entry must survive a power cut like the record in it
        write_atomic(directory / META, json.dumps(doc, indent=1).encode())
    comm.barrier("open")
    local = _open_local(directory, comm.rank, specs, plan, tier_specs)
    recorder = None
    if record_accesses is not None:
        try:
            recorder = AccessRecorder(Path(record_accesses) / f"rank{comm.rank}",
                                      [s.name for s in specs], record_sample)
        except BaseException:
            local.close()
            raise
    return ShardedStore(comm, plan, specs, local, directory, recorder)


def _open_local(directory: Path | None, rank: int, specs: list[TableSpec], plan: Plan,
                tiers: list[TierSpec] | None) -> EmbeddingStore:
    mine = []
    for s in specs:
        if rank in plan.tables[s.name].ranks:
            local = local_spec(s, plan.tables[s.name], rank)
            chain = plan.chain(rank, s.name)  # Plan.check refused one that clashes with s.tiers
            mine.append(local if chain is None else replace(local, tiers=chain))
    mine = mine or [_PLACEHOLDER]
    where = None if directory is None else directory / f"rank{rank}"
    return base_open.open(where, tables=mine, tiers=tiers)


def restore(src: str | os.PathLike[str], path: str | os.PathLike[str] | None, *,
            plan: Plan | None = None, tiers: list[TierSpec] | None = None,
            group: dist.ProcessGroup | None = None, timeout_s: float = 300.0) -> ShardedStore:
    """Open a new sharded store at `path` holding the checkpoint `src`, resharded; collective.

    The store takes this group's size and `plan` (default: row-wise by hash over all ranks).

    Raises:
        StoreNotFoundError: `src` is not a complete sharded checkpoint.
    """
    src = Path(src)
    meta = _read_meta(src)
    if meta is None:
        raise StoreNotFoundError(f"{src} holds no {META}: not a complete sharded checkpoint")
    specs = [TableSpec.from_json(t) for t in meta["tables"]]
    old = Plan.from_json(meta["plan"])
    if tiers is None and meta["tiers"] is not None:
        tiers = [TierSpec.from_json(t) for t in meta["tiers"]]
    store = open(path, specs, tiers, plan, group, timeout_s=timeout_s)
    shards = {k: base_open.open(src / f"rank{k}", read_only=True)
              for k in range(old.world_size)}
    try:
        for spec in specs:
            ids, rows = _read_full(spec, old, shards)
            _write_mine(store, spec, ids, rows)
    finally:
        for s in shards.values():
            s.close()
    store.flush()
    return store


def _read_full(spec: TableSpec, old: Plan, shards: dict[int, EmbeddingStore]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Every stored row of `spec` in the old shards: ids [N], rows [N, dim + state]."""
    p = old.tables[spec.name]
    if p.kind != "column":
        ids: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        for k in p.ranks:
            for i, w, s in shards[k].items(spec.name):
                ids.append(i)
                rows.append(np.concatenate([w, s], axis=1))
        if not ids:
            return np.empty(0, np.int64), np.empty((0, spec.row_width), spec.dtype)
        return np.concatenate(ids), np.concatenate(rows)
    first = shards[p.ranks[0]]
    parts = [i for i, _, _ in first.items(spec.name)]
    all_ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
    out = np.empty((len(all_ids), spec.row_width), spec.dtype)
    blocks, tail = state_layout(spec)
    for k in p.ranks:
        c0, c1 = p.column_range(k)
        cw = c1 - c0
        out[:, c0:c1] = shards[k].lookup(spec.name, all_ids)
        st = shards[k].lookup_state(spec.name, all_ids)
        for b in range(blocks):
            out[:, spec.dim * (b + 1) + c0: spec.dim * (b + 1) + c1] = st[:, b * cw:(b + 1) * cw]
        if k == p.ranks[0] and tail:
            out[:, spec.dim * (blocks + 1):] = st[:, blocks * cw:]
    return all_ids, out


def _write_mine(store: ShardedStore, spec: TableSpec, ids: np.ndarray, rows: np.ndarray
                ) -> None:
    """Store the rows this rank owns under the new plan, weights and optimizer state."""
    p, rank = store.plan.tables[spec.name], store.rank
    if rank not in p.ranks:
        return
    if p.kind != "column":
        owner = np.asarray(p.ranks)[p.owner_index(ids)]
        keep = owner == rank
        ids, local = ids[keep], rows[keep]
    else:
        c0, c1 = p.column_range(rank)
        blocks, tail = state_layout(spec)
        cols = [np.arange(c0, c1) + spec.dim * b for b in range(blocks + 1)]
        cols.append(np.arange(spec.dim * (blocks + 1), spec.row_width) if tail
                    else np.empty(0, np.int64))
        local = rows[:, np.concatenate(cols)]
    if len(ids):
        # the public API writes weights only (update keeps state): put whole stored rows,
        # recorded as written first, as every write is (a row the medium later loses must
        # read as lost, not as new)
        table = store.local._tables[spec.name]
        ids = np.ascontiguousarray(ids)
        store.local._before_write(spec.name, table, ids)
        table.chain.put(ids, np.ascontiguousarray(local))
