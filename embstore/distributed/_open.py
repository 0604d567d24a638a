"""Opening sharded stores (collective), and the record beside their shards.

Layout of a sharded store's directory (and of a checkpoint of one)::

    sharded.json     world size, plan, table specs, default tiers, a checksum (and, in a
                     checkpoint, the step and each rank's checkpoint seal)
    rank0/ rank1/    each rank's own embstore store of its shards

A checkpoint is complete once rank 0 has written its ``sharded.json``, after every rank has
written its shard. `restore` (embstore/distributed/_restore.py) opens a new sharded store
from a checkpoint with any number of ranks and any plan.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from .. import _open as base_open
from .._access_log import AccessRecorder, check_rates
from .._private_dir import discard, io_error, missing_dirs
from ..errors import (
    ConfigError,
    CorruptStoreError,
    EmbstoreError,
    PeerFailedError,
    StoreNotFoundError,
)
from ..layout import table_chain
from ..manifest import (
    MANIFEST_NAME,
    json_checksum,
    make_dirs,
    read_bytes_nofollow,
    write_atomic,
)
from ..policy import real_setting
from ..spec import TableSpec, TierSpec
from ..store import DEFAULT_TIERS, EmbeddingStore
from ._checkpoint import META, checkpoint_sharded
from ._comm import Comm
from ._shards import local_spec
from .plan import Plan, default_plan
from .store import ShardedStore

__all__ = ["Record", "checkpoint_sharded", "open", "read_record"]

_PLACEHOLDER = TableSpec("_no_shards", dim=1)
_DEFAULT_TIMEOUT_S = 300.0
"""Seconds the store's own group waits for the other ranks, where `open` is given none."""
_META_LIMIT = 1 << 30
"""Largest record read: tables, tiers and plan are JSON of a few hundred bytes a table."""


def _comm(group: dist.ProcessGroup | None, timeout_s: float | None) -> Comm:
    """The store's communicator over `group`, else over a gloo group of its own.

    `timeout_s` is the own group's timeout (300 s where None). A caller's group keeps the
    timeout it was created with: the store cannot give its own calls another one (gloo and
    NCCL fix it per group), and setting the group's would change the caller's other
    collectives too (a DDP all-reduce, say). So a `timeout_s` given with `group` is refused
    on every rank, rather than silently left unused, and errors name the group's timeout.
    """
    if timeout_s is not None:  # refused as no duration before anything else
        timeout_s = real_setting("embstore.distributed", "timeout_s", timeout_s, 0, 1e9,
                                 low_open=True)
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("embstore.distributed needs torch.distributed initialised: call "
                          "torch.distributed.init_process_group(...) on every rank first")
    if group is not None:
        comm = Comm(group, None)
        error = None if timeout_s is None else ConfigError(
            f"timeout_s={timeout_s!r} cannot apply to the group= given: its collectives wait "
            f"as long as the group's own timeout ({_seconds(comm.timeout_s)}, set where it was "
            "created: init_process_group(timeout=...) or new_group(timeout=...)); omit "
            "timeout_s, or omit group= for a group of the store's own with that timeout")
        comm.agree(error, "sharded store's timeout")
        return comm
    timeout_s = _DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    try:  # numpy rows travel on the CPU: a gloo group of its own, with a timeout
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:
        raise PeerFailedError(
            f"creating the sharded store's process group failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); every rank must open the "
            "sharded store at the same time") from exc
    return Comm(group, timeout_s)


def _seconds(timeout_s: float | None) -> str:
    return "unknown" if timeout_s is None else f"{timeout_s:g} s"


class Record(NamedTuple):
    """A sharded store's or checkpoint's record (sharded.json)."""

    specs: list[TableSpec]
    plan: Plan
    tiers: list[TierSpec] | None
    seals: list[str] | None
    """A checkpoint's: each rank's checkpoint seal id, in rank order (None: not recorded)."""


