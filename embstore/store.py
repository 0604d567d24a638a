"""`EmbeddingStore`: the public face of embstore (created by `embstore.open`).

A store holds named tables; each table's rows live in a chain of tiers (embstore.hierarchy).
Every public method validates its input completely before it changes anything, so a call
that raises an `InvalidIdsError`, `InvalidValuesError` or `UnknownTableError` leaves the store
as it was. Calls are serialised by a lock, so one store may be shared between threads.

Readers beside a writer: a store opened with `read_only=True` takes no lock and writes
nothing (no manifest rewrite, no recovery, no written-id record, no cache files: its caches
are DRAM), so it opens and reads while another process holds the store open for writing.
It reads the state as of that writer's last flush or later: every row the flush made durable,
and maybe writes made since (RocksDB: what the writer had written when the reader opened, its
log included; LMDB: what the writer had committed when each batch began; pmem: what each scan
found, records cut short skipped); rows its own DRAM cache holds stay as it first read them,
so a reader that must follow a writer opens anew. A crashed writer's files are read around
the same way. Where a lookup meets an id that the written-id record holds and no tier has,
the reader reads the record and the store of record again (`Backend.refresh`) before it
raises `CorruptStoreError`: the row may only have been flushed, or deleted, after it read
them. It raises only once two such reads agree while the record held still (a delete, then
a rewrite of the same row, between a record read and a medium read is no loss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from . import _counters, _crash, _fused, _prefetch, _write_hooks, _written, layout
from ._access_log import AccessRecorder
from ._build import build_chain, opening_tables
from ._precision import RowCodec
from ._validate import as_ids, as_pair, as_requests, as_rows
from ._written import WrittenIds
from .backend import Backend
from .checkpoint import CheckpointPlan, CopyState, take_checkpoint
from .errors import (
    ConfigError,
    CorruptStoreError,
    InvalidValuesError,
    NonFiniteValueError,
    ReadOnlyError,
    StoreClosedError,
    StoreNotFoundError,
    UnknownTableError,
)
from .hierarchy import TableChain, TierStatistics
from .index import IdGroups, IdIndex, RowSlabs
from .layout import write_manifest
from .spec import TableSpec, TierSpec

_T = TypeVar("_T")

__all__ = ["EmbeddingStore"]

DEFAULT_TIERS = (TierSpec("dram"),)
_CATCH_UPS = 8
"""Times at most a read-only store re-reads a table before a row its record holds counts as
lost (it stops sooner once two reads under a still record agree)."""
_PARALLEL_SYNCS = 8
"""Tables from which a flush syncs them on several threads."""


@dataclass
class _Table:
    spec: TableSpec
    chain: TableChain
    updates_dropped: int = 0
    codec: RowCodec | None = None
    """How rows of a half-precision table are stored; None: as the spec's dtype."""
    steps: int = 0
    """Optimizer steps applied (apply_gradients calls): seeds stochastic rounding."""
    written: WrittenIds | None = None
    """The written-id record (embstore._written); None where the table keeps none."""


def _check_in_range(name: str, t: _Table, ids: np.ndarray, rounded: np.ndarray) -> None:
    """Refuse half-precision weights `rounded` [N, dim] of `ids` that overflowed the format.

    Raises:
        NonFiniteValueError: a weight rounded to infinity and the table forbids it.
    """
    assert t.codec is not None
    if not t.spec.allow_nonfinite:
        _refuse_overflow(name, t, ids, t.codec.overflowed(rounded))


def _refuse_overflow(name: str, t: _Table, ids: np.ndarray, out: np.ndarray) -> None:
    """Raise NonFiniteValueError naming the first of `ids` whose row overflowed (`out`)."""
    assert t.codec is not None
    if out.any():
        fmt, limit = (("float16", "65504") if t.codec.precision == "fp16"
                      else ("bfloat16", "3.39e38"))
        raise NonFiniteValueError(
            f"table {name!r}: row {int(ids[np.flatnonzero(out)[0]])} overflows {fmt} "
            f"(|w| > {limit}); nothing was written: scale it down"
            + (" or use precision='bf16'" if fmt == "float16" else ""))


def _check_update_in_range(t: _Table, ids: np.ndarray, rows: np.ndarray) -> None:
    """Refuse an update of a half-precision table whose rows `rows` [N, dim] would overflow.

    Checked before anything is read or written, so a refused update moves no row between
    tiers, and `update_many` changes no table. Where an id repeats only its last row, the
    one written, counts.
    """
    if t.codec is None or t.spec.allow_nonfinite or not len(ids):
        return
    out = t.codec.overflowed(t.codec.round_nearest(rows))
    if out.any():
        groups = IdGroups(ids)
        if groups.has_duplicates:
            ids, out = groups.unique, out[groups.last]
        _refuse_overflow(t.spec.name, t, ids, out)


def _check_accessed(accessed: Any, requests: Mapping[str, Any]) -> None:
    """Refuse a `lookup_many(accessed=...)` that is no mapping or names a table not looked up.

    Raises:
        InvalidValuesError.
    """
    if not isinstance(accessed, Mapping):
        raise InvalidValuesError(f"accessed must be a mapping {{table: ids}}, got "
                                 f"{type(accessed).__name__}")
    extra = [name for name in accessed if name not in requests]
    if extra:
        raise InvalidValuesError(f"accessed names tables the call does not look up: "
                                 f"{sorted(map(repr, extra))}")


