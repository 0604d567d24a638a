"""The tier hierarchy: a chain of backends per table, fastest on top, with write-back caching.

The bottom tier is the store of record. Upper tiers are write-back caches:

- a read that misses a tier and hits below is promoted into the topmost tier above it whose
  admission policy admits it;
- a write goes to the topmost tier that already holds the row or admits it, else further down;
- a tier over capacity evicts the victims its eviction policy picks, and writes each dirty victim
  into the tier below *before* dropping it, so nothing acknowledged is lost;
- `flush` writes every dirty row down level by level, then flushes the persistent media.

Write-backs into the bottom tier (when it has no policy of its own) are applied in order on a
second thread (`_writeback.py`), overlapped with the cache tiers' work; every other use of the
bottom waits for them first, so reads, flushes and tables are exactly as if written in line.

Invariant: the topmost tier holding an id holds its latest value; a clean copy equals the
value in the next tier below that holds the id. Cache tiers start empty on open, so after a
crash the store of record alone defines the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ._dirty import DirtyIds, DirtySet, DirtySlots
from ._slot_memo import SlotMemo
from ._unique import unique_sorted
from ._writeback import BackgroundWriter, DrainedBackend
from .backend import Backend, SupportsBulkLoad, SupportsLeadingColumns, SupportsSlots
from .index import IdGroups, IdIndex, copy_rows
from .policy import AdmissionPolicy, EvictionPolicy, SupportsSharedIndex
from .spec import TierSpec

__all__ = ["TableChain", "Tier", "TierStatistics"]


@dataclass(frozen=True)
class TierStatistics:
    """Counters of one tier of one table since the store was opened."""

    level: int
    """Position in the chain; 0 is the top."""
    backend: str
    """Registered backend name."""
    lookups: int
    """Ids looked up in this tier (distinct per batch below the top)."""
    hits: int
    """Lookups that found the row here."""
    misses: int
    """Lookups that did not find the row here."""
    promotions: int
    """Rows copied into this tier from a tier below on a read."""
    admissions_rejected: int
    """Ids the admission policy kept out (reads and writes); at the bottom, dropped updates."""
    evictions: int
    """Rows evicted for capacity (from the bottom tier: expired features)."""
    writebacks: int
    """Dirty rows written from this tier into the tier below."""
    rows: int
    """Rows held now."""
    bytes: int
    """Bytes the backend holds now (payload plus index or file overhead)."""
    capacity_rows: int | None
    """Capacity in rows; None for unbounded."""


class Tier:
    """A backend with a capacity, an eviction and an admission policy, and counters."""

    def __init__(self, level: int, spec: TierSpec, backend: Backend, capacity_rows: int | None,
                 eviction: EvictionPolicy | None, admission: AdmissionPolicy | None,
                 is_bottom: bool) -> None:
        self.level = level
        self.spec = spec
        self.backend = backend
        self.capacity_rows = capacity_rows
        self.eviction = eviction
        self.admission = admission
        self.is_bottom = is_bottom
        # a backend with slots of its own keeps its rows' slots at hand: dirty bits per slot
        self.slotted = isinstance(backend, SupportsSlots)
        # the backend and the policy typed for their slot methods, used only where
        # `slotted` and `shares_index` say they have them
        self.slot_backend = cast(SupportsSlots, backend)
        self.shared = cast(SupportsSharedIndex, eviction)
        self.dirty: DirtySet | None = (None if is_bottom else DirtySlots(self.slot_backend.index)
                                       if self.slotted else DirtyIds())
        # the policy tracks ids in the backend's own slots where both allow it: a hit then
        # costs the backend's hash probe alone
        self.shares_index = (self.slotted
                             and isinstance(cast(object, eviction), SupportsSharedIndex)
                             and len(backend) == 0)
        if self.shares_index:
            self.shared.share_index(self.slot_backend.index)
        # rows held, kept by the chain for tiers it evicts from (0 for the others): some media
        # can only count by a scan (RocksDB), too slow for a capacity check on every write
        self.rows = len(backend) if eviction is not None else 0
        self.counters = dict.fromkeys(("lookups", "hits", "misses", "promotions",
                                       "admissions_rejected", "evictions", "writebacks"), 0)

    def lookup(self, ids: np.ndarray, now: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Rows and found mask of `ids` in this tier; counts them and tells the policy."""
        rows, found, hits, _ = self.lookup_leading(ids, now, None)
        return rows, found, hits

    def lookup_leading(self, ids: np.ndarray, now: int, columns: int | None
                       ) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
        """`lookup`, of the first `columns` of each row where the backend reads them alone.

        Returns (rows, found, hits, slots): rows have `columns` columns where the backend
        supports it (`SupportsLeadingColumns`), full rows otherwise; slots where the
        backend reported them, else None.
        """
        slots = None
        if columns is not None and isinstance(self.backend, SupportsLeadingColumns):
            rows, found, slots = self.backend.get_leading(ids, columns)
        elif self.shares_index:
            rows, found, slots = self.slot_backend.get_with_slots(ids)
        else:
            rows, found = self.backend.get(ids)
        hits = int(np.count_nonzero(found))
        c = self.counters
        c["lookups"] += len(ids)
        c["hits"] += hits
        c["misses"] += len(ids) - hits
        if hits:
            assert slots is not None or not self.shares_index  # sharing its index: slots
            if hits == len(ids):
                self.record_reads(ids, slots, now)
            else:
                self.record_reads(ids[found], None if slots is None else slots[found], now)
        return rows, found, hits, slots

    def record_reads(self, ids: np.ndarray, slots: np.ndarray | None, now: int) -> None:
        """Tell the eviction policy, if any, that distinct `ids` were read (at `slots`)."""
        if self.eviction is None:
            return
        if self.shares_index and slots is not None:
            self.shared.record_access_slots(slots, now)
        else:
            self.eviction.record_access(ids, now)

    def statistics(self) -> TierStatistics:
        """A snapshot of this tier's counters and size."""
        return TierStatistics(level=self.level, backend=self.spec.backend,
                              rows=len(self.backend), bytes=self.backend.nbytes(),
                              capacity_rows=self.capacity_rows, **self.counters)