def read_record(directory: Path) -> Record | None:
    """The record in `directory`, None where it has none.

    Raises:
        CorruptStoreError: the record is unreadable, fails its checksum (records written
            without one are taken as they are) or does not hold together.
    """
    file = directory / META
    try:
        # not followed if a link: a dangling one would otherwise read as no record at all
        raw = read_bytes_nofollow(file, _META_LIMIT)
    except (FileNotFoundError, NotADirectoryError):  # the latter: creating it will say why
        return None
    except OSError as exc:
        raise io_error(exc, file, "read") from None
    try:
        meta = json.loads(raw)
        stored = meta.pop("checksum", None)
        if stored is not None and stored != json_checksum(meta):
            raise ValueError("it fails its checksum")
        specs = [TableSpec.from_json(t) for t in meta["tables"]]
        plan = Plan.from_json(meta["plan"])
        tiers = None if meta["tiers"] is None else [TierSpec.from_json(t) for t in meta["tiers"]]
        plan.check(specs)
        seals = meta.get("shard_seals")
        if seals is not None and not (isinstance(seals, list) and len(seals) == plan.world_size
                                      and all(isinstance(x, str) for x in seals)):
            raise ValueError(f"shard_seals is not one seal id per rank: {seals!r:.80}")
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError,
            RecursionError, ConfigError) as exc:
        raise CorruptStoreError(f"{file} is damaged ({type(exc).__name__}: {exc}); restore the "
                                "sharded store from a checkpoint") from None
    return Record(specs, plan, tiers, seals)


def _check_no_shards(directory: Path) -> None:
    """Refuse to create a sharded store where ranks' shards lie without the store's record.

    The record is written once every rank holds its shards, before any row: shards without
    it mean the record was removed (a new store made there would serve every row as never
    written) or the creation was cut short.
    """
    try:
        shards = sorted(p.name for p in directory.iterdir() if p.name.startswith("rank"))
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise io_error(exc, directory, "list") from None
    if shards:
        raise CorruptStoreError(
            f"{directory} holds shards ({', '.join(shards[:4])}) but no record {META}: the "
            "record was removed, or the store's creation was cut short. Restore the sharded "
            "store from a checkpoint; if it never held rows (its creation was interrupted), "
            "remove the directory and create the store again")


@dataclass
class _Made:
    """What this rank made for a new sharded store: removed again if the opening fails."""

    root: list[Path] = field(default_factory=list)
    """Rank 0: the store's directory and the parents made for it, nearest first."""
    own: Path | None = None
    """This rank's ``rank<r>`` directory, where it did not exist."""

    def discard(self) -> None:
        if self.own is not None:
            shutil.rmtree(self.own, ignore_errors=True)
        for _ in range(20):  # another rank may still be closing its store inside it
            if not self.root or not self.root[0].exists():
                return
            discard(self.root[0], self.root[1:])
            time.sleep(0.05)


