"""Restoring a sharded checkpoint into a new sharded store, resharded (collective).

Every rank reads the rows it now owns from the old shards (joining the column shards of a
row) and writes them, weights and optimizer state, bit for bit. The checkpoint's record
names each rank's checkpoint seal: a shard from another checkpoint, a shard of a table the
plan puts elsewhere, or shards of more ranks than the record lists are refused, as the
single store's restore refuses files of another checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch.distributed as dist

from .. import _open as base_open
from .._private_dir import io_error
from ..checkpoint import _as_path
from ..errors import CorruptStoreError, StoreExistsError, StoreNotFoundError
from ..manifest import read_manifest
from ..spec import TableSpec, TierSpec
from ..store import EmbeddingStore
from ._checkpoint import META
from ._open import _abandon, _close_quietly, _comm, _open, _publish, read_record
from ._shards import local_spec, state_layout
from .plan import Plan
from .store import ShardedStore

__all__ = ["restore"]


def restore(src: str | os.PathLike[str], path: str | os.PathLike[str] | None, *,
            plan: Plan | None = None, tiers: list[TierSpec] | None = None,
            group: dist.ProcessGroup | None = None, timeout_s: float | None = None
            ) -> ShardedStore:
    """Open a new sharded store at `path` holding the checkpoint `src`, resharded; collective.

    The store takes this group's size and `plan` (default: row-wise by hash over all ranks).

    Raises:
        StoreNotFoundError: `src` is not a complete sharded checkpoint.
        StoreExistsError: `path` exists.
        CorruptStoreError: `src`'s record or shards are damaged, missing or do not match
            its plan. Nothing is left at `path` that opens as a store.
    """
    comm = _comm(group, timeout_s)
    error: BaseException | None = None
    shards: dict[int, EmbeddingStore] = {}
    src_path, dest = Path(), None
    try:
        src_path = _as_path(src, "the checkpoint to restore")
        dest = None if path is None else _as_path(path, "the restored store's path")
        if dest is not None and (dest.exists() or dest.is_symlink()):
            raise StoreExistsError(f"{dest} exists; restore into a new directory")
        meta = read_record(src_path)
        if meta is None:
            raise StoreNotFoundError(f"{src_path} holds no {META}: not a complete sharded "
                                     "checkpoint")
        specs, old = meta.specs, meta.plan
        tiers = meta.tiers if tiers is None else tiers
        _check_no_other_ranks(src_path, old.world_size)
        for k in range(old.world_size):
            try:
                shards[k] = base_open.open(src_path / f"rank{k}", read_only=True)
            except StoreNotFoundError:
                raise CorruptStoreError(f"{src_path} has no shards of rank {k} (its {META} "
                                        f"lists {old.world_size} ranks): the checkpoint is not "
                                        "complete; restore another one") from None
            _check_shard(src_path / f"rank{k}", shards[k], specs, old, k,
                         None if meta.seals is None else meta.seals[k])
    except OSError as exc:
        error = io_error(exc, src_path, "read the checkpoint")
    except Exception as exc:
        error = exc
    try:
        # ranks given other checkpoints would mix them (`_open` agrees on the destination)
        comm.agree(error, "restore's checks of the checkpoint",
                   None if error is not None else os.path.abspath(src_path))
        store, made = _open(comm, dest, specs, tiers, plan, publish=False)
    except BaseException:
        _close_quietly(*shards.values())
        raise
    error = None
    try:
        for spec in specs:
            ids, rows = _read_full(spec, old, shards)
            _write_mine(store, spec, ids, rows, _steps_taken(spec, old, shards))
        store.local.flush()
    except OSError as exc:
        error = io_error(exc, dest or src_path, "restore into")
    except Exception as exc:
        error = exc
    finally:
        _close_quietly(*shards.values())
    # no record is written: what the ranks made at `path` is removed, so that the restore
    # can be made again
    comm.agree(error, "restore of the checkpoint", undo=lambda: _abandon(store, made))
    if dest is not None:
        doc = {"world_size": comm.world, "plan": store.plan.to_json(),
               "tables": [s.to_json() for s in specs],
               "tiers": None if tiers is None else [t.to_json() for t in tiers]}
        _publish(store, doc, made)
    return store


def _check_no_other_ranks(src: Path, world: int) -> None:
    """Refuse a checkpoint holding shards of ranks its record does not list."""
    extra = sorted(p.name for p in src.iterdir() if p.name.startswith("rank")
                   and p.name[4:].isdigit() and int(p.name[4:]) >= world)
    if extra:
        ranks = f"{world} rank{'' if world == 1 else 's'}"
        raise CorruptStoreError(f"{src} holds shards of {', '.join(extra[:4])}, but its {META} "
                                f"lists {ranks}: the record is damaged or another checkpoint's; "
                                "restore another one")


def _check_shard(where: Path, shard: EmbeddingStore, specs: list[TableSpec], plan: Plan,
                 rank: int, seal: str | None) -> None:
    """Refuse a rank's checkpointed store that is not its shards under `plan`.

    Also one that is not the checkpoint the record names (`seal`: its seal id, None where
    the record has none).
    """
    if seal is not None:
        have = (read_manifest(where).get("checkpoint_seal") or {}).get("id")
        if have != seal:
            raise CorruptStoreError(f"{where} is not the shard checkpoint its {META} names (a "
                                    "shard of another checkpoint put in its place?); restore "
                                    "from a complete checkpoint")
    for spec in specs:
        p = plan.tables[spec.name]
        if rank not in p.ranks:
            if spec.name in shard.tables:
                raise CorruptStoreError(f"{where} holds table {spec.name!r}, which the "
                                        f"checkpoint's plan does not place on rank {rank} (its "
                                        f"{META} is damaged or another store's); restore from "
                                        "a complete checkpoint")
            continue
        want = replace(local_spec(spec, p, rank), tiers=None).to_json()
        got = (replace(shard.table_spec(spec.name), tiers=None).to_json()
               if spec.name in shard.tables else None)
        if got != want:
            raise CorruptStoreError(f"{where} does not hold rank {rank}'s shard of table "
                                    f"{spec.name!r} under the checkpoint's plan (a shard of "
                                    "another store or plan?); restore from a complete "
                                    "checkpoint")


def _steps_taken(spec: TableSpec, old: Plan, shards: dict[int, EmbeddingStore]) -> int:
    """The optimizer steps table `spec` took (every owner counts every step).

    They seed the stochastic rounding of a half-precision table's next steps.
    """
    return max(shards[k]._tables[spec.name].steps for k in old.tables[spec.name].ranks)


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


def _write_mine(store: ShardedStore, spec: TableSpec, ids: np.ndarray, rows: np.ndarray,
                steps: int) -> None:
    """Store the rows this rank owns under the new plan, weights and optimizer state.

    `rows`: float32 [N, dim + state] as read (decoded from half precision); `steps`: the
    table's optimizer steps so far.
    """
    p, rank = store.plan.tables[spec.name], store.rank
    if rank not in p.ranks:
        return
    table = store.local._tables[spec.name]
    table.steps = steps
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
        ids = np.ascontiguousarray(ids)
        if table.codec is not None:  # half-precision weights: exact, they were read from it
            local = table.codec.encode(local, table.codec.round_nearest(local[:, :spec.dim]))
        with store.local._written_failed(table) as recorded:
            store.local._before_write(spec.name, table, ids, recorded=recorded)
            table.chain.put(ids, np.ascontiguousarray(local))
