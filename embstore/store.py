"""`EmbeddingStore`: the public face of embstore (created by `embstore.open`).

A store holds named tables; each table's rows live in a chain of tiers (embstore.hierarchy).
Every public method validates its input completely before it changes anything, so a call
that raises an `InvalidIdsError`, `InvalidValuesError` or `UnknownTableError` leaves the store
as it was. Calls are serialised by a lock, so one store may be shared between threads.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _fused, registry
from ._validate import as_ids, as_rows
from .backend import BackendSpec
from .checkpoint import CopyState, take_checkpoint
from .errors import (
    ConfigError,
    NonFiniteValueError,
    ReadOnlyError,
    StoreClosedError,
    UnknownTableError,
)
from .hierarchy import TableChain, Tier, TierStatistics
from .index import IdGroups, IdIndex
from .spec import TableSpec, TierSpec

__all__ = ["EmbeddingStore"]

LOCK_NAME = "LOCK"
DEFAULT_TIERS = (TierSpec("dram"),)


@dataclass
class _Table:
    spec: TableSpec
    chain: TableChain
    updates_dropped: int = 0


class EmbeddingStore:
    """Embedding tables in a hierarchy of tiers. Create it with `embstore.open`.

    Example::

        with embstore.open(None, tables=[embstore.TableSpec("user", dim=16)]) as store:
            rows = store.lookup("user", np.array([3, 1, 3]))        # (3, 16)
            store.apply_gradients("user", np.array([3]), np.ones((1, 16), np.float32))
    """

    def __init__(self, path: Path | None, specs: list[TableSpec], tiers: tuple[TierSpec, ...],
                 *, read_only: bool, lock_fd: int | None) -> None:
        self._path = path
        self._default_tiers = tiers
        self._read_only = read_only
        self._lock_fd = lock_fd
        self._mutex = threading.RLock()
        self._tables: dict[str, _Table] = {}
        self._closed = False
        # checkpoints: ids written since the last one (None until one is taken) and the copy
        # in progress, which saves rows before they are overwritten
        self._changes: dict[str, IdIndex] | None = None
        self._copy: CopyState | None = None
        self._last_checkpoint: Path | None = None
        try:
            for spec in specs:
                self._tables[spec.name] = _Table(spec, self._build_chain(spec))
        except BaseException:
            self._close_tables()  # the lock stays with `open`, which releases it
            raise

    # --- construction -----------------------------------------------------------------------

    def _build_chain(self, spec: TableSpec) -> TableChain:
        tier_specs = spec.tiers or self._default_tiers
        width, dtype = spec.row_width, spec.dtype
        row_bytes = width * dtype.itemsize
        tiers: list[Tier] = []
        try:
            for level, ts in enumerate(tier_specs):
                is_bottom = level == len(tier_specs) - 1
                cls = registry.load_backend(ts.backend)
                path = None
                if self._path is not None and (cls.requires_path or is_bottom):
                    # caches live apart from the store of record and start empty on open: after
                    # a crash their unflushed rows must not shadow the bottom tier's
                    path = (self._path / f"tier{level}-{ts.backend}" if is_bottom
                            else self._path / "cache" / f"tier{level}-{ts.backend}")
                    if not is_bottom and path.exists() and not self._read_only:
                        shutil.rmtree(path / spec.name, ignore_errors=True)
                elif cls.requires_path:
                    raise ConfigError(
                        f"table {spec.name!r}: backend {ts.backend!r} needs a directory; open the "
                        "store with a path, or use only 'dram' tiers for an in-memory store"
                    )
                capacity = ts.capacity_rows(row_bytes)
                bspec = BackendSpec(path=path, dim=width, dtype=dtype, table=spec.name,
                                    read_only=self._read_only and is_bottom,
                                    capacity_bytes=None if capacity is None
                                    else capacity * row_bytes)
                backend = cls.open(bspec, **ts.options)
                if not is_bottom and len(backend):
                    backend.delete(backend.ids())  # a cache medium that kept rows: start empty
                eviction = _make_policy(ts.eviction, ts.eviction_options, "eviction")
                admission = (None if ts.admission in (None, "always")
                             else _make_policy(ts.admission, ts.admission_options, "admission"))
                if eviction is not None and is_bottom and len(backend):
                    # feature expiry must see the rows stored before this open, too
                    for ids, _ in backend.items():
                        eviction.record_insert(ids, 0)
                tiers.append(Tier(level, ts, backend, capacity, eviction, admission, is_bottom))
        except BaseException:
            for tier in tiers:
                tier.backend.close()
            raise
        return TableChain(tiers, width, dtype)

    # --- helpers ----------------------------------------------------------------------------

    def _table(self, name: str) -> _Table:
        self._check_open()
        table = self._tables.get(name)
        if table is None:
            raise UnknownTableError(name, list(self._tables))
        return table

    def _check_writable(self) -> None:
        if self._read_only:
            raise ReadOnlyError("the store was opened read-only; reopen it with read_only=False")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; open it again with embstore.open(path)")

    def _before_write(self, name: str, t: _Table, ids: np.ndarray) -> None:
        """Record distinct `ids` as changed and save their pre-images for a running checkpoint."""
        if self._changes is not None:
            self._changes[name].add(ids)
        if self._copy is not None:
            # an id not yet copied nor saved was not written since T0, and T0 began with a
            # flush: the bottom tier holds its T0 value
            self._copy.capture(name, ids, t.chain.tiers[-1].backend.get)

    def _fill_absent(self, spec: TableSpec, ids: np.ndarray, rows: np.ndarray,
                     found: np.ndarray, *, with_state: bool) -> None:
        """Give never-written rows their initial weights (and optimizer state)."""
        if found.all():
            return
        miss = np.flatnonzero(~found)
        # initializers hash every (id, column): once per distinct id, then copied
        groups = IdGroups(np.ascontiguousarray(ids[miss]))
        init = spec.init(groups.unique, spec.dim, spec.dtype)
        rows[miss, : spec.dim] = init[groups.inverse] if groups.has_duplicates else init
        if with_state and spec.row_width > spec.dim:
            rows[miss, spec.dim :] = spec.optimizer.initial_state(len(miss), spec.dim, spec.dtype)

    # --- public API -------------------------------------------------------------------------

    @property
    def path(self) -> Path | None:
        """The store's directory, or None for an in-memory store."""
        return self._path

    @property
    def read_only(self) -> bool:
        """Whether the store rejects writes."""
        return self._read_only

    @property
    def tables(self) -> list[str]:
        """Names of the store's tables."""
        return list(self._tables)

    def table_spec(self, table: str) -> TableSpec:
        """The `TableSpec` of `table`.

        Raises:
            UnknownTableError: no such table.
        """
        return self._table(table).spec

    def lookup(self, table: str, ids: Any) -> np.ndarray:
        """Weights of `ids` (1-D integers, duplicates allowed): a new array[len(ids), dim].

        The caller owns the array (nothing in the store aliases it); for tables whose
        optimizer keeps state it is a row-strided view, not C-contiguous.

        Ids never written get their initializer's value. Rows found in a lower tier may be
        promoted into a faster one.

        Raises:
            UnknownTableError, InvalidIdsError, StoreClosedError, CorruptStoreError.
        """
        with self._mutex:
            t = self._table(table)
            ids = as_ids(ids, t.spec)
            rows, found = t.chain.get(ids)
            self._fill_absent(t.spec, ids, rows, found, with_state=False)
            # with optimizer state stored beside the weights this is a strided view of a fresh
            # buffer (no copy: the copy cost more than the lookup itself)
            return rows[:, : t.spec.dim] if t.spec.row_width != t.spec.dim else rows

    def lookup_state(self, table: str, ids: Any) -> np.ndarray:
        """Optimizer state of `ids`: array[len(ids), state_width] (width 0 for SGD)."""
        with self._mutex:
            t = self._table(table)
            ids = as_ids(ids, t.spec)
            rows, found = t.chain.get(ids)
            self._fill_absent(t.spec, ids, rows, found, with_state=True)
            return rows[:, t.spec.dim :]

    def update(self, table: str, ids: Any, rows: Any) -> None:
        """Overwrite the weights of `ids` with `rows` (array[len(ids), dim] of the table dtype).

        Where an id occurs more than once the last row wins. Optimizer state is kept (new rows
        get the optimizer's initial state).

        Raises:
            UnknownTableError, InvalidIdsError, DtypeMismatchError, DimensionMismatchError,
            NonFiniteValueError, ReadOnlyError, StoreClosedError.
        """
        with self._mutex:
            t = self._table(table)
            ids = as_ids(ids, t.spec)
            rows = as_rows(rows, len(ids), t.spec)
            self._check_writable()
            groups = IdGroups(ids)
            if t.spec.row_width == t.spec.dim:
                # rows the top tier holds are overwritten where they lie, in position order
                # (the last row of an id wins): no probe beyond one, no copy of the batch
                slots = t.chain.top_slots(groups.unique, read=False)
                if slots is not None:
                    self._before_write(table, t, groups.unique)
                    t.chain.put_top_slots(groups.unique, slots, rows, row_slots=(
                        slots[groups.inverse] if groups.has_duplicates else None))
                    return
            if groups.has_duplicates:
                ids, rows = groups.unique, np.ascontiguousarray(rows[groups.last])
            if t.spec.row_width != t.spec.dim:
                full, found = t.chain.get(ids)
                self._fill_absent(t.spec, ids, full, found, with_state=True)
                full[:, : t.spec.dim] = rows
                rows = full
            self._before_write(table, t, ids)
            t.updates_dropped += int(len(ids) - np.count_nonzero(t.chain.put(ids, rows)))

    def apply_gradients(self, table: str, ids: Any, grads: Any) -> None:
        """Apply the table's fused optimizer to `ids` with `grads` (array[len(ids), dim]).

        Gradients of duplicate ids are summed in position order, then each distinct row is
        updated once together with its optimizer state. The same calls give bit-identical
        tables on any tier chain.

        Raises:
            UnknownTableError, InvalidIdsError, DtypeMismatchError, DimensionMismatchError,
            NonFiniteValueError (in the gradients, or in the result where the table forbids
            it: nothing is written then), ReadOnlyError, StoreClosedError.
        """
        with self._mutex:
            t = self._table(table)
            spec = t.spec
            ids = as_ids(ids, spec)
            grads = as_rows(grads, len(ids), spec, what="gradients")
            self._check_writable()
            # where the top tier holds every row in slots, step them there: one probe and one
            # pass over the rows, no gathered copy, no write back (see embstore/_fused.py).
            # Distinct ids (what a trainer passes) are told by their slots, without grouping
            slots = t.chain.top_slots(ids, read=False)
            if slots is None or not _fused.distinct_slots(
                    slots, t.chain.tiers[0].backend.index.high_water):
                groups = IdGroups(ids)
                if groups.has_duplicates:
                    ids, grads = groups.unique, groups.sum_rows(grads)
                    slots = None if slots is None else slots[groups.last]
            if slots is not None:
                t.chain.count_top_read(ids, slots)
            full = bad = None
            if slots is not None:
                self._before_write(table, t, ids)  # pre-images first: rows change in place
                bad = _fused.step_in_place(spec.optimizer, spec.dim, t.chain.tiers[0].backend,
                                           slots, grads, undo=not spec.allow_nonfinite)
                if bad is None:  # no kernel for this rule: step a gathered copy
                    full, bad = _fused.gather_step(spec.optimizer, spec.dim,
                                                   t.chain.tiers[0].backend, slots, grads)
            else:
                full, found = t.chain.get(ids)
                self._fill_absent(spec, ids, full, found, with_state=True)
                bad = _fused.step_rows(spec.optimizer, spec.dim, full, grads)
            if bad >= 0 and not spec.allow_nonfinite:  # the in-place step was undone
                raise NonFiniteValueError(
                    f"table {spec.name!r}: the optimizer step made row {int(ids[bad])} "
                    "non-finite (exploding gradients or learning rate?); nothing was written"
                )
            if slots is not None:
                t.chain.put_top_slots(ids, slots, full)
            else:
                self._before_write(table, t, ids)
                t.updates_dropped += int(len(ids) - np.count_nonzero(t.chain.put(ids, full)))

    def delete(self, table: str, ids: Any) -> int:
        """Remove the rows of `ids`; later lookups return initial values. Returns rows removed."""
        with self._mutex:
            t = self._table(table)
            ids = as_ids(ids, t.spec)
            self._check_writable()
            unique = IdGroups(ids).unique
            self._before_write(table, t, unique)
            return int(np.count_nonzero(t.chain.delete(unique)))

    def num_rows(self, table: str) -> int:
        """Number of stored (ever written, not deleted) rows of `table`."""
        with self._mutex:
            return len(self._table(table).chain)

    def items(self, table: str, batch_rows: int = 65536) -> Any:
        """Yield (ids, weights, state) batches over every stored row of `table`."""
        with self._mutex:
            t = self._table(table)
            dim = t.spec.dim
            for ids, rows in t.chain.items(batch_rows):
                yield ids, rows[:, :dim], rows[:, dim:]

    def checkpoint(self, dest: str | os.PathLike[str], *, step: int | None = None,
                   incremental: bool = False,
                   progress: Callable[[str, int, int], None] | None = None) -> Path:
        """Write a consistent copy of every table (weights, optimizer state, manifest, `step`).

        A full checkpoint is a store that `embstore.open(dest)` opens. With `incremental=True`
        only rows changed since this handle's previous checkpoint are written, with a link to
        it; `embstore.restore(dest, new_path)` materialises the chain. The store is locked only
        for the flush and per copied batch, so lookups and writes from other threads go on;
        the checkpoint still shows every table as it was when the call began.

        Args:
            dest: a new directory (never overwritten).
            step: the training step to record.
            incremental: write only the changes since the previous checkpoint.
            progress: called as progress(table, rows_done, rows_total) after each batch.

        Raises:
            StoreExistsError: `dest` exists.
            ConfigError: incremental without an earlier checkpoint from this handle.
        """
        return take_checkpoint(self, Path(dest), step=step, incremental=incremental,
                               progress=progress)

    def flush(self) -> None:
        """Make every acknowledged write durable in the persistent tiers.

        Dirty rows in cache tiers are written down to the store of record, which is then
        synced; after `flush` returns, a crash loses none of the writes before it.
        """
        with self._mutex:
            self._check_open()
            if self._read_only:
                return
            for t in self._tables.values():
                t.chain.flush()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per table: stored rows, dropped updates and one `TierStatistics` per tier."""
        with self._mutex:
            self._check_open()
            return {name: {"updates_dropped": t.updates_dropped,
                           "tiers": t.chain.statistics()}
                    for name, t in self._tables.items()}

    def describe(self) -> dict[str, Any]:
        """A JSON-serialisable description: path, default tiers, and per table its spec, rows,
        and per tier the counters plus the medium's own facts (e.g. libpmem in use)."""
        with self._mutex:
            self._check_open()
            tables = {}
            for name, t in self._tables.items():
                tiers = []
                for tier in t.chain.tiers:
                    entry = dataclasses.asdict(tier.statistics())
                    entry["eviction"] = tier.spec.eviction
                    entry["admission"] = tier.spec.admission
                    entry["medium"] = tier.backend.statistics()
                    tiers.append(entry)
                tables[name] = {"spec": t.spec.to_json(), "rows": len(t.chain),
                                "bytes": sum(tt["bytes"] for tt in tiers),
                                "updates_dropped": t.updates_dropped, "tiers": tiers}
            return {"path": None if self._path is None else str(self._path),
                    "read_only": self._read_only,
                    "tiers": [ts.to_json() for ts in self._default_tiers], "tables": tables}

    def tier_statistics(self, table: str) -> list[TierStatistics]:
        """One `TierStatistics` per tier of `table`, top first."""
        with self._mutex:
            return self._table(table).chain.statistics()

    def close(self) -> None:
        """Flush (unless read-only), close every tier and release the lock. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            try:
                if not self._read_only:
                    for t in self._tables.values():
                        t.chain.flush()
            finally:
                self._closed = True
                try:
                    self._close_tables()
                finally:
                    self._release_lock()

    def _close_tables(self) -> None:
        first: BaseException | None = None
        for t in self._tables.values():
            try:
                t.chain.close()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    @property
    def closed(self) -> bool:
        """Whether `close()` has been called."""
        return self._closed

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = str(self._path) if self._path else "memory"
        return f"<EmbeddingStore {where} tables={self.tables}{' closed' if self._closed else ''}>"

    def _manifest_body(self) -> dict[str, Any]:
        return {"tiers": [t.to_json() for t in self._default_tiers],
                "tables": [t.spec.to_json() for t in self._tables.values()]}


def _make_policy(name: str | None, options: dict[str, Any], kind: str) -> Any:
    """The policy `name` of family `kind` built with `options`, or None for no name."""
    if name is None:
        return None
    cls = registry.load_policy(name)
    if cls.kind != kind:
        raise ConfigError(f"{name!r} is an {cls.kind} policy, given as the {kind} policy")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"{kind} policy {name!r}: bad options {options!r} ({exc})") from exc
