"""`ShardedStore`: embedding tables sharded over the ranks of a torch.distributed group.

Every method is collective: all ranks call it in the same order with the same tables, each
with its own ids (any number, duplicates allowed), and each gets its own rows back in its own
order. A call is equivalent to one `EmbeddingStore` making the same call with the ranks'
inputs concatenated in rank order, bit for bit:

- lookups send each rank's distinct ids once to their owners and get each row back once;
- updates keep the last row of each id (the last rank's, then its last position);
- gradients of an id are summed in the global position order starting from zero: rank 0
  may send its partial sum (``0 + g1 + g2`` is where the global sum stands after rank 0's
  positions), every other rank sends one gradient row per position, grouped by id, and the
  owner adds them in rank order, exactly as `IdGroups.sum_rows` over the concatenation would.

One call routes all its tables in one all-to-all exchange (`lookup_many`,
`apply_gradients_many`, `update_many`). Column-wise shards of row-wise Adagrad tables need the
mean of g^2 over the whole row: their owners exchange their columns' squares once more and
each adds the full row in column order, as the unsharded rule does.

A call that one rank rejects (bad ids, non-finite values, an unknown table) raises that
rank's own error and `PeerFailedError` on the others at once, and changes nothing; ranks that
make different calls raise ConfigError. A rank that dies or stops calling makes the others
raise `PeerFailedError` after the group's timeout; the job then restarts from a checkpoint.
A write that fails on a rank after its exchange (an optimizer step overflowing, an I/O error),
where the other ranks applied their parts, raises its error on that rank and
`ShardsDivergedError` on every rank from the next call on (`Comm.applying`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._access_log import AccessRecorder
from .._validate import as_ids, as_pair, as_requests, as_rows
from ..errors import PeerFailedError, ShardsDivergedError, StoreClosedError, UnknownTableError
from ..index import IdGroups
from ..optim import RowWiseAdagrad
from ..spec import TableSpec
from ..store import EmbeddingStore
from ._checkpoint import checkpoint_sharded
from ._comm import Comm, Traffic, as_bytes
from ._shards import needs_row_mean, state_layout
from .plan import Plan

__all__ = ["ShardedStore"]

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass
class _Route:
    """One table's part of a call on this rank: its distinct ids and where each goes."""

    table: str
    groups: IdGroups
    sel: list[np.ndarray]
    """Per rank r: indices into ``groups.unique`` of the ids r owns (ascending)."""
    cols: list[tuple[int, int]]
    """Per rank r: the columns [start, stop) r holds (the whole row unless column-wise)."""