def open(path: str | os.PathLike[str] | None, tables: list[TableSpec] | None = None,
         tiers: list[TierSpec] | None = None, plan: Plan | None = None,
         group: dist.ProcessGroup | None = None, *, timeout_s: float | None = None,
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
        timeout_s: seconds a collective of the store's own group waits for the other ranks
            before PeerFailedError (default 300). A `group` given keeps its own timeout:
            both together are refused.
        record_accesses: a directory where each rank r logs the ids its callers pass, by
            global table, to the access log ``rank<r>`` (as `embstore.open` records them);
            ``embstore profile`` reads the directory as the log of one store called by
            rank 0, 1, ... in turn, which is what the sharded store computes.
        record_sample: the share of ids the logs keep (see `embstore.open`).

    Raises:
        ConfigError: torch.distributed not initialised, ranks that disagree, a plan that does
            not fit the tables or the stored plan, `timeout_s` with `group`.
    """
    directory = None if path is None else Path(path)
    if not dist.is_available() or not dist.is_initialized():  # no peers to tell: say why first
        _check_args(directory, plan, record_accesses, record_sample)
    comm = _comm(group, timeout_s)
    store, _ = _open(comm, directory, tables, tiers, plan, record_accesses, record_sample)
    return store


def _open(comm: Comm, directory: Path | None, tables: list[TableSpec] | None,
          tiers: list[TierSpec] | None, plan: Plan | None,
          record_accesses: str | os.PathLike[str] | None = None,
          record_sample: float | Mapping[str, float] = 1.0, *, publish: bool = True
          ) -> tuple[ShardedStore, _Made]:
    """`open` over `comm`: every check on every rank, agreed before anything is created.

    Returns the store and what this rank made for it. With `publish` False a new store's
    record (sharded.json) is left for the caller to write with `_publish` once it holds what
    it should (or to remove what was made with `_abandon`).
    """
    error: BaseException | None = None
    doc: dict[str, Any] = {}
    meta = None
    try:
        _check_args(directory, plan, record_accesses, record_sample)
        meta, specs, placed, tier_specs = _settle(comm, directory, tables, tiers, plan)
        tier_json = None if tier_specs is None else [t.to_json() for t in tier_specs]
        doc = {"world_size": comm.world, "plan": placed.to_json(),
               "tables": [s.to_json() for s in specs], "tiers": tier_json}
    except EmbstoreError as exc:
        error = exc
    comm.agree(error, "sharded store's tables, tiers and plan",
               {**doc, "directory": None if directory is None else os.path.abspath(directory)})
    return _open_made(comm, directory, meta, specs, placed, tier_specs, doc, record_accesses,
                      record_sample, publish=publish)


def _open_made(comm: Comm, directory: Path | None, meta: Any, specs: list[TableSpec],
               placed: Plan, tier_specs: list[TierSpec] | None, doc: dict[str, Any],
               record_accesses: str | os.PathLike[str] | None,
               record_sample: float | Mapping[str, float], *, publish: bool
               ) -> tuple[ShardedStore, _Made]:
    """Make (or reopen) the agreed store, and say what this rank made for it.

    A failure on any rank makes every rank raise at once, and what the ranks made for a new
    store is removed, so that the same call can be made again.
    """
    new = directory is not None and meta is None
    made = _Made()
    error: BaseException | None = None
    if new and comm.rank == 0:
        assert directory is not None
        made.root = missing_dirs(directory)
        try:
            make_dirs(directory)  # its entry must survive a power cut like the record in it
        except OSError as exc:
            error = io_error(exc, directory, "create")
    comm.agree(error, "sharded store's directory", undo=made.discard)
    error = None
    local = recorder = None
    try:
        if new:
            assert directory is not None
            where = directory / f"rank{comm.rank}"
            made.own = None if where.exists() else where
        local = _open_local(directory, comm.rank, specs, placed, tier_specs, meta is not None)
        if record_accesses is not None:
            recorder = AccessRecorder(Path(record_accesses) / f"rank{comm.rank}",
                                      [s.name for s in specs], record_sample)
    except OSError as exc:
        error = io_error(exc, directory or Path(), "open")
    except Exception as exc:
        error = exc

    def undo() -> None:
        _close_quietly(local, recorder)
        made.discard()

    comm.agree(error, "opening of every rank's shards", undo=undo)
    assert local is not None
    store = ShardedStore(comm, placed, specs, local, directory, recorder)
    if new and publish:
        _publish(store, doc, made)
    return store, made


def _settle(comm: Comm, directory: Path | None, tables: list[TableSpec] | None,
            tiers: list[TierSpec] | None, plan: Plan | None
            ) -> tuple[Any, list[TableSpec], Plan, list[TierSpec] | None]:
    """This rank's view of the store to open: (stored record or None, specs, plan, tiers)."""
    meta = None if directory is None else read_record(directory)
    specs = list(tables or [])
    if meta is not None:
        stored, stored_plan, tier_specs = meta.specs, meta.plan, meta.tiers
        if specs and specs != stored:
            raise ConfigError(f"{directory} holds tables {[s.name for s in stored]} with other "
                              "specs; omit tables= to use the stored ones")
        if plan is not None and plan != stored_plan or stored_plan.world_size != comm.world:
            raise ConfigError(f"{directory} was sharded for {stored_plan.world_size} ranks with "
                              "another plan; checkpoint it and embstore.distributed.restore "
                              "the checkpoint with the new world size or plan")
        specs, plan = stored, stored_plan
    else:
        if directory is not None:
            _check_no_shards(directory)
        if not specs:
            raise StoreNotFoundError(f"no sharded store at {directory} and no tables= to "
                                     "create one")
        plan = plan or default_plan(specs, comm.world)
        tier_specs = tiers
    if plan.world_size != comm.world:
        raise ConfigError(f"the plan is for {plan.world_size} ranks, the group has "
                          f"{comm.world}")
    plan.check(specs)
    if any(s.name == _PLACEHOLDER.name for s in specs):
        # a rank that holds no shard keeps this empty table in its local store (a store has
        # at least one): a user table of that name would be that placeholder on such a rank
        raise ConfigError(f"table name {_PLACEHOLDER.name!r} is reserved in a sharded store "
                          "(the empty table of a rank that holds no shard); name it otherwise")
    _refuse_partial_records(specs, plan, tier_specs)
    return meta, specs, plan, tier_specs


def _refuse_partial_records(specs: list[TableSpec], plan: Plan,
                            tiers: list[TierSpec] | None) -> None:
    """Refuse a shard whose store of record may drop rows (an admission or eviction policy).

    Such a policy decides on what its own rank sees (its shard's ids, their frequencies, its
    rows' count against the capacity): one store fed every rank's calls would admit and keep
    other rows, so the sharded store would give other results than the one store it stands
    for. Checked on every rank for every rank's chain, so that all refuse alike before
    anything is made. Cache tiers above the store of record may have any policy: they only
    change where rows are read from.
    """
    default = tiers or DEFAULT_TIERS
    for spec in specs:
        for rank in plan.tables[spec.name].ranks:
            bottom = (plan.chain(rank, spec.name) or table_chain(spec, default))[-1]
            policy = [f"admission {bottom.admission!r}"] if bottom.admission not in (
                None, "always") else []
            if bottom.eviction is not None:
                policy.append(f"eviction {bottom.eviction!r}" + (
                    "" if bottom.capacity is None else f" (capacity {bottom.capacity})"))
            if policy:
                raise ConfigError(
                    f"table {spec.name!r}: rank {rank}'s store of record (its last tier, "
                    f"{bottom.backend}) has {' and '.join(policy)}, which may drop rows; in a "
                    "sharded store each rank's policy sees only its own shard, so the rows "
                    "kept would differ from one store's. Give the last tier neither (no "
                    "capacity, admission 'always') and put a bounded or admitting cache tier "
                    "above it")


def _check_args(directory: Path | None, plan: Plan | None,
                record_accesses: str | os.PathLike[str] | None,
                record_sample: float | Mapping[str, float]) -> None:
    """Refuse arguments that are wrong whatever is stored."""
    _check_plan(plan)
    if directory is None and plan is not None:
        disk = sorted({t.backend for per in plan.tiers.values() for chain in per.values()
                       for t in chain} - {"dram"})
        if disk:
            raise ConfigError(f"the plan puts shards on {disk} tiers, which need a directory; "
                              "open the sharded store with a path")
    if record_accesses is not None:
        check_rates(record_sample)


def _check_plan(plan: Any) -> None:
    if plan is not None and not isinstance(plan, Plan):
        raise ConfigError(f"plan must be an embstore.distributed.Plan or None, got "
                          f"{type(plan).__name__}")


def _publish(store: ShardedStore, doc: dict[str, Any], made: _Made) -> None:
    """Write a new store's record once every rank holds its shards (collective).

    If rank 0 cannot, every rank closes its shards (releasing their locks) and what the
    ranks made for the store is removed.
    """
    error: BaseException | None = None
    if store.rank == 0:
        assert store.path is not None
        try:
            doc = {**doc, "checksum": json_checksum(doc)}
            write_atomic(store.path / META, json.dumps(doc, indent=1, allow_nan=False).encode())
        except OSError as exc:
            error = io_error(exc, store.path / META, "write")
        except Exception as exc:
            error = exc
    store._comm.agree(error, "sharded store's record", undo=lambda: _abandon(store, made))


def _abandon(store: ShardedStore, made: _Made) -> None:
    """Close this rank's part of a store that failed to open, and remove what it made."""
    _close_quietly(store.local, store._recorder)
    made.discard()


def _close_quietly(*opened: EmbeddingStore | AccessRecorder | None) -> None:
    for x in opened:
        if x is not None:
            with contextlib.suppress(EmbstoreError):
                x.close()


def _open_local(directory: Path | None, rank: int, specs: list[TableSpec], plan: Plan,
                tiers: list[TierSpec] | None, reopen: bool = False) -> EmbeddingStore:
    mine = []
    for s in specs:
        if rank in plan.tables[s.name].ranks:
            local = local_spec(s, plan.tables[s.name], rank)
            chain = plan.chain(rank, s.name)  # Plan.check refused one that clashes with s.tiers
            mine.append(local if chain is None else replace(local, tiers=chain))
    mine = mine or [_PLACEHOLDER]
    where = None if directory is None else directory / f"rank{rank}"
    if reopen and where is not None and not (where / MANIFEST_NAME).exists():
        # created with the store: without it this rank's rows would read as never written
        raise CorruptStoreError(f"{where} holds no store: rank {rank}'s shards of {directory} "
                                "are lost; restore the sharded store from a checkpoint")
    return base_open.open(where, tables=mine, tiers=tiers)
