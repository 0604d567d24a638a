"""`TrainPipeline`: fetch the next batches' rows while the current batch computes.

A background thread walks the batches ahead of the training loop, up to `depth` batches
ahead: for each one it checks the sparse inputs, groups their ids, and brings the distinct
rows the store's DRAM tier lacks up from the slower tiers (`EmbeddingStore.prefetch`). The
loop gets the same batch objects in order, and each module's forward on the very arguments
that were prepared skips the checks and reads its rows, now from DRAM. The tables of one batch
are fetched concurrently, on up to `read_threads` threads: a read of a bottom tier mostly waits
for the device (a page of an SST file, a page of LMDB's map), and a disk serves several
outstanding reads in about the time of one.

On a GPU the thread also stages the rows themselves: looked up into pinned host memory, then
copied onto the device on a side CUDA stream, so the forward finds them there. Staged rows
were read before the updates of the steps before them had all been applied: while staged rows
wait for their step, every write to a store is logged (a count, the table and the ids: the
modules' updates, and a trainer's own `update`, `apply_gradients`, `bulk_load` or `delete`
alike), and when batch j's turn comes the
staged rows of every id written since they were read are read again, so batch j sees exactly
what the loop without the pipeline would see, bit for bit. The count is read before each
lookup and bumped by each write under the store's lock, so a write that raced a lookup is
refreshed rather than missed. On the CPU nothing is staged (a DRAM read in the forward costs
what a copy would) and exactness holds by construction: prefetching changes where rows are,
not what they are.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch

from .. import _write_hooks
from .._parallel import available_cores
from ..errors import ConfigError, EmbstoreError, InvalidIdsError
from ..index import IdIndex
from ..store import EmbeddingStore
from ._core import ForwardPlan, lookup_rows
from .modules import _check_flag, _StoreModule

__all__ = ["TrainPipeline"]

B = TypeVar("B")
_END = object()
_CLOSED = object()  # queued by close(): wakes a step waiting for a batch


def _collective(module: _StoreModule) -> bool:
    """Whether the module's store is collective (embstore.distributed's sharded store)."""
    return bool(getattr(module.store, "collective", False))


_MAX_READ_THREADS = 4


def default_read_threads() -> int:
    """`TrainPipeline`'s read threads when none are given: a core each beside training's."""
    return max(1, min(available_cores() - 1, _MAX_READ_THREADS))


def _weak_hook(me: weakref.ref[TrainPipeline[Any]]) -> Callable[..., None]:
    """A write listener that logs into the pipeline `me` while it lives."""
    def hook(store: EmbeddingStore, table: str, ids: np.ndarray) -> None:
        pipeline = me()
        if pipeline is not None:
            pipeline._on_update(store, table, ids)
    return hook


def _weak_catch_up(me: weakref.ref[TrainPipeline[Any]]
                   ) -> Callable[[_StoreModule, ForwardPlan], None]:
    """`TrainPipeline._catch_up` of `me` while it lives: a staged plan must not keep it."""
    def catch_up(module: _StoreModule, plan: ForwardPlan) -> None:
        pipeline = me()
        if pipeline is not None:
            pipeline._catch_up(module, plan)
    return catch_up


def _abandon(stop: threading.Event, hook: Callable[..., None],
             readers: ThreadPoolExecutor | None,
             touched: dict[_StoreModule, ForwardPlan]) -> None:
    """What close() does for a pipeline collected unclosed, short of waiting for the thread.

    The thread sees `stop` within 0.1 s of waiting for a free slot (or once the batches'
    iterator hands it its next batch) and ends.
    """
    stop.set()
    _write_hooks.remove(hook)
    if readers is not None:
        readers.shutdown(wait=False)
    _unstage(touched)


def _unstage(touched: dict[_StoreModule, ForwardPlan]) -> None:
    """Drop the plans a pipeline staged and no forward used: not another pipeline's."""
    for module, plan in touched.items():
        if module._staged is plan:
            module._staged = None