class EmbeddingStore:
    """Embedding tables in a hierarchy of tiers. Create it with `embstore.open`.

    Example::

        with embstore.open(None, tables=[embstore.TableSpec("user", dim=16)]) as store:
            rows = store.lookup("user", np.array([3, 1, 3]))        # (3, 16)
            store.apply_gradients("user", np.array([3]), np.ones((1, 16), np.float32))
    """

    def __init__(self, path: Path | None, specs: list[TableSpec], tiers: tuple[TierSpec, ...],
                 *, read_only: bool, lock_fd: int | None,
                 gradient_steps: dict[str, int] | None = None) -> None:
        self._path = path
        self._default_tiers = tiers
        self._read_only = read_only
        self._lock_fd = lock_fd
        self._mutex = threading.RLock()
        # prefetch reads the store of record without the lock; close() waits for those reads
        # to end before it closes the tiers under them
        self._reads_ended = threading.Condition(self._mutex)
        self._checkpointing = threading.Lock()
        self._tables: dict[str, _Table] = {}
        self._closed = False
        # checkpoints: ids written since the last one (None until one is taken) and the copy
        # in progress, which saves rows before they are overwritten
        self._changes: dict[str, IdIndex] | None = None
        self._copy: CopyState | None = None
        self._last_checkpoint: Path | None = None
        self._last_checkpoint_id: str | None = None  # its seal's id
        self._reading_fd: int | None = None  # a read-only handle's lock while it checkpoints
        # what earlier sessions counted (STATS.json), added to this one's at close
        self._history = _counters.load(path) if path is not None else {}
        self._last_flush: float | None = self._history.get("last_flush")
        self._checkpoint_info: dict[str, Any] | None = self._history.get("last_checkpoint")
        self._steps_saved = {name: int(n) for name, n in (gradient_steps or {}).items()}
        self._listed: set[str] | None = None  # tables the manifest says have a written record
        self._recorder: AccessRecorder | None = None  # embstore.open(..., record_accesses=)
        steps = gradient_steps or {}
        # directories this open checked for links: the tables of a tier share theirs
        self._checked: set[Path] = set()
        try:
            with opening_tables(specs, tiers, path, read_only=read_only,
                                checked=self._checked):
                for spec in specs:
                    codec = None if spec.precision == "fp32" else RowCodec(
                        spec.name, spec.precision, spec.dim, spec.row_width - spec.dim)
                    chain = self._build_chain(spec)
                    self._tables[spec.name] = _Table(spec, chain, codec=codec,
                                                     steps=int(steps.get(spec.name, 0)))
                    _crash.point("recovery.opened")
                    self._tables[spec.name].written = self._open_written(spec, chain)
            _written.write_missing([t.written for t in self._tables.values()
                                    if t.written is not None])
        except BaseException:
            self._close_tables()  # the lock stays with `open`, which releases it
            raise

    # --- construction -----------------------------------------------------------------------

    def _build_chain(self, spec: TableSpec) -> TableChain:
        chain = build_chain(spec, self._default_tiers, self._path, read_only=self._read_only,
                            checked=self._checked)
        name = spec.name
        # feature expiry drops rows as a delete does: recorded for the next incremental
        # checkpoint, pre-imaged for a running one, told to the write listeners
        def expired(ids: np.ndarray) -> None:
            self._before_write(name, self._tables[name], ids, deleting=True)

        chain.expire_listener = expired
        return chain

    def _open_written(self, spec: TableSpec, chain: TableChain) -> WrittenIds | None:
        """The written-id record of a table whose store of record persists and keeps every row.

        None for in-memory tables and for a bottom tier with a policy of its own (feature
        admission drops writes and feature expiry drops rows, on purpose).
        """
        bottom = chain.tiers[-1]
        medium = getattr(bottom.backend, "wrapped", bottom.backend)
        if (self._path is None or not medium.supports_persistence
                or bottom.eviction is not None or bottom.admission is not None):
            return None
        if self._listed is None:
            try:
                listed = layout.read_manifest(self._path).get("written_records", [])
            except StoreNotFoundError:  # being created
                listed = []
            self._listed = set(listed) if isinstance(listed, list) else set()
        file = layout.written_file(self._path, spec.name)
        if file.parent not in self._checked:
            layout.check_inside(self._path, file.parent)
            self._checked.add(file.parent)
        return WrittenIds(file, spec.num_embeddings,
                          bottom.backend.ids, read_only=self._read_only,
                          must_exist=spec.name in self._listed, defer_write=True)

    # --- helpers ----------------------------------------------------------------------------

    def _table(self, name: str) -> _Table:
        self._check_open()
        table = self._tables.get(name) if isinstance(name, str) else None
        if table is None:
            raise UnknownTableError(name, list(self._tables))
        return table

    def _check_writable(self) -> None:
        if self._read_only:
            raise ReadOnlyError("the store was opened read-only; reopen it with read_only=False")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; open it again with embstore.open(path)")

    def _before_write(self, name: str, t: _Table, ids: np.ndarray, *,
                      deleting: bool = False, held: bool | np.ndarray = False,
                      recorded: list[np.ndarray] | None = None) -> None:
        """Record distinct `ids` as changed, tell the write listeners, save pre-images.

        Pre-images are saved for a running checkpoint; the listeners are `_write_hooks`'.

        The written-id record learns them too (written, or forgotten when `deleting`), except
        those `held` says (True: all; bool[N]: where True) have a row in a tier now: every
        row in a tier was recorded when it was first written, or found in the store of
        record when the record was made. With a bool[N] `held`, the others are ones the
        record was just seen to lack (`_fill_absent` checked them under the lock).

        The ids the record learns here go into `recorded`, the list `_written_failed`
        withdraws if the write then fails: the record never holds an id whose row no tier
        got.
        """
        if self._changes is not None:
            self._changes[name].add(ids)
        _write_hooks.notify(self, name, ids)
        if self._copy is not None:
            # an id not yet copied nor saved was not written since T0, and T0 began with a
            # flush: the bottom tier holds its T0 value
            self._copy.capture(name, ids, t.chain.tiers[-1].backend.get)
        # the record last: a pre-image that cannot be saved fails the write before it
        if t.written is not None:
            if deleting:
                t.written.remove(ids)
            elif held is False:
                t.written.add(ids, into=recorded)
            elif held is not True and not held.all():
                # the rows no tier held: `_fill_absent` saw the record deny them all
                t.written.add(ids[~held], absent=True, into=recorded)

    @staticmethod
    @contextlib.contextmanager
    def _written_failed(t: _Table) -> Iterator[list[np.ndarray]]:
        """Around `_before_write` and the write: withdraw the ids recorded if either fails.

        Yields the list `_before_write` takes as `recorded`. On an I/O error or an
        interrupt, the record forgets the ids it learned for the write before the error
        goes on; a later flush would otherwise save them, and every read after it would
        report those rows lost. Entered first, so no moment is left between the record
        learning the ids and the guard being in place.
        """
        recorded: list[np.ndarray] = []
        try:
            yield recorded
        except BaseException:
            if t.written is not None:
                for ids in recorded:
                    t.written.withdraw(ids)
            raise

    def _get(self, t: _Table, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Full rows [N, row_width] of the table dtype (decoded from half precision)."""
        rows, found = self._read(t, ids)
        return (rows if t.codec is None else t.codec.decode(rows)), found

    def _read(self, t: _Table, ids: np.ndarray, *, columns: int | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows of `ids` as the chain returns them, and which were found.

        With `columns`, rows may hold only their first `columns` (see `TableChain.get`).

        A read-only store reads beside a writer that may have flushed since this handle
        read the written-id record and the medium: where the record holds an id that no tier
        found, both are read again (the record first) before the row counts as lost.
        """
        def read() -> tuple[np.ndarray, np.ndarray]:
            return t.chain.get(ids, columns=columns)

        def lost(got: tuple[np.ndarray, np.ndarray]) -> bool:
            found = got[1]
            return (t.written is not None and not found.all()
                    and bool(t.written.holds(ids[~found]).any()))

        return self._beside_writer(t, read, lost)

    def _catch_up_reader(self, t: _Table) -> None:
        """Show a read-only handle table `t` as a writer in another process left it."""
        t.written = self._open_written(t.spec, t.chain)
        t.chain.tiers[-1].backend.refresh()
        t.chain.forget_absent()

    def _beside_writer(self, t: _Table, read: Callable[[], _T], lost: Callable[[_T], bool]
                       ) -> _T:
        """`read()`, repeated in a read-only store until it shows no lost row or a settled loss.

        A loss is settled when two reads in a row show lost rows while the written-id record
        held still (`WrittenIds.held_still`). A writer in another process
        deletes a row from the journal, then the medium, and may write it again: a record read
        before the delete and a medium read after it would show the row lost. Where the record
        held still, the medium's state lay between record reads of equal state, so the loss is
        real.
        """
        got = read()
        if not self._read_only or t.written is None or not lost(got):
            return got
        settled = 0
        for attempt in range(_CATCH_UPS):
            if attempt:
                time.sleep(min(0.001 * 2 ** attempt, 0.05))  # let a burst of flushes pass
            self._catch_up_reader(t)
            got = read()
            if not lost(got):
                break
            still = t.written is not None and t.written.held_still()
            settled = settled + 1 if still else 0
            if settled == 2:
                break
        return got

    def _put(self, name: str, t: _Table, ids: np.ndarray, full: np.ndarray, *,
             step: int | None = None, held: bool | np.ndarray = False) -> None:
        """Write full rows of distinct `ids`.

        Half-precision weights are rounded to nearest, or for an optimizer step
        stochastically, seeded by `step`. `held`: as `_before_write` takes it.
        """
        rows = full
        if t.codec is not None:
            dim = t.spec.dim
            rounded = (t.codec.round_nearest(full[:, :dim]) if step is None
                       else t.codec.round_stochastic(full[:, :dim], ids, step))
            _check_in_range(name, t, ids, rounded)
            rows = t.codec.encode(full, rounded)
        with self._written_failed(t) as recorded:
            self._before_write(name, t, ids, held=held, recorded=recorded)
            written = t.chain.put(ids, rows)
        t.updates_dropped += int(len(ids) - np.count_nonzero(written))

    def _fill_absent(self, spec: TableSpec, ids: np.ndarray, rows: np.ndarray,
                     found: np.ndarray, *, with_state: bool) -> None:
        """Give never-written rows their initial weights (and optimizer state)."""
        if found.all():
            return
        miss = np.flatnonzero(~found)
        written = self._tables[spec.name].written
        if written is not None:
            lost = written.holds(ids[miss])
            if lost.any():
                self._raise_lost(spec.name, ids[miss][lost])
        # initializers hash every (id, column): once per distinct id, then copied
        groups = IdGroups(np.ascontiguousarray(ids[miss]))
        init = spec.init(groups.unique, spec.dim, spec.dtype)
        codec = self._tables[spec.name].codec
        if codec is not None:  # as a stored row would read back: the same before and after
            init = codec.quantize(init)
        rows[miss, : spec.dim] = init[groups.inverse] if groups.has_duplicates else init
        if with_state and spec.row_width > spec.dim:
            rows[miss, spec.dim :] = spec.optimizer.initial_state(len(miss), spec.dim, spec.dtype)

    def _raise_lost(self, name: str, lost: np.ndarray) -> None:
        t = self._tables[name]
        record = t.written.file if t.written is not None else None
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        raise CorruptStoreError(
            f"table {name!r}: id {int(lost[0])}{more} was written but its row is gone from "
            f"{t.chain.tiers[-1].backend.spec.path} (the written-id record {record} holds "
            "it): the medium lost it; restore the table from a checkpoint, or run `embstore "
            "fsck` to list every lost row")

    # --- public API -------------------------------------------------------------------------

    @property
    def path(self) -> Path | None:
        """The store's directory, or None for an in-memory store."""
        return self._path

    @property
    def records_accesses(self) -> bool:
        """Whether the store appends its lookups to an access log (`record_accesses=`)."""
        return self._recorder is not None

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

    def lookup(self, table: str, ids: Any, *, stored: bool = False,
               accessed: Any = None) -> np.ndarray:
        """Weights of `ids` (1-D integers, duplicates allowed): a new array[len(ids), dim].

        The caller owns the array (nothing in the store aliases it). It is C-contiguous
        where the top tier (DRAM) held every row; for tables whose optimizer keeps state it
        may otherwise be a row-strided view of rows read with their state.

        Ids never written get their initializer's value. Rows found in a lower tier may be
        promoted into a faster one.

        Args:
            table: the table.
            ids: the ids.
            stored: for a half-precision table, return the weights as stored: float16, or
                for "bf16" their bit patterns as uint16 (``torch.from_numpy(a).view(
                torch.bfloat16)`` reads them); the table dtype otherwise.
            accessed: where `ids` are the distinct ids of a batch that used some of them more
                than once, the batch's ids as it used them: what an access log records
                (`open(..., record_accesses=)`); ignored by a store that records none.

        Raises:
            UnknownTableError, InvalidIdsError, StoreClosedError, CorruptStoreError.
        """
        with self._mutex:
            t = self._table(table)
            ids = as_ids(ids, t.spec)
            if self._recorder is not None:
                self._recorder.lookup(table, ids if accessed is None
                                      else as_ids(accessed, t.spec), ids)
            return self._lookup(t, ids, stored=stored)

    def _lookup_again(self, table: str, ids: Any) -> np.ndarray:
        """`lookup` of rows a caller read before, kept out of the access log.

        For a pipeline refreshing rows it staged: the batch was logged when they were first
        read, and a second entry would also cancel the log's record of a later write.
        """
        with self._mutex:
            t = self._table(table)
            return self._lookup(t, as_ids(ids, t.spec))

    def _lookup(self, t: _Table, ids: np.ndarray, *, stored: bool = False) -> np.ndarray:
        """`lookup` of checked `ids`."""
        if t.codec is not None:
            raw, found = self._read(t, ids)
            weights = t.codec.decode_weights(raw)
            self._fill_absent(t.spec, ids, weights, found, with_state=False)
            if not stored:
                return weights
            bits = t.codec.round_nearest(weights)  # exact: the values are stored ones
            return bits.view(np.float16) if t.codec.precision == "fp16" else bits
        dim = t.spec.dim
        rows, found = self._read(t, ids, columns=dim if t.spec.row_width != dim else None)
        self._fill_absent(t.spec, ids, rows, found, with_state=False)
        # where a tier below held some rows, optimizer state was read with the weights:
        # a strided view of a fresh buffer (no copy: the copy cost more than the lookup)
        return rows[:, :dim] if rows.shape[1] != dim else rows

    def _read_top_in_place(self, table: str, ids: np.ndarray, accessed: np.ndarray | None,
                           read: Callable[[RowSlabs, np.ndarray], _T]) -> _T | None:
        """`read(slabs, slots)` over the rows of distinct `ids`, where the top tier holds them.

        For the torch adapter, which pools float32 rows straight from a DRAM tier. Under the
        store's lock, the read is counted as a lookup of `ids` is (hits, the policy's
        accesses, the access log, with `accessed` as `lookup` takes it) and the slots are
        remembered for the write that follows. None, with nothing counted or read, where
        the top tier does not hold every id in float32 slabs: the caller looks them up.
        """
        with self._mutex:
            t = self._table(table)
            ids = as_ids(ids, t.spec)
            backend = t.chain.tiers[0].backend
            if t.codec is not None or t.spec.dtype != np.float32 or not hasattr(
                    backend, "slabs_for_reading"):
                return None
            slots = t.chain.top_slots(ids)  # counted as a read
            if slots is None:
                return None
            t.chain.remember_slots(ids, slots)
            if self._recorder is not None:
                self._recorder.lookup(table, ids if accessed is None
                                      else as_ids(accessed, t.spec), ids)
            return read(cast(Any, backend).slabs_for_reading(), slots)

    def prefetch(self, table: str, ids: Any) -> int:
        """Bring the rows of `ids` into the table's fast tiers ahead of a lookup.

        Rows the top tier lacks are read from the tiers below and promoted as a lookup would
        promote them; those it holds count as read by its eviction policy (not in the hit
        statistics), so that prefetching the batches after keeps them up. No value changes:
        a later lookup returns the same values, only sooner. A pipeline calls it for the next
        batches while the current one trains.
        Returns the number of distinct ids the top tier lacked (0 for a one-tier table).

        Raises:
            UnknownTableError, InvalidIdsError, StoreClosedError, CorruptStoreError.
        """
        job: _prefetch.PrefetchJob | None = None
        rows = found = None
        try:
            with self._mutex:
                t = self._table(table)
                missing, job = _prefetch.begin(t.chain, as_ids(ids, t.spec))
                if job is None:
                    return missing
                _prefetch.watch(t.chain, job)
            # the slow read of the store of record runs without the lock: the training
            # thread's own calls go on meanwhile (embstore/_prefetch.py says why this is safe)
            rows, found = job.read()
        finally:
            # on every way out, an interrupt included: close() waits while a job reads, and
            # a job left watching would collect the ids of every later write
            if job is not None:
                job.reading = False  # first and without a call: nothing cuts it off
                with self._mutex:
                    self._reads_ended.notify_all()
                    _prefetch.end(t.chain, job, None if self._closed else rows, found)
        return missing

    def lookup_state(self, table: str, ids: Any) -> np.ndarray:
        """Optimizer state of `ids`: array[len(ids), state_width] (width 0 for SGD)."""
        with self._mutex:
            t = self._table(table)
            return self._lookup_state(t, as_ids(ids, t.spec))

    def _lookup_state(self, t: _Table, ids: np.ndarray) -> np.ndarray:
        """`lookup_state` of checked `ids`."""
        rows, found = self._get(t, ids)
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
            _check_update_in_range(t, ids, rows)
            with self._recording_write(table, ids):
                self._update(t, ids, rows)

    def _update(self, t: _Table, ids: np.ndarray, rows: np.ndarray) -> None:
        """`update` of checked `ids` and `rows`."""
        table = t.spec.name
        groups = IdGroups(ids)
        if t.spec.row_width == t.spec.dim and t.codec is None:
            # rows the top tier holds are overwritten where they lie, in position order
            # (the last row of an id wins): no probe beyond one, no copy of the batch
            slots = t.chain.top_slots(groups.unique, read=False)
            if slots is not None:
                self._before_write(table, t, groups.unique, held=True)
                t.chain.put_top_slots(groups.unique, slots, rows, row_slots=(
                    slots[groups.inverse] if groups.has_duplicates else None))
                return
        if groups.has_duplicates:
            ids, rows = groups.unique, np.ascontiguousarray(rows[groups.last])
        if t.spec.row_width != t.spec.dim:
            full, found = self._get(t, ids)
            self._fill_absent(t.spec, ids, full, found, with_state=True)
            full[:, : t.spec.dim] = rows
            rows = full
        self._put(table, t, ids, rows)

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
            ids = as_ids(ids, t.spec)
            grads = as_rows(grads, len(ids), t.spec, what="gradients")
            self._check_writable()
            with self._recording_write(table, ids):
                self._apply_gradients(t, ids, grads)

    def _apply_gradients(self, t: _Table, ids: np.ndarray, grads: np.ndarray, *,
                         distinct: bool = False) -> None:
        """`apply_gradients` of checked `ids` and `grads`; `distinct`: no id is repeated."""
        spec, table = t.spec, t.spec.name
        # where the top tier holds every row in slots, step them there: one probe and one
        # pass over the rows, no gathered copy, no write back (see embstore/_fused.py).
        # Distinct ids (what a trainer passes) are told by their slots, without grouping.
        # Half-precision rows are bytes in every tier: they take the gathered path
        slots = None if t.codec is not None else t.chain.top_slots(ids, read=False)
        if not distinct and (slots is None or not _fused.distinct_slots(
                slots, t.chain.tiers[0].slot_backend.index.high_water)):
            groups = IdGroups(ids)
            if groups.has_duplicates:
                ids, grads = groups.unique, groups.sum_rows(grads)
                slots = None if slots is None else slots[groups.last]
        if slots is not None:
            t.chain.count_top_read(ids, slots)
        full = bad = found = None
        if slots is not None:
            # pre-images first: rows change in place
            self._before_write(table, t, ids, held=True)
            bad = _fused.step_in_place(spec.optimizer, spec.dim, t.chain.tiers[0].backend,
                                       slots, grads, undo=not spec.allow_nonfinite)
            if bad is None:  # no kernel for this rule: step a gathered copy
                full, bad = _fused.gather_step(spec.optimizer, spec.dim,
                                               t.chain.tiers[0].backend, slots, grads)
        else:
            full, found = self._get(t, ids)
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
            assert full is not None
            assert found is not None
            self._put(table, t, ids, full, step=t.steps, held=found)
        t.steps += 1

    # --- several tables in one call ---------------------------------------------------------

    def lookup_many(self, requests: Mapping[str, Any], *, state: bool = False,
                    accessed: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Rows of several tables in one call: ``{table: ids}`` -> ``{table: rows}``.

        Each table gets what `lookup` (with `state`, `lookup_state`) returns for its ids. Every
        table and its ids are checked before any is read, so a call that raises changes
        nothing (no promotion, no counter); the store is locked once for the whole call.

        `accessed` gives, per table, the batch's ids as it used them where `requests` holds
        their distinct values (see `lookup`).

        Raises:
            UnknownTableError, InvalidIdsError, StoreClosedError, CorruptStoreError.
            InvalidValuesError: `requests` or `accessed` is not a mapping, or `accessed`
                names a table `requests` does not.
        """
        with self._mutex:
            checked = [(t, as_ids(ids, t.spec)) for t, ids in self._requests(requests)]
            if accessed is not None:
                _check_accessed(accessed, requests)
            if self._recorder is not None and not state:
                self._recorder.lookup_many([(t.spec, ids) for t, ids in checked], accessed)
            read = self._lookup_state if state else self._lookup
            return {t.spec.name: read(t, ids) for t, ids in checked}

    def update_many(self, requests: Mapping[str, tuple[Any, Any]]) -> None:
        """`update` of several tables in one call: ``{table: (ids, rows)}``.

        Every input is checked before any table changes.

        Raises:
            UnknownTableError, InvalidIdsError, InvalidValuesError (also: `requests` is not a
            mapping of pairs), DtypeMismatchError, DimensionMismatchError, NonFiniteValueError,
            ReadOnlyError, StoreClosedError.
        """
        self._write_many(requests, "rows", self._update, _check_update_in_range)

    def apply_gradients_many(self, requests: Mapping[str, tuple[Any, Any]]) -> None:
        """`apply_gradients` of several tables in one call: ``{table: (ids, grads)}``.

        Every input is checked before any table changes (gradients included: NaN or infinity
        anywhere rejects the whole call). Each table then takes its step in the mapping's
        order, exactly as `apply_gradients` would.

        Caveat: a step whose result would be non-finite, where the table forbids it, is only
        seen while that table steps: it raises NonFiniteValueError with that table and the
        tables after it unchanged, and the tables before it stepped.

        Raises:
            UnknownTableError, InvalidIdsError, InvalidValuesError (also: `requests` is not a
            mapping of pairs), DtypeMismatchError, DimensionMismatchError, NonFiniteValueError,
            ReadOnlyError, StoreClosedError.
        """
        self._write_many(requests, "gradients", self._apply_gradients)

    def _apply_summed_gradients(self, requests: Mapping[str, tuple[np.ndarray, np.ndarray]],
                                *, finite: bool) -> None:
        """`apply_gradients_many` for a trainer that sums its gradients per distinct id.

        Each table's ids must be distinct (an `IdGroups.unique`): the step does not look for
        repeats. With `finite` the caller has seen every gradient finite (the torch adapter's
        bag kernel checks the sums as it writes them), and they are not scanned again; ids,
        dtypes and shapes are checked as ever.
        """
        with self._mutex:
            for t, ids, values in self._pairs(requests, "gradients", checked_finite=finite):
                with self._recording_write(t.spec.name, ids):
                    self._apply_gradients(t, ids, values, distinct=True)

    def _write_many(self, requests: Mapping[str, tuple[Any, Any]], what: str,
                    write: Callable[[_Table, np.ndarray, np.ndarray], None],
                    precheck: Callable[[_Table, np.ndarray, np.ndarray], None] | None = None
                    ) -> None:
        """Check every ``{table: (ids, values)}``, then `write` each table in order.

        `precheck(table, ids, values)` runs on every table before the first is written.
        """
        with self._mutex:
            pairs = self._pairs(requests, what)
            if precheck is not None:
                for t, ids, values in pairs:
                    precheck(t, ids, values)
            for t, ids, values in pairs:
                with self._recording_write(t.spec.name, ids):
                    write(t, ids, values)

    def _requests(self, requests: Mapping[str, Any]) -> list[tuple[_Table, Any]]:
        """(table, its request) of each table of `requests`, all of them known."""
        self._check_open()
        return [(self._table(name), value) for name, value in as_requests(requests).items()]

    def _pairs(self, requests: Mapping[str, tuple[Any, Any]], what: str, *,
               checked_finite: bool = False) -> list[tuple[_Table, np.ndarray, np.ndarray]]:
        """Checked (table, ids, rows) of each ``{table: (ids, rows)}`` of a write.

        `checked_finite`: the caller has seen the rows finite (see `as_rows`).
        """
        checked = []
        for t, pair in self._requests(requests):
            given, values = as_pair(t.spec.name, pair, what)
            ids = as_ids(given, t.spec)
            checked.append((t, ids, as_rows(values, len(ids), t.spec, what=what,
                                            checked_finite=checked_finite)))
        self._check_writable()
        return checked

    def bulk_load(self, table: str, ids: Any, weights: Any, state: Any = None) -> None:
        """Load many rows at once straight into the store of record (durable on return).

        The way to fill a large table: on RocksDB the rows are written as an SST file and
        ingested (no write-ahead log, no memtable); other media take them as one write and a
        flush. Rows of ids already stored are replaced, in every tier. Call it with chunks
        of, say, a million rows to bound memory.

        Args:
            table: the table.
            ids: 1-D integers; where an id repeats, its last row wins.
            weights: array[len(ids), dim] of the table dtype.
            state: array[len(ids), state width] of optimizer state, or None for the
                optimizer's initial state.

        Raises:
            UnknownTableError, InvalidIdsError, DtypeMismatchError, DimensionMismatchError,
            NonFiniteValueError, ReadOnlyError, StoreClosedError.
            ConfigError: the table's bottom tier has a policy of its own (feature admission
                or expiry), which a bulk load would bypass.
        """
        with self._mutex:
            t = self._table(table)
            spec = t.spec
            ids = as_ids(ids, spec)
            weights = as_rows(weights, len(ids), spec, what="weights")
            width = spec.row_width - spec.dim
            if state is not None:
                try:
                    state = np.asarray(state)
                except (ValueError, TypeError, RuntimeError) as exc:  # torch's: RuntimeError
                    raise InvalidValuesError(f"table {table!r}: state is not an array: "
                                             f"{exc}") from exc
                if state.dtype != spec.dtype or state.shape != (len(ids), width):
                    raise InvalidValuesError(
                        f"table {table!r}: state must be array[{len(ids)}, {width}] of "
                        f"{spec.dtype}, got {state.dtype} {state.shape}")
                if not spec.allow_nonfinite and not np.isfinite(state).all():
                    raise NonFiniteValueError(f"table {table!r}: state holds NaN or infinity")
                unreachable = spec.optimizer.unreachable_state(state, spec.dim)
                if unreachable.any():
                    raise InvalidValuesError(
                        f"table {table!r}: the state of id {int(ids[unreachable][0])} is one "
                        f"{spec.optimizer.name} never reaches (a negative sum of squares or "
                        "step count); its next step would be NaN")
            self._check_writable()
            bottom = t.chain.tiers[-1]
            if bottom.eviction is not None or bottom.admission is not None:
                raise ConfigError(
                    f"table {table!r}: its bottom tier has a policy of its own, which a bulk "
                    "load would bypass; use update() for it")
            groups = IdGroups(ids)
            rows = np.empty((len(groups.unique), spec.row_width), dtype=spec.dtype)
            rows[:, : spec.dim] = weights[groups.last]
            if width:
                rows[:, spec.dim:] = (state[groups.last] if state is not None else
                                      spec.optimizer.initial_state(len(rows), spec.dim,
                                                                   spec.dtype))
            if t.codec is not None:
                rounded = t.codec.round_nearest(rows[:, : spec.dim])
                _check_in_range(table, t, groups.unique, rounded)
                rows = t.codec.encode(rows, rounded)
            with self._written_failed(t) as recorded:
                self._before_write(table, t, groups.unique, recorded=recorded)
                t.chain.bulk_load(groups.unique, rows)

    def delete(self, table: str, ids: Any) -> int:
        """Remove the rows of `ids`; later lookups return initial values. Returns rows removed."""
        with self._mutex:
            t = self._table(table)
            ids = as_ids(ids, t.spec)
            self._check_writable()
            unique = IdGroups(ids).unique
            self._before_write(table, t, unique, deleting=True)
            return int(np.count_nonzero(t.chain.delete(unique)))

    def num_rows(self, table: str) -> int:
        """Number of stored (ever written, not deleted) rows of `table`.

        Raises:
            UnknownTableError, StoreClosedError, CorruptStoreError: the medium lost rows the
            written-id record holds (`lost_rows` lists them; fsck reports them).
        """
        with self._mutex:
            t = self._table(table)
            held = len(t.chain)
            self._check_count(table, t, held)
            return held

    def _stored_rows(self, table: str) -> int:
        """`num_rows` without the check against the written-id record (fsck's count).

        fsck lists lost rows itself, id by id.
        """
        with self._mutex:
            return len(self._table(table).chain)

    def items(self, table: str, batch_rows: int = 65536
              ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Iterate over every stored row of `table` in (ids, weights, state) pages.

        Dirty cache rows are written back first, then the store of record is read page by
        page: the store's lock is held while one page is read, never between pages, so a
        caller may stop early or go slowly without blocking other threads. Writes made while
        the pages are read may or may not show; rows untouched meanwhile appear exactly once.

        Args:
            table: the table.
            batch_rows: rows per page at most.

        Raises:
            UnknownTableError, StoreClosedError (also between pages), ConfigError (batch_rows
            < 1), CorruptStoreError (also after the last page, where the medium lost rows
            of the written-id record: the pages passed over them).
        """
        return self._item_pages(table, batch_rows, check_lost=True)

    def _item_pages(self, table: str, batch_rows: int, *, check_lost: bool
                    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """`items`; without `check_lost` (fsck's scan, which lists lost rows itself)."""
        with self._mutex:
            t = self._table(table)
            pages = t.chain.items(batch_rows)
            record = t.written if check_lost else None
            # every id the record holds now shows, unless it is forgotten (deleted) meanwhile
            expect = None if record is None else (record, record.count(), record.forgotten)
        return self._pages(pages, t, expect)

    def _pages(self, pages: Iterator[tuple[np.ndarray, np.ndarray]], t: _Table,
               expect: tuple[WrittenIds, int, int] | None
               ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        dim, seen = t.spec.dim, 0
        while True:
            with self._mutex:
                self._check_open()
                page = next(pages, None)
                if page is None:
                    if expect is not None:
                        record, held, forgotten = expect
                        if (record is t.written
                                and seen < held - (record.forgotten - forgotten)):
                            # the scan missed ids the record held when it began: down to
                            # the store of record with the rows written meanwhile, and
                            # name those it lacks (a list of every id: only on a loss)
                            t.chain.write_back_all()
                            self._check_count(t.spec.name, t, seen, bottom=True)
                    return
            ids, rows = page
            seen += len(ids)
            if t.codec is not None:
                rows = t.codec.decode(rows)
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
                Checkpoints asked for by several threads are taken one after the other.

        A read-only handle holds the store's shared lock while it copies (writers in other
        processes cannot open it meanwhile): it sees no pre-images of their writes. It copies
        the store as the writers before it left it, and takes full checkpoints only.

        Raises:
            StoreExistsError: `dest` exists.
            ConfigError: incremental without an earlier checkpoint from this handle, or from
                a read-only handle, or after that checkpoint was removed or replaced; `dest`
                inside a store or checkpoint; `step` not None or an int >= 0.
            StoreLockedError: (read-only handles) a writer holds the store.
            StorageIOError: `dest` cannot be made or written; nothing is left of it.
            CorruptStoreError: the medium lost rows the checkpoint would hold (a copy would
                take them for rows never written); nothing is left of `dest`.
        """
        # one checkpoint at a time: each keeps its own copy state from begin to end (two
        # threads checkpointing at once would share it); other calls go on meanwhile
        with self._checkpointing:
            out = take_checkpoint(self, dest, step=step, incremental=incremental,
                                  progress=progress)
        self._checkpoint_info = {"path": str(out), "step": None if step is None else int(step),
                                 "time": time.time(),
                                 "incremental": incremental}
        return out

    # --- the checkpoint interface (embstore.checkpoint.CheckpointSource) --------------------

    def begin_checkpoint(self, incremental: bool) -> CheckpointPlan:
        """For `embstore.checkpoint`: flush, fix T0 and start saving pre-images.

        Raises:
            StoreClosedError: the store is closed.
            ConfigError: `incremental` without an earlier checkpoint from this handle.
            CorruptStoreError: a full checkpoint of a table whose medium lost rows.
        """
        with self._mutex:
            self._check_open()
            parent = self._last_checkpoint
            if incremental and self._read_only and self._path is not None:
                raise ConfigError(
                    "an incremental checkpoint needs the changes since the last one, and a "
                    "read-only handle sees none of a writer's in another process; take a full "
                    "checkpoint, or an incremental one through the writer"
                )
            if incremental and (parent is None or self._changes is None):
                raise ConfigError(
                    "an incremental checkpoint needs an earlier checkpoint taken by this handle "
                    "(changes are tracked in memory from it); take a full checkpoint first"
                )
            if self._read_only and self._path is not None:
                # a writer in another process saves no pre-images for this copy: the store
                # must hold still while it is taken
                self._reading_fd = layout.lock_for_reading(self._path)
            try:
                if self._read_only and self._path is not None:
                    # writers since the open (now gone: the lock is ours) changed the medium;
                    # some media show this handle the rows as they were at its open
                    steps = layout.read_manifest(self._path).get("gradient_steps") or {}
                    for name, t in self._tables.items():
                        self._catch_up_reader(t)
                        t.steps = int(steps.get(name, 0))  # the count that goes with the rows
                self.flush()  # every dirty row is in the store of record now: T0's rows
                scope = self._changes if incremental else None
                rows = {name: len(scope[name]) if scope is not None
                        else len(t.chain.tiers[-1].backend) for name, t in self._tables.items()}
                if scope is None:  # a copy would take lost rows for rows never written
                    for name, t in self._tables.items():
                        self._check_count(name, t, rows[name], bottom=True)
            except BaseException:
                self._release_reading_lock()  # no checkpoint began: no end_checkpoint comes
                raise
            changes = {name: IdIndex() for name in self._tables}  # changes after T0
            copy = CopyState(scope, self._changes)
            # one step, no call between: an interrupt cannot leave the changes before T0 given
            # up with no copy state to take them back from (`end_checkpoint(None)`)
            self._changes, self._copy = changes, copy
            return CheckpointPlan([t.spec for t in self._tables.values()], self._default_tiers,
                                  parent, rows, self._gradient_steps(),
                                  self._last_checkpoint_id)

    def checkpoint_pages(self, table: str, batch_rows: int
                         ) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """For `embstore.checkpoint`: (ids scanned, ids, rows, found) pages of T0 rows.

        The lock is held while one page is read and marked copied, never between pages.
        """
        with self._mutex:
            copy = self._copy
            assert copy is not None, "begin_checkpoint first"
            bottom = self._tables[table].chain.tiers[-1].backend
            if copy.scope is None:  # every stored row: a scan of the store of record
                return self._scan_pages(table, copy, bottom.items(batch_rows))
            return self._id_pages(table, copy, bottom, copy.scope[table].items()[0],
                                  batch_rows)

    def _scan_pages(self, table: str, copy: CopyState,
                    pages: Iterator[tuple[np.ndarray, np.ndarray]]
                    ) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        while True:
            with self._mutex:
                self._check_open()
                page = next(pages, None)
                if page is None:
                    return
                ids, rows = page
                fresh = copy.take(table, ids)
            yield (len(ids), ids[fresh], rows[fresh],
                   np.ones(int(np.count_nonzero(fresh)), dtype=bool))

    def _id_pages(self, table: str, copy: CopyState, bottom: Backend, scope: np.ndarray,
                  batch_rows: int) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        for start in range(0, len(scope), batch_rows):
            with self._mutex:
                self._check_open()
                ids = scope[start:start + batch_rows]
                ids = np.ascontiguousarray(ids[copy.take(table, ids)])
                rows, found = bottom.get(ids)
                written = self._tables[table].written
                if written is not None and not found.all():
                    # an id changed since the last checkpoint and not found was deleted
                    # (the record forgot it first), unless the record still holds it: lost,
                    # and the increment would restore it as deleted
                    gone = ids[~found]
                    lost = gone[written.holds(gone)]
                    if len(lost):
                        self._raise_lost(table, lost)
            yield len(ids), ids, rows, found

    def checkpoint_preimages(self, table: str
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """For `embstore.checkpoint`: the saved T0 rows of `table` after its last page."""
        with self._mutex:
            assert self._copy is not None, "begin_checkpoint first"
            return self._copy.preimages(table)

    def end_checkpoint(self, dest: Path | None, seal_id: str | None = None) -> None:
        """For `embstore.checkpoint`: stop saving pre-images; `dest` None after a failure.

        `seal_id` is the finished checkpoint's seal id, which its child checks it by.

        Without a checkpoint begun (none, or this one ended already) it does nothing: a
        failure anywhere after `begin_checkpoint` was called may end it with None.
        """
        with self._mutex:
            try:
                copy = self._copy
                if copy is None:
                    return
                if dest is not None:
                    # one step, no call between: an interrupt cannot leave the copy ended but
                    # the checkpoint unrecorded, the parent of the next incremental one
                    self._copy, self._last_checkpoint, self._last_checkpoint_id = (
                        None, dest, seal_id)
                    return
                # the changes meant for this checkpoint must go into the next incremental one
                changes = copy.changes_to_keep(self._changes)
                self._copy, self._changes = None, changes
            finally:
                self._release_reading_lock()

    def _release_reading_lock(self) -> None:
        """Let writers in again: the lock a read-only handle holds while it checkpoints."""
        fd, self._reading_fd = self._reading_fd, None
        if fd is not None:
            os.close(fd)

    def flush(self) -> None:
        """Make every acknowledged write durable in the persistent tiers.

        Dirty rows in cache tiers are written down to the store of record, which is then
        synced; after `flush` returns, a crash loses none of the writes before it.

        Raises:
            StoreClosedError: the store is closed.
            StorageIOError: the medium failed a write or a sync.
            SyncFailedError: a sync of this handle's media failed before: writes since the
                last good flush may be lost, and no later flush can make them durable; close
                the store and reopen it. (A failed write-back, unlike a failed sync, stays
                queued and a later flush retries it.)
        """
        with self._mutex:
            self._check_open()
            if self._recorder is not None:
                self._recorder.flush()
            if self._read_only:
                return
            self._flush_tables()
            self._last_flush = time.time()
            self._save_steps()

    def _flush_tables(self) -> None:
        # every table's write-backs first, then the syncs: the tables of a tier directory that
        # share one log (RocksDB) or environment (LMDB) find it synced by the first one's sync
        tables = list(self._tables.values())
        for t in tables:
            t.chain.write_back_all()
        for t in tables:
            if t.written is not None:
                t.written.before_sync()
            _crash.point("flush.before_sync")
        if tables:
            tables[0].chain.sync()
        if len(tables) <= _PARALLEL_SYNCS:
            for t in tables[1:]:
                t.chain.sync()
        else:
            # tables with files of their own (pmem, DRAM snapshots) sync each: on several
            # threads the file system commits them together (see `write_atomic_many`)
            with ThreadPoolExecutor(16, "embstore-sync") as pool:
                done = [pool.submit(t.chain.sync) for t in tables[1:]]
            failed = next((f.exception() for f in done if f.exception() is not None), None)
            if failed is not None:
                raise failed
        # each record only once its own table is synced: they are written together
        _written.after_sync([t.written for t in self._tables.values() if t.written is not None])

    def _gradient_steps(self) -> dict[str, int]:
        """Optimizer steps of every half-precision table that has taken one."""
        return {n: t.steps for n, t in self._tables.items() if t.codec is not None and t.steps}

    def _save_steps(self) -> None:
        """Record the half-precision tables' step counts in the manifest, after their rows.

        A crash between leaves a count behind its rows, which only reseeds rounding.
        """
        steps = self._gradient_steps()
        if self._path is not None and steps != self._steps_saved:
            # every other field as it stands (a restore's or import's origin, a checkpoint's
            # step and seal): only the counts change
            body = layout.read_manifest(self._path)
            body.pop("gradient_steps", None)
            if steps:
                body["gradient_steps"] = steps
            write_manifest(self._path, body)
            self._steps_saved = steps

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters per table: {"updates_dropped": int, "tiers": [TierStatistics, top first]}.

        `updates_dropped` counts writes that feature admission kept out; each
        `TierStatistics` holds the tier's lookups, hits, misses, promotions, rejected
        admissions, evictions, write-backs, rows and bytes.

        Raises:
            StoreClosedError: the store is closed.
        """
        with self._mutex:
            self._check_open()
            return {name: {"updates_dropped": t.updates_dropped,
                           "tiers": t.chain.statistics()}
                    for name, t in self._tables.items()}

    def describe(self) -> dict[str, Any]:
        """A JSON-serialisable description of the store.

        Path, default tiers, and per table its spec, rows, the rows its medium lost (ids its
        written-id record holds that no tier stores: `lost_rows`), and per tier the counters
        plus the medium's own facts (e.g. libpmem in use). A tier's `backend` is the one its chain
        declares; `stand_in` is True where a read-only open put a DRAM tier in its place (a
        cache that keeps files), whose rows and bytes are then not the cache's.
        """
        with self._mutex:
            self._check_open()
            tables = {}
            for name, t in self._tables.items():
                tiers = []
                declared = layout.table_chain(t.spec, self._default_tiers)
                for tier in t.chain.tiers:
                    entry = dataclasses.asdict(tier.statistics())
                    backend = declared[tier.level].backend
                    entry["stand_in"] = backend != entry["backend"]
                    entry["backend"] = backend
                    entry["cumulative"] = _counters.cumulative(
                        self._history, name, tier.level, backend, entry)
                    entry["eviction"] = tier.spec.eviction
                    entry["admission"] = tier.spec.admission
                    entry["medium"] = tier.backend.statistics()
                    tiers.append(entry)
                held = len(t.chain)
                # ids the written-id record holds that no tier stores: a medium that lost
                # rows (a removed file) must not read as a table with fewer rows
                lost = (len(self._lost(t, bottom=False))
                        if t.written is not None and held < t.written.count() else 0)
                tables[name] = {"spec": t.spec.to_json(), "rows": held, "lost_rows": lost,
                                "bytes": sum(tt["bytes"] for tt in tiers
                                             if not tt["stand_in"]),
                                "updates_dropped": t.updates_dropped, "tiers": tiers}
            return {"path": None if self._path is None else str(self._path),
                    "read_only": self._read_only, "last_flush": self._last_flush,
                    "last_checkpoint": self._checkpoint_info,
                    "last_close": self._history.get("closed_at"),
                    "tiers": [ts.to_json() for ts in self._default_tiers], "tables": tables}

    def lost_rows(self, table: str) -> np.ndarray:
        """Ids the written-id record holds that no tier of `table` stores (sorted int64).

        Empty for a healthy table and for tables that keep no record; fsck reports the rest.

        Raises:
            UnknownTableError, StoreClosedError, CorruptStoreError.
        """
        with self._mutex:
            return self._lost(self._table(table))

    def _lost(self, t: _Table, *, bottom: bool = False) -> np.ndarray:
        """`lost_rows` of `t` (the store's lock held).

        `bottom`: the ids its store of record lacks, though a cache tier may hold a copy.
        """
        if t.written is None:
            return np.zeros(0, dtype=np.int64)

        def read() -> np.ndarray:
            assert t.written is not None
            ids = np.ascontiguousarray(t.written.ids())
            holds = t.chain.tiers[-1].backend.contains if bottom else t.chain.contains
            return ids[~holds(ids)] if len(ids) else ids

        return self._beside_writer(t, read, lambda lost: bool(len(lost)))

    def _check_count(self, name: str, t: _Table, held: int, *, bottom: bool = False) -> None:
        """Raise if `held`, the rows `t`'s tiers hold, is short of its written-id record.

        Every id the record holds is stored, so a count below the record's means the medium
        lost rows (a removed file, say): a count or a copy must not pass over them as rows
        never written. The record's count costs nothing; the rows are listed only then.
        `bottom`: `held` counts the store of record alone (flushed, it holds every row).

        Raises:
            CorruptStoreError: rows are lost (as `lost_rows` lists them).
        """
        if t.written is None or held >= t.written.count():
            return
        lost = self._lost(t, bottom=bottom)
        if len(lost):
            self._raise_lost(name, lost)

    def tier_statistics(self, table: str) -> list[TierStatistics]:
        """One `TierStatistics` per tier of `table`, top first."""
        with self._mutex:
            return self._table(table).chain.statistics()

    def _no_unlocked_reads(self) -> bool:
        return not any(job.reading for t in self._tables.values() for job in t.chain.watchers)

    def close(self) -> None:
        """Flush (unless read-only), close every tier and release the lock. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            # reads of the store of record without the lock must end before it closes. Each
            # says so itself, whatever cut its caller short; woken by the caller's notify, or
            # by the timeout where an interrupt came before it
            while not self._reads_ended.wait_for(self._no_unlocked_reads, timeout=0.1):
                pass
            if self.closed:  # closed by another thread while this one waited
                return
            record = None
            try:
                if not self._read_only:
                    self._flush_tables()
                    self._last_flush = time.time()
                    record = self._history_record()
                    self._save_steps()
            finally:
                self._closed = True
                try:
                    self._close_tables()
                    if record is not None and self._path is not None:
                        # after the tiers closed: their files are final for the fingerprints
                        with contextlib.suppress(OSError):  # counters are not worth a failure
                            _counters.save(self._path, [t.spec for t in self._tables.values()],
                                           self._default_tiers, record, self._history,
                                           self._last_flush, self._checkpoint_info)
                finally:
                    try:
                        if self._recorder is not None:
                            self._recorder.close()
                    finally:
                        self._release_lock()

    def _history_record(self) -> dict[str, dict[str, Any]] | None:
        """This session's figures per table for `_counters.save`; None for a memory store."""
        if self._path is None:
            return None
        return {name: {"rows": len(t.chain), "updates_dropped": t.updates_dropped,
                       "tiers": [dataclasses.asdict(s) for s in t.chain.statistics()]}
                for name, t in self._tables.items()}

    def _recording_write(self, table: str,
                         ids: np.ndarray) -> contextlib.AbstractContextManager[None]:
        """Log a write of `ids` to `table` around it, taken back where the write raises."""
        if self._recorder is None:
            return contextlib.nullcontext()
        return self._recorder.writing(table, ids)

    def _attach_recorder(self, recorder: AccessRecorder | None) -> None:
        """Log this store's batches to `recorder` from now on (None: stop; embstore._access_log).

        The store closes the recorder it holds when it closes.
        """
        with self._mutex:
            self._recorder = recorder

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
        self._release_reading_lock()  # a checkpoint cut short by close()
        if self._lock_fd is not None:
            layout.release(self._lock_fd)
            self._lock_fd = None

    @property
    def closed(self) -> bool:
        """Whether `close()` has been called."""
        return self._closed

    def __enter__(self) -> EmbeddingStore:
        self._check_open()  # a closed store's with block would fail at its first call
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = str(self._path) if self._path else "memory"
        return f"<EmbeddingStore {where} tables={self.tables}{' closed' if self._closed else ''}>"