def _subset(ids: np.ndarray, rows: np.ndarray,
            sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ids[sel], rows[sel]` for ascending distinct positions `sel`.

    The arrays themselves when `sel` takes them all: a batch-sized copy per call cost more than
    a policy's work.
    """
    if len(sel) == len(ids):
        return ids, rows
    return ids[sel], rows[sel]


class TableChain:
    """The tiers of one table and the moves of rows between them.

    Every method takes whole batches; ids passed to `put` and `delete` are distinct.
    """

    def __init__(self, tiers: list[Tier], width: int, dtype: np.dtype, *,
                 background_writes: bool = True) -> None:
        self.tiers = tiers
        self.width = width
        self.dtype = dtype
        # write-backs into the store of record run on a second thread (see _writeback.py);
        # a bottom tier with a policy of its own (feature expiry) takes them in line
        self._writer: BackgroundWriter | None = None
        bottom = tiers[-1]
        if background_writes and len(tiers) > 1 and bottom.eviction is None:
            self._writer = BackgroundWriter(bottom.backend)
            bottom.backend = DrainedBackend(bottom.backend, self._writer)
            bottom.slotted = False  # the view has no slot methods; the bottom keeps no dirty bits
        self._clock = 0  # logical time: one tick per batch, so policies replay identically
        # ids the latest read found in no tier; any write forgets them. A training step reads
        # a batch twice (lookup, then apply_gradients), and never-seen ids would otherwise
        # cost two reads of the slowest tier
        self._absent: IdIndex | None = None
        # unlocked reads of the bottom in flight (embstore/_prefetch.py): each is told of the
        # ids written to or deleted from the bottom until it ends
        self.watchers: list[Any] = []
        # a training step reads a batch (lookup) and then writes it (apply_gradients): the
        # slots the read found serve the write without a second probe
        self._slot_memo = SlotMemo()
        # feature expiry (the bottom tier's eviction): `expire_listener`, where set, is told
        # of the distinct ids the bottom drops, before it drops them (the store records them
        # as changed, as it records a delete); their clean copies above are dropped with
        # them once the call that expired them is done (`_settle_expired`)
        self.expire_listener: Callable[[np.ndarray], None] | None = None
        self._expired: list[np.ndarray] = []

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # --- reads ----------------------------------------------------------------------------

    def get(self, ids: np.ndarray, *, columns: int | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
        """Full rows of `ids` (duplicates allowed) and whether each is stored anywhere.

        With `columns`, rows may hold only their first `columns` (the weights, without the
        optimizer state): where the top tier holds every row and reads columns alone, or a
        one-tier table's tier does. Callers slice `rows[:, :columns]` either way.
        """
        now = self._tick()
        rows, found, hits, slots = self.tiers[0].lookup_leading(ids, now, columns)
        if slots is not None and hits == len(ids):
            self.remember_slots(ids, slots)
        if hits == len(ids) or len(self.tiers) == 1:
            return rows, found
        if rows.shape[1] != self.width:  # rows from below come whole: widen the top's
            full = np.zeros((len(ids), self.width), dtype=self.dtype)
            full[:, : rows.shape[1]] = rows
            rows = full
        miss_pos = np.flatnonzero(~found)
        groups = IdGroups(np.ascontiguousarray(ids[miss_pos]))
        urows, level_of = self._read_below(groups.unique, now)
        copy_rows(rows, miss_pos, urows, groups.inverse)
        found[miss_pos] = (level_of >= 0)[groups.inverse]
        return rows, found

    def bring_up(self, missing: np.ndarray) -> int:
        """Read distinct `missing`, which the top tier lacks, from below and promote them.

        They move as a read would move them; returns how many there were. Values are
        unchanged, so a prefetch ahead of a lookup makes it cheaper and never different
        (`embstore._prefetch` reads without the store's lock where the chain allows it).
        """
        if len(missing):
            self._read_below(missing, self._tick())
        return len(missing)

    def touch_top(self, u: np.ndarray) -> np.ndarray:
        """bool[N]: which distinct `u` the top tier holds; its policy sees those read now.

        A prefetch runs ahead of its batch's lookups, and the rows it finds up must stay up
        until then, as the rows it promotes do: promoting the next batches' rows evicts, and
        CLOCK's hand would take a row whose bit the batch had not yet set. The hit counts are
        left to the lookup itself.
        """
        tier = self.tiers[0]
        slots = tier.slot_backend.index.find(u) if tier.shares_index else None
        held = tier.backend.contains(u) if slots is None else slots >= 0
        if tier.eviction is not None and held.any():
            tier.record_reads(np.ascontiguousarray(u[held]),
                              None if slots is None else slots[held], self._tick())
        return held

    @property
    def writer(self) -> BackgroundWriter | None:
        """The thread writing back into the store of record, if it has one."""
        return self._writer

    def forget_absent(self) -> None:
        """Forget which ids the latest read found in no tier.

        For a read-only store that re-reads its store of record: a writer in another
        process may have stored them since.
        """
        self._absent = None

    def note_bottom_write(self, ids: np.ndarray) -> None:
        """Tell unlocked reads in flight that `ids` change in the store of record."""
        for job in self.watchers:
            job.written.append(ids)

    def promote(self, ids: np.ndarray, rows: np.ndarray, level_of: np.ndarray) -> None:
        """Promote distinct `ids` read from the levels `level_of` with `rows` (prefetch)."""
        self._promote(ids, rows, level_of.copy(), self._tick())
        self._settle_expired()

    def _read_below(self, u: np.ndarray, now: int) -> tuple[np.ndarray, np.ndarray]:
        """Read distinct `u`, absent from the top tier, from the tiers below; promote them.

        Returns their rows (zeros where stored nowhere) and the level each was found at
        (-1: nowhere).
        """
        level_of = np.full(len(u), -1, dtype=np.int64)
        remaining = np.arange(len(u))
        if self._absent is not None:
            remaining = remaining[self._absent.find(u) < 0]
        urows = None
        for tier in self.tiers[1:]:
            r, f, n_hit = tier.lookup(u[remaining], now)
            if urows is None and len(remaining) == len(u):
                # every id asked: its rows are the result as they stand (zeros where absent,
                # by Backend.get's contract, and ours to keep), no copy
                urows = np.ascontiguousarray(r)
                level_of[f] = tier.level
            elif n_hit:
                if urows is None:
                    urows = np.zeros((len(u), self.width), dtype=self.dtype)
                hit = np.flatnonzero(f)
                copy_rows(urows, remaining[hit], r, hit)
                level_of[remaining[hit]] = tier.level
            remaining = remaining[~f]
            if not len(remaining):
                break
        if urows is None:
            urows = np.zeros((len(u), self.width), dtype=self.dtype)
        # rows found nowhere are zeros here; the store fills in their initial values
        nowhere = np.flatnonzero(level_of < 0)
        self._promote(u, urows, level_of, now)
        self._settle_expired()
        absent = u[nowhere]
        self._absent = None
        if len(absent):
            self._absent = IdIndex(2 * len(absent))
            self._absent.add(absent)
        return urows, level_of

    def top_slots(self, ids: np.ndarray, *, read: bool = True) -> np.ndarray | None:
        """Find the slots of distinct `ids` in the top tier, if it holds them all in place.

        That is when the top tier keeps its rows in slots it can overwrite in place
        (`write_at`) and holds every id: then, with `read`, the read is counted as `get`
        counts a batch the top tier holds (one tick, hits, the policy's accesses). Otherwise
        None, and nothing is counted.
        """
        tier = self.tiers[0]
        if not (len(ids) and tier.slotted and hasattr(tier.backend, "write_at")):
            return None
        index = tier.slot_backend.index
        slots = self._slot_memo.recall(index, ids)
        if slots is None:
            slots = index.find(ids)
            if (slots < 0).any():
                return None
        if read:
            self.count_top_read(ids, slots)
        return slots

    def remember_slots(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Remember that distinct `ids` lie at `slots` of the top tier (see `SlotMemo`)."""
        self._slot_memo.remember(self.tiers[0].slot_backend.index, ids, slots)

    def count_top_read(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Count a read of distinct `ids` that the top tier holds at `slots` as `get` does.

        For callers of `top_slots` with read=False.
        """
        tier = self.tiers[0]
        now = self._tick()
        tier.counters["lookups"] += len(ids)
        tier.counters["hits"] += len(ids)
        tier.record_reads(ids, slots, now)

    def put_top_slots(self, ids: np.ndarray, slots: np.ndarray, rows: np.ndarray | None, *,
                      row_slots: np.ndarray | None = None) -> None:
        """Write distinct `ids` that the top tier holds at `slots`, in place.

        `slots` come from `top_slots`, with no other write to the table since: the rows are
        overwritten in place (None: the caller wrote them there already), then counted,
        marked dirty and capacity enforced exactly as `put` does for rows the top tier holds.

        `row_slots`, where given, is the slot of each row of `rows` (which may then hold
        several rows per id: they are written in order, so the last one stays).
        """
        now = self._tick()
        self._absent = None
        tier = self.tiers[0]
        if rows is not None:
            cast(Any, tier.backend).write_at(slots if row_slots is None else row_slots, rows)
        tier.record_reads(ids, slots, now)
        if tier.dirty is not None:
            tier.dirty.mark(ids, slots)
        self._enforce_capacity(tier, now)
        self._settle_expired()

    def _promote(self, ids: np.ndarray, rows: np.ndarray, level_of: np.ndarray, now: int) -> None:
        """Copy rows found below into the topmost tier above them that admits them."""
        for tier in self.tiers[:-1]:
            cand = np.flatnonzero(level_of > tier.level)
            if not len(cand):
                continue
            admitted = self._admit(tier, ids[cand], now)
            sel = cand[admitted]
            if len(sel):
                tier.counters["promotions"] += len(sel)
                # found below only: none of them is in this tier
                self._insert(tier, *_subset(ids, rows, sel), dirty=False, now=now,
                             existed=np.zeros(len(sel), dtype=bool))
                level_of[sel] = tier.level

    @staticmethod
    def _admit(tier: Tier, ids: np.ndarray, now: int) -> np.ndarray:
        if tier.admission is None:  # admit all ("always" is opened as None)
            return np.ones(len(ids), dtype=bool)
        admitted = np.asarray(tier.admission.admit(ids, now), dtype=bool)
        tier.counters["admissions_rejected"] += int(len(ids) - np.count_nonzero(admitted))
        return admitted

    # --- writes ---------------------------------------------------------------------------

    def put(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Write full rows of distinct `ids`.

        Returns bool[N], False where feature admission dropped the write (the id has no stored row
        and the bottom tier did not admit it).
        """
        written = self._put(ids, rows)
        self._settle_expired()
        return written

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        now = self._tick()
        self._absent = None
        written = np.ones(len(ids), dtype=bool)
        bottom = self.tiers[-1]
        if bottom.admission is not None:
            new = ~self.contains(ids)
            if new.any():
                written[new] = self._admit(bottom, ids[new], now)
                if not written.all():
                    ids, rows = ids[written], rows[written]
        remaining = np.arange(len(ids))
        for tier in self.tiers[:-1]:
            if tier.admission is None:
                # every id goes here: `_insert` learns which it held from the backend
                self._insert(tier, *_subset(ids, rows, remaining), dirty=True, now=now)
                return written
            sub = ids[remaining]
            present = tier.backend.contains(sub)
            want = present.copy()
            if not want.all():
                absent = np.flatnonzero(~want)
                want[absent] = self._admit(tier, sub[absent], now)
            sel = remaining[want]
            if len(sel):
                self._insert(tier, ids[sel], rows[sel], dirty=True, now=now,
                             existed=present[want])
            remaining = remaining[~want]
            if not len(remaining):
                return written
        if self.watchers:
            self.note_bottom_write(ids[remaining])
        self._insert(bottom, *_subset(ids, rows, remaining), dirty=False, now=now)
        return written

    def _insert(self, tier: Tier, ids: np.ndarray, rows: np.ndarray, *, dirty: bool,
                now: int, existed: np.ndarray | None = None) -> None:
        """Put rows into one tier, mark them dirty in caches, then enforce its capacity.

        `existed` (bool[N]), where the caller knows it, says which ids the tier holds already.
        """
        if not len(ids):
            return
        ids = np.ascontiguousarray(ids)
        rows = np.ascontiguousarray(rows)
        slots: np.ndarray | None = None
        if tier.slotted:
            slots, inserted = tier.slot_backend.put_with_slots(ids, rows)
            existed = ~inserted
        else:
            if tier.eviction is not None and existed is None:
                existed = tier.backend.contains(ids)
            tier.backend.put(ids, rows)
        # dirty before the policy's bookkeeping: a row newer than the tier below must never
        # be held clean, or an interrupt between the two would keep it from every flush
        if dirty and tier.dirty is not None:
            tier.dirty.mark(ids, slots)
        if tier.eviction is not None and existed is not None:  # (it is set then)
            new = ~existed
            tier.rows += int(np.count_nonzero(new))
            try:
                if existed.any():
                    tier.record_reads(ids[existed], None if slots is None else slots[existed],
                                      now)
                if new.any():
                    if tier.shares_index and slots is not None:
                        tier.shared.record_insert_slots(ids[new], slots[new], now)
                    else:
                        tier.eviction.record_insert(np.ascontiguousarray(ids[new]), now)
            except BaseException:
                # cut short: rows the policy missed would never be evicted
                self._track_again(tier, np.ascontiguousarray(ids[new]))
                raise
        self._enforce_capacity(tier, now)

    def _track_again(self, tier: Tier, ids: np.ndarray) -> None:
        """Make the policy track distinct `ids` that the tier holds, whatever it knew of them."""
        assert tier.eviction is not None
        tier.eviction.record_remove(ids)
        if tier.shares_index:
            tier.shared.record_insert_slots(ids, tier.slot_backend.index.find(ids), self._clock)
        else:
            tier.eviction.record_insert(ids, self._clock)

    def _enforce_capacity(self, tier: Tier, now: int) -> None:
        if tier.eviction is None:
            return
        victims = tier.eviction.expired(now)
        slots: np.ndarray | None = None
        if tier.capacity_rows is not None:
            over = tier.rows - len(victims) - tier.capacity_rows
            if over > 0:
                if tier.shares_index and not len(victims):
                    # the policy knows its victims' slots: no probe to find their dirty bits
                    victims, slots = tier.shared.choose_victim_slots(over, now)
                else:
                    more = tier.eviction.choose_victims(over, now)
                    victims = np.concatenate([victims, more]) if len(victims) else more
        if not len(victims):
            return
        victims = np.ascontiguousarray(victims, dtype=np.int64)
        if tier.is_bottom:
            self._expiring(victims)
        if tier.dirty is not None:
            dirty, slots = tier.dirty.which(victims, slots)
            if dirty.any():
                # write-back before drop: the victim's value must exist below first
                self._write_back(tier, victims[dirty], None if slots is None else slots[dirty],
                                 now)
        tier.backend.delete(victims)
        tier.rows -= len(victims)
        tier.counters["evictions"] += len(victims)

    def _expiring(self, ids: np.ndarray) -> None:
        """Distinct `ids` leave the store of record (feature expiry), which still holds them.

        The listener learns of them first, while their stored rows can still be read; the
        tiers above drop their clean copies once the call under way is done: a clean copy
        stands for the row below, and a read must not find a row the table no longer holds.
        A dirty copy is newer than the stored row and stays, to be written back.
        """
        if self.expire_listener is not None:
            self.expire_listener(ids)
        if self.watchers:
            self.note_bottom_write(ids)
        self._expired.append(ids)

    def _settle_expired(self) -> None:
        """Drop the clean copies above of the rows the store of record has expired.

        Called where a chain operation is done (not while a tier is evicting: the rows it
        evicts must stay until it drops them). Rows written into the store of record again
        since, and rows a tier holds dirty (with the clean copies above it), stay.
        """
        if not self._expired:
            return
        parts, self._expired = self._expired, []
        ids = unique_sorted(np.concatenate(parts)) if len(parts) > 1 else parts[0]
        ids = np.ascontiguousarray(ids[~self.tiers[-1].backend.contains(ids)])
        for tier in reversed(self.tiers[:-1]):
            if not len(ids):
                return
            held = tier.backend.contains(ids)
            if not held.any():
                continue
            assert tier.dirty is not None  # a cache tier
            dirty, _ = tier.dirty.which(np.ascontiguousarray(ids[held]), None)
            drop = np.ascontiguousarray(ids[held][~dirty])
            if len(drop):
                if tier.eviction is not None:
                    tier.eviction.record_remove(drop)
                removed = tier.backend.delete(drop)
                if tier.eviction is not None:
                    tier.rows -= int(np.count_nonzero(removed))
            # a dirty copy is the latest value: the copies above it are its, and stay
            keep = np.ones(len(ids), dtype=bool)
            keep[np.flatnonzero(held)[dirty]] = False
            ids = ids[keep]

    def _write_back(self, tier: Tier, ids: np.ndarray, slots: np.ndarray | None,
                    now: int, *, in_line: bool = False) -> None:
        """Copy the dirty rows `ids` (at `slots` of a slotted tier) into the tier below.

        Into the store of record on the writer's thread, unless `in_line`: then on this one,
        after the writes queued before (the order is the same).
        """
        assert tier.dirty is not None, "only cache tiers write back"
        rows = (tier.slot_backend.rows_at(slots) if slots is not None
                else tier.backend.get(ids)[0])
        below = self.tiers[tier.level + 1]
        if below.is_bottom and self._writer is not None:
            # `ids` and `rows` are fresh arrays, the writer's from now on
            if self.watchers:
                self.note_bottom_write(ids)
            if in_line:
                below.backend.put(np.ascontiguousarray(ids), rows)  # drains the queue first
            else:
                self._writer.submit(np.ascontiguousarray(ids), rows)
        else:
            self._insert(below, ids, rows, dirty=True, now=now)
        tier.dirty.clear(ids, slots)
        tier.counters["writebacks"] += len(ids)

    def bulk_load(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Write full rows of distinct `ids` straight into the store of record.

        Any cached copy (clean or dirty) in the tiers above is dropped; durable on return.
        """
        self._absent = None
        for tier in self.tiers[:-1]:
            held = np.ascontiguousarray(ids[tier.backend.contains(ids)])
            if len(held):  # a load is mostly rows no cache holds: skip the policy's work
                self._drop(tier, held)
        if self._writer is not None:
            self._writer.drain()  # queued write-backs are older than the loaded rows
        self.note_bottom_write(ids)
        bottom = self.tiers[-1].backend
        target = getattr(bottom, "wrapped", bottom)
        if isinstance(target, SupportsBulkLoad):
            target.bulk_load(ids, rows)
        else:
            target.put(ids, rows)
            target.flush()

    def delete(self, ids: np.ndarray) -> np.ndarray:
        """Remove distinct `ids` from every tier; returns bool[N], which were stored."""
        self._absent = None
        self.note_bottom_write(ids)
        found = np.zeros(len(ids), dtype=bool)
        for tier in self.tiers:
            found |= self._drop(tier, ids)
        return found

    def _drop(self, tier: Tier, ids: np.ndarray) -> np.ndarray:
        """Delete distinct `ids` from one tier with its policy and dirty bits; bool[N] removed.

        The policy and the dirty bits forget the ids first (a shared index, and bits per
        slot, must still know them). If the delete then fails or is interrupted, the rows
        it left stay tracked and keep their dirty bits: a row newer than the tier below,
        held clean, would be kept from every flush.
        """
        if tier.eviction is None and tier.dirty is None:
            return tier.backend.delete(ids)
        # a store of record keeps no dirty bits and deletes a batch in one write: all or
        # nothing. Which rows it held is asked only if the delete fails (a read of RocksDB
        # costs more than the delete)
        held = None if tier.is_bottom else tier.backend.contains(ids)
        was_dirty = None if tier.dirty is None else tier.dirty.which(ids, None)[0]
        try:
            if tier.eviction is not None:
                tier.eviction.record_remove(ids)
            if tier.dirty is not None:
                tier.dirty.clear(ids, None)
            removed = tier.backend.delete(ids)
        except BaseException:
            self._keep_what_stayed(tier, ids, held, was_dirty)
            raise
        if tier.eviction is not None:
            tier.rows -= int(np.count_nonzero(removed))
        return removed

    def _keep_what_stayed(self, tier: Tier, ids: np.ndarray, held: np.ndarray | None,
                          was_dirty: np.ndarray | None) -> None:
        """After a failed `_drop`: track again, and mark dirty again, the rows still held.

        `held` (bool[N]) says which ids the tier held before; None: the same as now.
        """
        stayed = tier.backend.contains(ids)
        if held is not None:
            stayed &= held
        kept = np.ascontiguousarray(ids[stayed])
        if tier.eviction is not None:
            if held is not None:
                tier.rows -= int(np.count_nonzero(held)) - len(kept)
            self._track_again(tier, kept)
        if tier.dirty is not None and was_dirty is not None:
            tier.dirty.mark(np.ascontiguousarray(ids[stayed & was_dirty]), None)

    # --- whole-table operations -------------------------------------------------------------

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """bool[N]: whether each id is stored in any tier."""
        found = np.zeros(len(ids), dtype=bool)
        for tier in self.tiers:
            rest = np.flatnonzero(~found)
            if not len(rest):
                break
            found[rest] = tier.backend.contains(np.ascontiguousarray(ids[rest]))
        return found

    def write_back_all(self) -> None:
        """Write every dirty row down to the store of record, level by level.

        On the calling thread: whoever writes everything back waits for it anyway, and a
        store of many tables would otherwise start a writer thread for each table at its
        first flush.
        """
        now = self._tick()
        for tier in self.tiers[:-1]:
            if tier.dirty is None:
                continue
            dirty, slots = tier.dirty.items()
            if len(dirty):
                self._write_back(tier, dirty, slots, now, in_line=True)
        self._settle_expired()

    def flush(self) -> None:
        """Write back every dirty row, then make the store of record durable."""
        self.write_back_all()
        self.sync()

    def sync(self) -> None:
        """Make every tier durable as it stands (`flush` without the write-back)."""
        for tier in self.tiers:
            tier.backend.flush()

    def __len__(self) -> int:
        """Number of stored rows: the store of record's, plus dirty cache rows it lacks.

        Changes nothing (no write-back): a clean cache row is always also below.
        """
        dirty = [tier.dirty.items()[0] for tier in self.tiers[:-1] if tier.dirty is not None]
        bottom = self.tiers[-1].backend
        n = len(bottom)
        if dirty:
            ids = unique_sorted(np.concatenate(dirty))
            if len(ids):
                n += int(len(ids) - np.count_nonzero(bottom.contains(ids)))
        return n

    def items(self, batch_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, full rows) pages over every stored row, after writing back dirty rows.

        The pages are read from the store of record when the caller asks for them.
        """
        self.write_back_all()
        return self.tiers[-1].backend.items(batch_rows)

    def statistics(self) -> list[TierStatistics]:
        """One `TierStatistics` per tier, top first."""
        return [t.statistics() for t in self.tiers]

    def close(self) -> None:
        """Close every backend (without flushing caches: call flush first to keep writes)."""
        errors = []
        for tier in self.tiers:
            try:
                tier.backend.close()  # the drained view applies its queue first
            except Exception as exc:  # close the rest, then report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]