class ShardedStore:
    """A collective `EmbeddingStore`. Create it with `embstore.distributed.open`."""

    collective = True
    """Every call is collective (the torch pipeline fetches its rows on the training thread)."""

    def __init__(self, comm: Comm, plan: Plan, specs: list[TableSpec], local: EmbeddingStore,
                 path: Path | None, recorder: AccessRecorder | None = None) -> None:
        self._comm = comm
        self._recorder = recorder
        self.plan = plan
        self._specs = {s.name: s for s in specs}
        self.local = local
        """This rank's own store of its shards (read it, never write it directly)."""
        self.path = path
        self._widths = {s.name: [self._local_width(s, r) for r in range(comm.world)]
                        for s in specs}

    def _local_width(self, spec: TableSpec, rank: int) -> int:
        p = self.plan.tables[spec.name]
        if p.kind != "column":
            return spec.dim
        start, stop = p.column_range(rank) if rank in p.ranks else (0, 0)
        return stop - start

    # --- properties ------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the store's group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the store's group."""
        return self._comm.world

    @property
    def tables(self) -> list[str]:
        """Names of the (global) tables."""
        return list(self._specs)

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent to other ranks so far, and the minimum for the same calls."""
        return self._comm.traffic

    def table_spec(self, table: str) -> TableSpec:
        """The global `TableSpec` of `table` (UnknownTableError if absent)."""
        if table not in self._specs:
            raise UnknownTableError(table, list(self._specs))
        return self._specs[table]

    # --- routing ---------------------------------------------------------------------------

    def _route(self, table: str, ids: np.ndarray) -> _Route:
        spec, p, world = self._specs[table], self.plan.tables[table], self._comm.world
        groups = IdGroups(ids)
        n = len(groups.unique)
        sel = [_EMPTY] * world
        cols = [(0, spec.dim)] * world
        if p.kind == "column":
            everything = np.arange(n, dtype=np.int64)
            for r in p.ranks:
                sel[r], cols[r] = everything, p.column_range(r)
        else:
            owner = np.asarray(p.ranks, dtype=np.int64)[p.owner_index(groups.unique)]
            order = np.argsort(owner, kind="stable")
            counts = np.bincount(owner, minlength=world)
            sel = np.split(order, np.cumsum(counts)[:-1])
        return _Route(table, groups, sel, cols)

    def _send(self, what: str, names: list[str],
              items: Sequence[Sequence[tuple[np.ndarray, np.ndarray | None,
                                             np.ndarray | None]]],
              row_width: list[int], *, has_mult: bool = False, has_rows: bool = False
              ) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """Exchange per destination and table (ids, multiplicities or None, rows or None).

        `items[r][j]` goes to rank r for table j; `row_width[j]` is the width of rows this
        rank receives for table j. `has_mult` and `has_rows` are fixed by the operation (the
        same on every rank). Returns ``[source][table] -> (ids, mult, rows)`` with mult
        all ones and rows [0]-shaped where none were sent.
        """
        sends, minimum = [], 0
        for r, per in enumerate(items):
            sizes = np.array([[len(i), 0 if g is None else len(g)] for i, _, g in per],
                             dtype=np.int64).reshape(-1)
            parts = [as_bytes(sizes)] + [as_bytes(i) for i, _, _ in per]
            if has_mult:
                parts += [as_bytes(np.ones(len(i), np.int64) if m is None else m)
                          for i, m, _ in per]
            if has_rows:
                parts += [as_bytes(g) for _, _, g in per if g is not None]
            sends.append(np.concatenate(parts))
            if r != self.rank:
                minimum += sum(len(i) * 8 + (0 if g is None else len(i) * g[:1].nbytes)
                               for i, _, g in per)
        self._comm.traffic.minimum += minimum
        recvs = self._comm.exchange(sends, f"{what}:{','.join(names)}")
        t = len(names)
        out = []
        for buf in recvs:
            # copies: a source's buffer need not start 8-byte aligned in the received bytes
            header = buf[: 16 * t].copy().view(np.int64).reshape(t, 2)
            off, ids, mults, rows = 16 * t, [], [], []
            for j in range(t):
                n = int(header[j, 0])
                ids.append(buf[off: off + 8 * n].copy().view(np.int64))
                off += 8 * n
            for j in range(t):
                n = int(header[j, 0])
                if has_mult:
                    mults.append(buf[off: off + 8 * n].copy().view(np.int64))
                    off += 8 * n
                else:
                    mults.append(np.ones(n, np.int64))
            for j, name in enumerate(names):
                m, dtype = int(header[j, 1]), self._specs[name].dtype
                size = m * row_width[j] * dtype.itemsize
                rows.append(buf[off: off + size].copy().view(dtype).reshape(m, row_width[j]))
                off += size
            out.append(list(zip(ids, mults, rows, strict=True)))
        return out

    @contextmanager
    def _inputs(self, what: str) -> Iterator[None]:
        """Check this rank's inputs; on an error, tell the other ranks.

        The message takes the place of the call's first exchange, so that every rank raises
        at once and nothing changes.
        """
        try:
            yield
        except Exception as exc:
            self._comm.abort(what, exc)
            raise

    def reject(self, what: str, exc: BaseException) -> None:
        """Tell the other ranks that this rank rejected its input `exc` to its next call.

        For a caller that checks the input of a collective call before making it (the torch
        modules' forward): the message takes the place of the call's first exchange, so the
        others raise PeerFailedError at once instead of pairing their call with this rank's
        next one.
        """
        if not self.local.closed:  # a closed rank makes no exchange: its call raises first
            self._comm.abort(what, exc)

    def _check_open(self) -> None:
        # before any exchange: a closed rank that went on would pair its next call with the
        # others' replies (a non-owner got another call's bytes as rows)
        if self.local.closed:
            raise StoreClosedError("the sharded store is closed; open it again with "
                                   "embstore.distributed.open(path) on every rank")

    def _check(self, requests: Mapping[str, Any]) -> list[str]:
        self._check_open()
        names = list(as_requests(requests))
        for name in names:
            self.table_spec(name)
        return names

    def _pairs(self, requests: Mapping[str, tuple[Any, Any]], what: str
               ) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """Checked (table, ids, values) of each ``{table: (ids, values)}`` of a write.

        The local store's checks, so that both refuse the same input alike.
        """
        checked = []
        for name in self._check(requests):
            spec = self._specs[name]
            given, values = as_pair(name, requests[name], what)
            ids = as_ids(given, spec)
            checked.append((name, ids, as_rows(values, len(ids), spec, what=what)))
        return checked

    # --- lookups ---------------------------------------------------------------------------

    @property
    def records_accesses(self) -> bool:
        """Whether this rank logs its callers' ids (`open(..., record_accesses=)`)."""
        return self._recorder is not None

    def lookup(self, table: str, ids: Any, *, accessed: Any = None) -> np.ndarray:
        """Weights of this rank's `ids` (1-D, duplicates allowed): array[len(ids), dim].

        `accessed`: the batch's ids as the caller used them, where `ids` are their distinct
        values (for the access log; see `EmbeddingStore.lookup`).
        """
        return self.lookup_many({table: ids}, accessed=None if accessed is None
                                else {table: accessed})[table]

    def lookup_state(self, table: str, ids: Any) -> np.ndarray:
        """Optimizer state of this rank's `ids`: array[len(ids), state_width]."""
        return self.lookup_many({table: ids}, state=True)[table]

    def lookup_many(self, requests: Mapping[str, Any], *, state: bool = False,
                    accessed: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Rows of several tables in one exchange: ``{table: ids}`` -> ``{table: rows}``.

        `accessed`: per table, the ids as the caller used them (for the access log).
        """
        with self._inputs("lookup"):
            names = self._check(requests)
            checked = [as_ids(requests[n], self._specs[n]) for n in names]
            if self._recorder is not None and not state:
                self._recorder.lookup_many([(self._specs[n], ids) for n, ids in
                                            zip(names, checked, strict=True)], accessed)
            routes = [self._route(n, ids) for n, ids in zip(names, checked, strict=True)]
        world = self._comm.world
        items = [[(rt.groups.unique[rt.sel[r]], None, None) for rt in routes]
                 for r in range(world)]
        what = "lookup_state" if state else "lookup"
        got = self._send(what, names, items, [0] * len(names))
        widths = {n: [self._state_width(n, r) if state else self._widths[n][r]
                      for r in range(world)] for n in names}
        # owner side: one local lookup per table, of every source's ids in rank order
        replies: list[list[np.ndarray]] = [[] for _ in range(world)]
        failure: Exception | None = None
        try:
            for j, name in enumerate(names):
                parts = [got[s][j][0] for s in range(world)]
                total = sum(len(p) for p in parts)
                if total == 0:
                    rows = np.empty((0, 0), self._specs[name].dtype)
                else:
                    ids = np.concatenate(parts)
                    rows = np.ascontiguousarray(self.local.lookup_state(name, ids) if state
                                                else self.local.lookup(name, ids))
                bounds = np.cumsum([0] + [len(p) for p in parts])
                for s in range(world):
                    replies[s].append(rows[bounds[s]: bounds[s + 1]])
        except Exception as exc:
            # the sources still get their replies' bytes (zeros) and this failure, so that no
            # rank takes another call's bytes for rows; this rank raises after the exchange
            # (whatever the error: a raw one too must not skip the reply)
            failure = exc
            replies = [[np.zeros(sum(len(got[s][j][0]) * widths[n][self.rank]
                                     * self._specs[n].dtype.itemsize
                                     for j, n in enumerate(names)), np.uint8)]
                       for s in range(world)]
        status = as_bytes(np.array([failure is not None], np.int64))
        sends = [np.concatenate([status] + [as_bytes(x) for x in per]) for per in replies]
        sizes = [8 + sum(len(rt.sel[r]) * widths[rt.table][r]
                         * self._specs[rt.table].dtype.itemsize for rt in routes)
                 for r in range(world)]
        self._comm.traffic.minimum += sum(len(x) - 8 for s, x in enumerate(sends)
                                          if s != self.rank)
        back = self._comm.exchange(sends, what + " reply", recv_sizes=sizes)
        if failure is not None:
            raise failure
        failed = [r for r in range(world) if back[r][:8].copy().view(np.int64)[0]]
        if failed:
            raise PeerFailedError(f"rank(s) {failed} could not read the rows of this {what} "
                                  "(their own error says why); it returned nothing")
        back = [b[8:] for b in back]
        offsets = [0] * world
        return {rt.table: self._assemble(rt, back, offsets, widths[rt.table], state)
                for rt in routes}

    def _state_width(self, table: str, rank: int) -> int:
        spec, w = self._specs[table], self._widths[table][rank]
        p = self.plan.tables[table]
        if p.kind == "column" and rank not in p.ranks:
            return 0
        return spec.optimizer.state_width(w)

    def _assemble(self, rt: _Route, back: list[np.ndarray], offsets: list[int],
                  widths: list[int], state: bool) -> np.ndarray:
        """This rank's rows of one table from the owners' replies ([len(ids), width])."""
        spec, p = self._specs[rt.table], self.plan.tables[rt.table]
        full = spec.optimizer.state_width(spec.dim) if state else spec.dim
        out = np.empty((len(rt.groups.unique), full), dtype=spec.dtype)
        blocks, tail = state_layout(spec)
        for r in range(self._comm.world):
            w, m = widths[r], len(rt.sel[r])
            size = m * w * spec.dtype.itemsize
            block = back[r][offsets[r]: offsets[r] + size].copy().view(spec.dtype).reshape(m, w)
            offsets[r] += size
            if p.kind != "column":
                out[rt.sel[r]] = block
            elif r in p.ranks:
                c0, c1 = rt.cols[r]
                if not state:
                    out[:, c0:c1] = block
                    continue
                cw = c1 - c0
                for b in range(blocks):
                    out[:, b * spec.dim + c0: b * spec.dim + c1] = block[:, b * cw:(b + 1) * cw]
                if r == p.ranks[0] and tail:
                    out[:, blocks * spec.dim:] = block[:, blocks * cw:]
        return out[rt.groups.inverse] if rt.groups.has_duplicates else out

    # --- writes ----------------------------------------------------------------------------

    def update(self, table: str, ids: Any, rows: Any) -> None:
        """Overwrite weights; where an id repeats (across ranks too) the last row wins."""
        self.update_many({table: (ids, rows)})

    def update_many(self, requests: Mapping[str, tuple[Any, Any]]) -> None:
        """`update` of several tables in one exchange: ``{table: (ids, rows)}``."""
        routes, lasts = [], []
        written: list[tuple[str, np.ndarray]] = []
        with self._inputs("update"):
            pairs = self._pairs(requests, "rows")
            names = [n for n, _, _ in pairs]
            for n, ids, rows in pairs:
                rt = self._route(n, ids)
                routes.append(rt)
                lasts.append(rows[rt.groups.last] if rt.groups.has_duplicates else rows)
                written.append((n, ids))
            self._record_writes(written)
        items = [[(rt.groups.unique[rt.sel[r]], None,
                   np.ascontiguousarray(last[rt.sel[r], rt.cols[r][0]:rt.cols[r][1]]))
                  for rt, last in zip(routes, lasts, strict=True)] for r in range(self._comm.world)]
        got = self._send("update", names, items, [self._widths[n][self.rank] for n in names],
                         has_rows=True)
        with self._comm.applying("update"):
            for j, name in enumerate(names):
                ids = np.concatenate([got[s][j][0] for s in range(self._comm.world)])
                if len(ids):
                    rows = np.concatenate([got[s][j][2] for s in range(self._comm.world)])
                    self.local.update(name, ids, rows)

    def apply_gradients(self, table: str, ids: Any, grads: Any) -> None:
        """Apply the table's fused optimizer with every rank's gradients ([len(ids), dim])."""
        self.apply_gradients_many({table: (ids, grads)})

    def apply_gradients_many(self, requests: Mapping[str, tuple[Any, Any]]) -> None:
        """`apply_gradients` of several tables in one exchange: ``{table: (ids, grads)}``."""
        world = self._comm.world
        items: list[list[Any]] = [[] for _ in range(world)]
        written: list[tuple[str, np.ndarray]] = []
        with self._inputs("apply_gradients"):
            pairs = self._pairs(requests, "gradients")
            names = [n for n, _, _ in pairs]
            for n, ids, grads in pairs:
                self._grad_items(n, ids, grads, items)
                written.append((n, ids))
            self._record_writes(written)
        got = self._send("apply_gradients", names, items,
                         [self._widths[n][self.rank] for n in names], has_mult=True,
                         has_rows=True)
        pending = []
        with self._comm.applying("apply_gradients"):
            for j, name in enumerate(names):
                parts = [got[s][j] for s in range(world)]
                if not sum(len(i) for i, _, _ in parts):
                    if self._specs[name].precision != "fp32" and name in self.local.tables:
                        # a step of the table all the same: its count seeds the rounding
                        # of the steps after it, as in one store
                        self.local.apply_gradients(name, np.empty(0, np.int64), np.empty(
                            (0, self._specs[name].dim), np.float32))
                    continue
                ids = np.concatenate([np.repeat(i, m) for i, m, _ in parts])
                grads = np.concatenate([g for _, _, g in parts])
                if needs_row_mean(self._specs[name], self.plan.tables[name]):
                    pending.append((name, ids, grads))
                else:
                    self.local.apply_gradients(name, ids, grads)
            if any(needs_row_mean(self._specs[n], self.plan.tables[n]) for n in names):
                self._apply_row_mean(names, pending)

    def _record_writes(self, written: list[tuple[str, np.ndarray]]) -> None:
        """Log checked writes (every table of the call checked first, as the local store)."""
        if self._recorder is not None:
            for name, ids in written:
                self._recorder.write(name, ids)

    def _grad_items(self, table: str, ids: np.ndarray, grads: np.ndarray,
                    items: list[list[Any]]) -> None:
        """Append to `items[r]` what rank r gets of this rank's gradients of `table`.

        Each item is (distinct ids, multiplicities or None, gradient rows [positions, owned
        columns]).
        """
        rt = self._route(table, ids)
        g, world = rt.groups, self._comm.world
        if self.rank == 0 or not g.has_duplicates:
            # rank 0 comes first in the global order: its partial sum is where the global
            # fold stands after its positions
            summed = g.sum_rows(grads) if g.has_duplicates else grads
            for r in range(world):
                c0, c1 = rt.cols[r]
                items[r].append((g.unique[rt.sel[r]], None,
                                 np.ascontiguousarray(summed[rt.sel[r], c0:c1])))
            return
        order = np.argsort(g.inverse, kind="stable")  # positions grouped by id, in order
        mult = np.bincount(g.inverse, minlength=len(g.unique)).astype(np.int64)
        dest = np.full(len(g.unique), -1, dtype=np.int64)
        for r in range(world):
            dest[rt.sel[r]] = r
        pos_group = g.inverse[order]
        column = self.plan.tables[table].kind == "column"
        for r in range(world):
            c0, c1 = rt.cols[r]
            pos = order if column else order[dest[pos_group] == r]
            items[r].append((g.unique[rt.sel[r]], mult[rt.sel[r]],
                             np.ascontiguousarray(grads[pos, c0:c1])))

    def _apply_row_mean(self, names: list[str],
                        pending: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """Step column shards of row-wise Adagrad tables with the whole row's mean.

        The squares of each shard's columns are exchanged among the table's owners first.
        """
        world = self._comm.world
        mine: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for name, ids, grads in pending:
            spec = self._specs[name]
            g = IdGroups(ids)
            summed = g.sum_rows(grads) if g.has_duplicates else grads
            opt, t = spec.optimizer, spec.dtype.type
            assert isinstance(opt, RowWiseAdagrad)
            decayed = summed
            if opt.weight_decay and opt.weight_decay_mode == "l2":
                decayed = summed + t(opt.weight_decay) * self.local.lookup(name, g.unique)
            mine[name] = (g.unique, summed, decayed * decayed)
        sends = []
        for r in range(world):
            parts = [as_bytes(mine[n][2]) for n in names
                     if n in mine and r in self.plan.tables[n].ranks]
            sends.append(np.concatenate(parts) if parts else np.empty(0, np.uint8))
        back = self._comm.exchange(sends, "apply_gradients row mean:" + ",".join(names))
        offsets = [0] * world
        for name in names:
            if name not in mine:
                continue
            spec, p = self._specs[name], self.plan.tables[name]
            unique, summed, _ = mine[name]
            sq = np.empty((len(unique), spec.dim), dtype=spec.dtype)
            for r in p.ranks:
                c0, c1 = p.column_range(r)
                size = len(unique) * (c1 - c0) * spec.dtype.itemsize
                sq[:, c0:c1] = back[r][offsets[r]: offsets[r] + size].copy().view(
                    spec.dtype).reshape(len(unique), c1 - c0)
                offsets[r] += size
            mean = np.add.reduce(sq, axis=1)  # as rules.rowwise_adagrad: the whole row
            mean /= spec.dtype.type(spec.dim)
            opt = self.local.table_spec(name).optimizer
            opt.pending_mean = mean  # type: ignore[attr-defined]
            try:
                self.local.apply_gradients(name, unique, np.ascontiguousarray(summed))
            finally:
                opt.pending_mean = None  # type: ignore[attr-defined]

    def delete(self, table: str, ids: Any) -> int:
        """Remove the rows of every rank's `ids`; returns the rows removed (all ranks)."""
        with self._inputs("delete"):
            self._check_open()
            rt = self._route(table, as_ids(ids, self.table_spec(table)))
        items = [[(rt.groups.unique[rt.sel[r]], None, None)] for r in range(self._comm.world)]
        got = self._send("delete", [table], items, [0])
        ids_all = np.concatenate([got[s][0][0] for s in range(self._comm.world)])
        with self._comm.applying("delete"):
            removed = self.local.delete(table, ids_all) if len(ids_all) else 0
        p = self.plan.tables[table]
        counts = p.kind != "column" or p.counting_rank() == self.rank
        return self._comm.all_sum(removed if counts else 0, f"delete count:{table}")

    def num_rows(self, table: str) -> int:
        """Stored rows of `table` over all ranks."""
        with self._inputs("num_rows"):
            self._check_open()
            p = self.plan.tables[self.table_spec(table).name]
            # inside: a shard whose medium lost rows raises here, and the others at once
            mine = self.local.num_rows(table) if self.rank in p.ranks and (
                p.kind != "column" or p.counting_rank() == self.rank) else 0
        return self._comm.all_sum(mine, f"num_rows:{table}")

    # --- whole store -----------------------------------------------------------------------

    def flush(self) -> None:
        """Flush every rank's shards; returns when all are durable.

        A rank whose flush fails (or whose store is closed) raises its own error and the
        others PeerFailedError, at once.
        """
        error: BaseException | None = None
        try:
            self._check_open()
            self.local.flush()
            if self._recorder is not None:
                self._recorder.flush()
        except Exception as exc:
            error = exc
        self._comm.agree(error, "flush")

    def stats(self) -> list[dict[str, Any]]:
        """Every rank's local `stats()` (its shards), in rank order, on every rank."""
        with self._inputs("stats"):
            self._check_open()
            mine = self.local.stats()
        return self._comm.gather_objects(mine, "stats")  # type: ignore[return-value]

    def checkpoint(self, dest: str | Path, *, step: int | None = None) -> Path:
        """A consistent checkpoint of every shard in `dest` (see `embstore.distributed`)."""
        return checkpoint_sharded(self, dest, step)

    def close(self) -> None:
        """Close this rank's shards after every rank has reached `close` (collective)."""
        if self.local.closed:
            return
        try:
            with contextlib.suppress(ShardsDivergedError):  # closing is all that is left
                self._comm.barrier("close")
        finally:
            try:
                self.local.close()
            finally:
                if self._recorder is not None:
                    self._recorder.close()

    @property
    def closed(self) -> bool:
        """Whether `close()` has been called."""
        return self.local.closed

    def __enter__(self) -> ShardedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.local.close()  # no barrier: the other ranks may be gone

    def __repr__(self) -> str:
        return (f"<ShardedStore rank {self.rank}/{self.world_size} tables={self.tables}"
                f"{' closed' if self.closed else ''}>")