def _closed_early() -> ConfigError:
    return ConfigError("this TrainPipeline was closed before its batches ended; make a new one "
                       "to go on")


class TrainPipeline(Generic[B]):
    """Iterate `batches` with the store rows of the next `depth` batches fetched ahead.

    Args:
        batches: the training batches, consumed by the pipeline's thread in order.
        inputs: ``inputs(batch) -> {module: args}``: for each embstore module the model will
            call on this batch, the arguments it will be called with (a tuple, or one object
            for a single argument), as the very objects the model passes.
        depth: batches prepared ahead of the one being trained (>= 1).
        stage_rows: also stage the rows themselves (default: for modules on CUDA only).
        exact: refresh staged rows that earlier steps updated (default). False trains on
            staged rows up to `depth` steps stale, which is cheaper and no longer
            bit-identical.
        read_threads: tables of one batch fetched at once (>= 1). Reads of the slower
            tiers run without the store's lock, so each waits for its device independently.
            Default: the cores this process may use less the training thread's, at most 4
            (on 2 cores one: with the reads served from the page cache, three more threads
            only took turns on the one free core, and the demo's tiered steps ran 8% slower).

    Example::

        with embstore.torch.TrainPipeline(loader, inputs=lambda b: {ebc: b.sparse}) as pipe:
            for batch in pipe:
                loss = loss_fn(model(batch.dense, batch.sparse), batch.labels)
                optimizer.zero_grad(); loss.backward(); optimizer.step()

    An error in the background thread (the batches' iterator, a lookup) is raised by the next
    step of the loop; ids a store refuses are left to the module's forward, which raises the
    error at its step as it would without the pipeline. Leaving the ``with`` block, or
    `close()`, stops and joins the threads.
    """

    def __init__(self, batches: Iterable[B], inputs: Callable[[B], Mapping[Any, Any]], *,
                 depth: int = 2, stage_rows: bool | None = None, exact: bool = True,
                 read_threads: int | None = None) -> None:
        if not callable(inputs):
            raise ConfigError(f"inputs must be a function of a batch, got "
                              f"{type(inputs).__name__}")
        try:
            batches_iter = iter(batches)
        except TypeError:
            raise ConfigError(f"batches must be an iterable of batches, got "
                              f"{type(batches).__name__}") from None
        if read_threads is None:
            read_threads = default_read_threads()
        for name, value in (("depth", depth), ("read_threads", read_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        _check_flag("stage_rows", stage_rows, or_none=True)
        _check_flag("exact", exact)
        # its threads start with the first batch of two tables or more; close() joins them
        self._readers = (ThreadPoolExecutor(read_threads, "embstore-pipeline-read")
                         if read_threads > 1 else None)
        self._inputs = inputs
        self._exact = exact
        self._stage_rows = stage_rows
        self._batches = batches_iter
        self._queue: queue.Queue[Any] = queue.Queue()
        self._slots = threading.Semaphore(depth + 1)  # the batch in training + depth ahead
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._count = 0  # updates applied so far
        self._log: list[tuple[int, EmbeddingStore, str, np.ndarray]] = []
        # per batch read ahead and not yet trained (by a token of its own: two batches may
        # be read at one count): the count its staged rows are current at. Batches that
        # staged no rows are dropped from it once read: they need no refresh
        self._outstanding: dict[int, int] = {}
        self._tokens = itertools.count()
        self._holding = False
        self._serving: int | None = None  # the token of the batch in training
        self._done = False  # closed, or closing: no more batches
        self._closed = False  # close() finished
        self._ended = False  # every batch was handed out
        self._stream: Any = None
        self._touched: dict[_StoreModule, ForwardPlan] = {}  # the last plan staged on each
        # the thread and the listener hold the pipeline weakly: one dropped without close()
        # (a loop left by break, outside a with block) is collected, and its finalizer stops
        # the thread and the listener, which would otherwise poll and log updates for ever
        me = weakref.ref(self)
        self._hook = _weak_hook(me)
        self._catch_up_hook = _weak_catch_up(me)
        _write_hooks.add(self._hook)
        self._finalizer = weakref.finalize(self, _abandon, self._stop, self._hook,
                                           self._readers, self._touched)
        self._thread = threading.Thread(
            target=TrainPipeline._run, name="embstore-pipeline", daemon=True,
            args=(me, self._batches, self._slots, self._stop, self._queue))
        self._thread.start()

    # --- background thread ------------------------------------------------------------------

    def _on_update(self, store: EmbeddingStore, table: str, ids: np.ndarray) -> None:
        with self._lock:
            self._count += 1
            if self._outstanding and self._exact:  # else no staged rows can be stale
                self._log.append((self._count, store, table, ids.copy()))  # may be the caller's

    @staticmethod
    def _run(me: weakref.ref[TrainPipeline[Any]], batches: Iterator[Any],
             slots: threading.Semaphore, stop: threading.Event, out: queue.Queue[Any]) -> None:
        """The background thread: holds the pipeline only while it reads a batch ahead."""
        try:
            for batch in batches:
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                pipeline = me()
                if stop.is_set() or pipeline is None:
                    return
                out.put(pipeline._read_ahead(batch))
                del pipeline
        except BaseException as exc:  # handed to the training loop, never lost
            out.put((None, [], None, None, exc))
            return
        out.put(_END)

    def _read_ahead(self, batch: Any) -> tuple[Any, list[tuple[_StoreModule, ForwardPlan]],
                                                  int, int, None]:
        """Check, group, prefetch (and stage) the inputs of `batch`: its queue item."""
        with self._lock:
            read_at = self._count
            token = next(self._tokens)
            self._outstanding[token] = read_at  # before the reads: a racing write is logged
        try:
            batch, staged = self._read_ahead_at(batch, read_at)
        except BaseException:
            self._settled(token)  # no batch will refresh from it: updates need no log
            raise
        if not any(tp.rows is not None for _, plan in staged for tp in plan.tables):
            self._settled(token)  # nothing staged, nothing to refresh
        return batch, staged, read_at, token, None

    def _settled(self, token: int) -> None:
        """Forget a batch whose staged rows no longer wait to be refreshed."""
        with self._lock:
            self._outstanding.pop(token, None)
            low = min(self._outstanding.values(), default=self._count)
            self._log = [entry for entry in self._log if entry[0] > low]

    def _read_ahead_at(self, batch: Any, read_at: int
                       ) -> tuple[Any, list[tuple[_StoreModule, ForwardPlan]]]:
        staged = []
        given = self._inputs(batch)
        if not isinstance(given, Mapping):
            raise ConfigError(f"inputs(batch) must return a mapping {{module: "
                              f"arguments}}, got a {type(given).__name__}")
        for module, args in given.items():
            if not isinstance(module, _StoreModule):
                raise ConfigError(f"inputs(batch) must map embstore.torch modules to "
                                  f"their arguments, got a {type(module).__name__}")
            try:
                plan = module.prepare_forward(*(args if isinstance(args, tuple)
                                                else (args,)))
            except EmbstoreError:
                continue  # the forward itself checks again and raises in order
            staged.append((module, plan))
        refused = self._prefetch([(module, tp.table, tp.groups.unique)
                                  for module, plan in staged
                                  if not _collective(module) for tp in plan.tables])
        staged = [(module, plan) for module, plan in staged if module not in refused]
        for module, plan in staged:
            if not _collective(module):
                self._stage(module, plan, read_at)
        return batch, staged

    def _prefetch(self, requests: list[tuple[_StoreModule, str, np.ndarray]]
                  ) -> set[_StoreModule]:
        """Bring the rows of every (module, table, distinct ids) up, tables concurrently.

        Returns the modules with ids their store refuses (`InvalidIdsError`: out of a table's
        num_embeddings, say): they are not staged, and their forward, which checks the ids
        again, raises the error at its step, as it would without the pipeline.
        """
        refused: set[_StoreModule] = set()
        if self._readers is None or len(requests) < 2:
            for module, table, ids in requests:
                try:
                    module.store.prefetch(table, ids)
                except InvalidIdsError:
                    refused.add(module)
            return refused
        reads = [self._readers.submit(module.store.prefetch, table, ids)
                 for module, table, ids in requests]
        wait(reads)  # all of them, so no read outlives a failed batch
        for (module, _, _), read in zip(requests, reads, strict=True):
            try:
                read.result()  # any other error, the first in table order
            except InvalidIdsError:
                refused.add(module)
        return refused

    def _stage(self, module: _StoreModule, plan: ForwardPlan, read_at: int) -> None:
        """Stage the rows of `plan` where the module asks for it (on CUDA by default)."""
        device = module.device
        stage = device.type == "cuda" if self._stage_rows is None else self._stage_rows
        if not stage:
            return
        if device.type != "cuda":
            module.fetch_forward(plan)
        else:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            # the staged lookup is the batch's: an access log records it as the model uses it
            recording = getattr(module.store, "records_accesses", False)
            for tp in plan.tables:
                rows = lookup_rows(module.store, tp.table, tp.groups.unique,
                                   tp.ids if recording else None).pin_memory()
                inverse = torch.from_numpy(tp.groups.inverse).pin_memory()
                with torch.cuda.stream(self._stream):
                    tp.rows = rows.to(device, non_blocking=True)
                    tp.inverse = inverse.to(device, non_blocking=True)
                    tp.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    tp.ready.record(self._stream)
                tp.pinned = (rows, inverse)
        for tp in plan.tables:
            tp.fetched_at = read_at

    # --- training loop ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[B]:
        return self

    def __next__(self) -> B:
        if self._done:
            if self._ended:
                raise StopIteration
            raise _closed_early()
        if self._holding:
            self._holding = False  # first: an interrupt must not let the slot go twice
            self._slots.release()  # the previous batch is done: one more may be read ahead
        if self._serving is not None:  # its staged rows are used or dropped now
            # first: a plan its step did not use must not serve a later step, whose writes
            # it would miss once the log is cut below
            _unstage(self._touched)
            token, self._serving = self._serving, None
            self._settled(token)
        item = self._queue.get()
        if item is _CLOSED or self._done:  # close() ran (another thread, a signal handler)
            raise _closed_early()
        if item is _END:
            self._ended = True
            self.close()
            raise StopIteration
        batch, staged, read_at, token, exc = item
        if exc is not None:
            self._ended = True  # what follows an error is no batch
            self.close()
            if isinstance(exc, StopIteration):  # not the end of the batches: an error
                raise RuntimeError("inputs(batch) raised StopIteration in the pipeline's "
                                   "thread") from exc
            raise exc
        self._holding = True
        self._serving = token  # settled by the next step, or below where this one fails
        try:
            self._serve(staged, read_at, token)
        except BaseException:
            self._settled(token)  # the batch is lost with the error: nothing to refresh
            raise
        return cast(B, batch)

    def _serve(self, staged: list[tuple[_StoreModule, ForwardPlan]], read_at: int,
               token: int) -> None:
        """Refresh the batch's staged rows and hand its plans to their modules.

        Raises:
            ConfigError: the pipeline was closed meanwhile; nothing is left staged.
        """
        self._refresh(staged, read_at, token)
        for module, plan in staged:
            # A sharded store's lookups are collective: every rank makes them on its training
            # thread, in step order, so only the grouping of its ids was done ahead (nothing
            # is staged). Its forward looks the rows up itself, as without a pipeline: they
            # then hold every write made before it (the trainer's own, an earlier module's
            # backward), which rows read when the batch was handed out would miss
            if (not _collective(module) and self._exact
                    and any(tp.rows is not None for tp in plan.tables)):
                # writes between this step's start and the forward (a trainer's own, or an
                # earlier module's backward) are caught up when the forward takes the plan
                plan.catch_up = self._catch_up_hook
            self._touched[module] = plan  # first: close() drops the plans it knows
            module.stage(plan)
        if self._done:  # closed from another thread meanwhile: the rows may have been staged
            _unstage(self._touched)  # after close() dropped the others', and not refreshed
            raise _closed_early()

    def _refresh(self, staged: list[tuple[_StoreModule, ForwardPlan]], read_at: int,
                 token: int) -> None:
        """Read again the staged rows that updates since `read_at` have changed.

        The rows are then current as of the count now kept for `token`, from which their
        forwards catch up (`_catch_up`).
        """
        with self._lock:
            if token not in self._outstanding:
                return  # the batch staged no rows
            log = [entry for entry in self._log if entry[0] > read_at]
            now = self._outstanding[token] = self._count
            low = min(self._outstanding.values())
            self._log = [entry for entry in self._log if entry[0] > low]
        for _, plan in staged:
            for tp in plan.tables:
                tp.fetched_at = now
        if not log or not self._exact:
            return
        for module, plan in staged:
            if not _collective(module):  # (those are fetched after every earlier update)
                self._patch(module, plan, log)

    def _catch_up(self, module: _StoreModule, plan: ForwardPlan) -> None:
        """Refresh `plan`'s staged rows for the writes since they were last refreshed."""
        with self._lock:
            since = min((tp.fetched_at for tp in plan.tables), default=self._count)
            log = [entry for entry in self._log if entry[0] > since]
            for tp in plan.tables:
                tp.fetched_at = self._count
        if log:
            self._patch(module, plan, log)

    def _patch(self, module: _StoreModule, plan: ForwardPlan,
               log: list[tuple[int, EmbeddingStore, str, np.ndarray]]) -> None:
        """Read again the staged rows of `plan` whose ids the writes in `log` changed."""
        for tp in plan.tables:
            if tp.rows is None:
                continue  # not staged: the forward reads the store itself
            changed = [ids for _, store, table, ids in log
                       if store is module.store and table == tp.table]
            if not changed:
                continue
            index = IdIndex(2 * sum(len(c) for c in changed))
            for ids in changed:
                index.add(np.ascontiguousarray(ids[index.find(ids) < 0]))
            pos = np.flatnonzero(index.find(tp.groups.unique) >= 0)
            if not len(pos):
                continue
            fresh = torch.from_numpy(np.ascontiguousarray(module.store._lookup_again(
                tp.table, tp.groups.unique[pos])))
            if tp.ready is not None:  # the staged copy must land before it is patched
                stream = torch.cuda.current_stream(tp.rows.device)
                stream.wait_event(tp.ready)
                tp.rows.record_stream(stream)
                assert tp.inverse is not None
                tp.inverse.record_stream(stream)
                tp.ready = None
            tp.rows.index_copy_(0, torch.from_numpy(pos).to(tp.rows.device),
                                fresh.to(tp.rows.device))

    def close(self) -> None:
        """Stop the background thread and wait for it; unused staged rows are dropped.

        A close cut short (a second Ctrl-C while it waits) is finished by the next call.
        """
        if self._closed:
            return
        self._done = True
        self._finalizer.detach()
        self._stop.set()
        _write_hooks.remove(self._hook)
        _unstage(self._touched)  # first: no staged row may outlive the log of updates
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):  # unblock a thread waiting to queue
                self._queue.get(timeout=0.05)
        self._thread.join()
        self._queue.put(_CLOSED)  # a step waiting for a batch (close from another thread)
        with self._lock:
            self._log.clear()
            self._outstanding.clear()
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        self._closed = True

    def __enter__(self) -> TrainPipeline[B]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
