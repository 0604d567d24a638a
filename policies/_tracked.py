"""Shared machinery of the eviction policies: tracked ids in dense slots, a lazy FIFO log.

`Tracked` maps ids to dense int32 slots through `IdIndex` and keeps per-slot numpy columns, so
a policy's state is a handful of arrays, never a Python object per id. `SlotLog` is an
append-only log of (slot, stamp) pairs read from its head; an entry is live only while its
stamp equals the slot's current stamp, so moving an id to the tail (LRU) or dropping it is
O(1) vectorised work now and the stale entry is skipped later (lazy deletion). Victim scans
therefore cost O(victims + stale entries) per call, amortised O(batch), not O(tracked).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from embstore._kernels._policy_kernels import ffi as _ffi
from embstore._kernels._policy_kernels import lib as _kernels
from embstore._unique import unique_sorted
from embstore.index import IdIndex, _ptr
from embstore.policy import EvictionPolicy, as_ids

__all__: list[str] = []




def slots_by_id(ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """`slots` (int32) reordered by ascending `ids` (distinct int64), one radix pass in C."""
    n = len(ids)
    ids = as_ids(ids)
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    keys = np.empty((2, n), dtype=np.uint64)
    out = np.empty((2, n), dtype=np.int32)
    which = _kernels.slots_by_id(_ptr("int64_t *", ids), _ptr("int32_t *", slots), n,
                                 _ptr("uint64_t *", keys[0]), _ptr("int32_t *", out[0]),
                                 _ptr("uint64_t *", keys[1]), _ptr("int32_t *", out[1]))
    return out[which]


def count_accesses(count: np.ndarray, seen: np.ndarray, call: int, slots: np.ndarray) -> None:
    """`count[s] += 1` (float64) per occurrence of each slot s, and `seen[s] = call` (int64)."""
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    _kernels.count_accesses(_ptr("double *", count), _ptr("int64_t *", seen), call,
                            _ptr("int32_t *", slots), len(slots))


def count_accesses_saturating(freq: np.ndarray, top: int, slots: np.ndarray) -> None:
    """`freq[s] = min(freq[s] + 1, top)` (uint8) per occurrence of each slot s."""
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    _kernels.count_accesses_saturating(_ptr("uint8_t *", freq), top, _ptr("int32_t *", slots),
                                       len(slots))


class Tracked:
    """Tracked ids with per-slot numpy columns.

    Args:
        columns: name -> (dtype, fill value for a fresh slot).
    """

    def __init__(self, columns: dict[str, tuple[type, float]]) -> None:
        self.index = IdIndex()
        self._owns_index = True
        self._count = 0
        self._spec = dict(columns)
        self.ids = np.zeros(0, dtype=np.int64)
        self.alive = np.zeros(0, dtype=bool)
        self.cols: dict[str, np.ndarray] = {
            name: np.zeros(0, dtype=dt) for name, (dt, _) in self._spec.items()
        }

    def __len__(self) -> int:
        return self._count

    def share_index(self, index: IdIndex) -> None:
        """Use `index` (owned by the tier's backend) for id -> slot instead of a private one.

        The backend adds ids before they are inserted here and removes them only after they
        are untracked here; this class never changes a shared index. Saves a second hash
        probe per access: the backend hands over the slots its own lookup found.
        """
        if self._count:
            raise RuntimeError("share_index needs an empty policy")
        self.index = index
        self._owns_index = False
        self._grow(index.high_water)

    def live_slots(self, slots: np.ndarray) -> np.ndarray:
        """The `slots` (of the shared index) that are tracked."""
        self._grow(self.index.high_water)
        return slots[self.alive[slots]]

    def ensure(self, high_water: int) -> None:
        """Size the per-slot columns for slots below `high_water`."""
        self._grow(high_water)

    def _grow(self, high_water: int) -> None:
        size = len(self.ids)
        if high_water <= size:
            return
        new = max(high_water, 2 * size, 1024)

        def grow(a: np.ndarray, fill: float) -> np.ndarray:
            out = np.full(new, fill, dtype=a.dtype)
            out[:size] = a
            return out

        self.ids = grow(self.ids, 0)
        self.alive = grow(self.alive, False)
        for name, (_, fill) in self._spec.items():
            self.cols[name] = grow(self.cols[name], fill)

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Track distinct `ids`; returns their slots (already tracked ones keep theirs)."""
        ids = as_ids(ids)
        if self._owns_index:
            slots, inserted = self.index.add(ids)
            self._grow(self.index.high_water)
        else:
            self._grow(self.index.high_water)
            slots = self.index.find(ids)
            if (slots < 0).any():
                raise RuntimeError("ids must be in the shared index before they are tracked")
            inserted = ~self.alive[slots]
        self._count += int(np.count_nonzero(inserted))
        fresh = slots[inserted]
        self.ids[fresh] = ids[inserted]
        self.alive[fresh] = True
        for name, (_, fill) in self._spec.items():
            self.cols[name][fresh] = fill
        return slots

    def insert_at(self, ids: np.ndarray, slots: np.ndarray,
                  reset: tuple[str, ...] | None = None) -> None:
        """Track distinct, untracked `ids` that the shared index holds at `slots`.

        Resets the columns named in `reset` (all when None; the caller writes the others).
        """
        if self._owns_index:
            raise RuntimeError("insert_at needs a shared index (see share_index)")
        self._grow(self.index.high_water)
        self._count += len(slots)
        self.ids[slots] = ids
        self.alive[slots] = True
        for name, (_, fill) in self._spec.items():
            if reset is None or name in reset:
                self.cols[name][slots] = fill

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slots of `ids` that are tracked (int32[M], order of `ids`, duplicates kept)."""
        if not len(ids):
            return np.zeros(0, dtype=np.int32)
        slots = self.index.find(as_ids(ids))
        slots = slots[slots >= 0]
        return slots if self._owns_index else self.live_slots(slots)

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Untrack `ids` (absent ones ignored); returns the freed slots."""
        if not len(ids):
            return np.zeros(0, dtype=np.int32)
        ids = unique_sorted(as_ids(ids))
        if self._owns_index:
            slots = self.index.remove(ids)
            slots = slots[slots >= 0]
        else:
            slots = self.index.find(ids)
            slots = self.live_slots(slots[slots >= 0])
        self.alive[slots] = False
        self._count -= len(slots)
        return slots

    def remove_slots(self, slots: np.ndarray) -> np.ndarray:
        """Untrack the ids at distinct live `slots`; returns those ids."""
        ids = self.ids[slots].copy()
        if self._owns_index:
            self.index.remove(ids)
        self.alive[slots] = False
        self._count -= len(slots)
        return ids


class SlotLog:
    """Append-only FIFO of (slot, stamp) entries with lazy deletion.

    The owner keeps `stamp[slot]`; an entry is live iff the slot is alive and its stamp matches.
    Re-appending a slot with a fresh stamp makes its older entries stale.
    """

    def __init__(self) -> None:
        self.slots = np.zeros(1024, dtype=np.int32)
        self.stamps = np.zeros(1024, dtype=np.int64)
        self.head = 0
        self.tail = 0
        self.next_stamp = 1

    def __len__(self) -> int:
        return self.tail - self.head

    def push(self, slots: np.ndarray, stamp: np.ndarray, alive: np.ndarray) -> None:
        """Append `slots` in order, writing their fresh stamps into the owner's `stamp` column."""
        n = len(slots)
        if not n:
            return
        if self.tail + n > len(self.slots):
            self._compact(stamp, alive, extra=n)
        fresh = np.arange(self.next_stamp, self.next_stamp + n, dtype=np.int64)
        self.next_stamp += n
        self.slots[self.tail : self.tail + n] = slots
        self.stamps[self.tail : self.tail + n] = fresh
        self.tail += n
        stamp[slots] = fresh

    def touch(self, slots: np.ndarray, stamp: np.ndarray, alive: np.ndarray,
              time: np.ndarray | None = None, now: float = 0.0) -> None:
        """Append each of `slots` (repeats allowed) once, with fresh stamps.

        In order of first occurrence; sets `time[slot] = now` where `time` (float64) is given.
        """
        if not len(slots):
            return
        slots = np.ascontiguousarray(slots, dtype=np.int32)
        self.reserve(len(slots), stamp, alive)
        pos = self._positions()
        _kernels.log_touch(_ptr("int32_t *", self.slots), _ptr("int64_t *", self.stamps),
                           _ptr("int64_t *", pos), _ptr("int64_t *", stamp),
                           _ptr("int32_t *", slots), len(slots),
                           _ffi.NULL if time is None else _ptr("double *", time), now)
        self._moved_to(pos)

    def _positions(self) -> np.ndarray:
        """(head, tail, next stamp) for a C kernel to update in place (see `_moved_to`)."""
        return np.array([self.head, self.tail, self.next_stamp], dtype=np.int64)

    def _moved_to(self, pos: np.ndarray) -> None:
        self.tail, self.next_stamp = int(pos[1]), int(pos[2])
        self.advance(int(pos[0]))

    def _compact(self, stamp: np.ndarray, alive: np.ndarray, extra: int) -> None:
        # drop stale entries, then grow if the live ones still leave too little room
        s = self.slots[self.head : self.tail]
        t = self.stamps[self.head : self.tail]
        keep = alive[s] & (stamp[s] == t)
        s, t = s[keep], t[keep]
        cap = len(self.slots)
        while len(s) + extra > cap // 2:
            cap *= 2
        if cap != len(self.slots):
            self.slots = np.zeros(cap, dtype=np.int32)
            self.stamps = np.zeros(cap, dtype=np.int64)
        self.slots[: len(s)] = s
        self.stamps[: len(s)] = t
        self.head, self.tail = 0, len(s)

    def peek_live(
        self, count: int, stamp: np.ndarray, alive: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The next up to `count` live entries from the head, without consuming them.

        Returns:
            slots: int32[K], K <= count, oldest first.
            positions: int64[K], their log positions (`advance(positions[i] + 1)` consumes
                through entry i).
            end: where the scan stopped; `advance(end)` consumes all K and the stale entries.
        """
        pos = self.head
        out: list[np.ndarray] = []
        where: list[np.ndarray] = []
        found = 0
        chunk = max(2 * count, 256)
        while found < count and pos < self.tail:
            end = min(self.tail, pos + chunk)
            s = self.slots[pos:end]
            idx = np.flatnonzero(alive[s] & (stamp[s] == self.stamps[pos:end]))
            idx = idx[: count - found]
            out.append(s[idx])
            where.append(idx + pos)
            found += len(idx)
            pos = end if found < count else pos + int(idx[-1]) + 1
            chunk *= 2
        if not out:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), pos
        return np.concatenate(out), np.concatenate(where), pos

    def reserve(self, extra: int, stamp: np.ndarray, alive: np.ndarray) -> None:
        """Make room for `extra` appends (compacting, or growing, the log)."""
        if self.tail + extra > len(self.slots):
            self._compact(stamp, alive, extra=extra)

    def clock_sweep(self, need: int, live: int, stamp: np.ndarray, alive: np.ndarray,
                    ref: np.ndarray) -> np.ndarray:
        """Run CLOCK's hand from the head for up to `need` victims.

        Returns int32 slots, their `alive` now cleared; referenced entries passed have `ref`
        cleared and are re-appended. `live`: the owner's tracked count, which bounds the
        re-appends.
        """
        self.reserve(live, stamp, alive)
        out = np.empty(max(need, 0), dtype=np.int32)
        pos = self._positions()
        k = _kernels.clock_sweep(_ptr("int32_t *", self.slots), _ptr("int64_t *", self.stamps),
                                 _ptr("int64_t *", pos), _ptr("int64_t *", stamp),
                                 _ptr("uint8_t *", alive), _ptr("uint8_t *", ref), len(out),
                                 _ptr("int32_t *", out))
        self._moved_to(pos)
        return out[:k]

    def advance(self, pos: int) -> None:
        """Consume the log up to position `pos`."""
        self.head = pos
        if self.head == self.tail:
            self.head = self.tail = 0


def smallest(
    slots: np.ndarray, key: np.ndarray, tie: np.ndarray, ids: np.ndarray, n: int
) -> np.ndarray:
    """The `n` of `slots` with the smallest `key[slot]`, ties by `tie[slot]`, then by id.

    A cascade of partitions, one per key, each over the entries still tied at the cut: O(len)
    even when most keys are equal (fresh LFU counts are all 1), where a lexsort of the ties
    would cost O(len log len).
    """
    chosen: list[np.ndarray] = []
    for column in (key, tie, ids):
        if n <= 0:
            break
        if n >= len(slots):
            chosen.append(slots)
            n = 0
            break
        k = column[slots]
        cut = np.partition(k, n - 1)[n - 1]
        below = slots[k < cut]
        chosen.append(below)
        n -= len(below)
        slots = slots[k == cut]
    if n > 0:  # the id level leaves the n-th id itself tied at its own cut
        chosen.append(slots[:n])
    return np.concatenate(chosen) if chosen else slots[:0]


class TrackedEviction(EvictionPolicy):
    """An eviction policy over `Tracked` ids (`self._t`) that can share its tier's index.

    Subclasses implement `_access(slots, now)` for tracked, possibly repeated slots; reads
    then cost one probe of the backend's index (or none, through `record_access_slots`).
    """

    _t: Tracked
    reads_matter: ClassVar[bool] = True
    """False for policies whose choice ignores accesses (FIFO, random): reads then cost
    nothing."""

    def __len__(self) -> int:
        return len(self._t)

    def share_index(self, index: IdIndex) -> None:
        """Track ids in the slots of `index`, the tier backend's own (see `Tracked`)."""
        self._t.share_index(index)

    def _record_access(self, ids: np.ndarray, now: float) -> None:
        if not self.reads_matter:
            return
        slots = self._t.find(ids)
        if len(slots):
            self._access(slots, now)

    def record_access_slots(self, slots: np.ndarray, now: float) -> None:
        """`record_access` for ids given by their slots in the shared index.

        The tier passes only slots of ids it holds, which are all tracked, so no liveness
        filter runs on this hit path (a stray dead slot would be harmless anyway: every
        column is reset when a slot is taken by a new id).
        """
        if not self.reads_matter:
            return
        self._t.ensure(self._t.index.high_water)
        if len(slots):
            self._access(slots, now)

    def record_insert_slots(self, ids: np.ndarray, slots: np.ndarray, now: float) -> None:
        """`record_insert` of `ids` the backend has just added at `slots` of the shared index.

        Note for implementers: the default ignores the slots and probes the index again.
        """
        self.record_insert(ids, now)

    def choose_victim_slots(self, n: int, now: float) -> tuple[np.ndarray, np.ndarray]:
        """`choose_victims`, with the victims' slots (int32) in the shared index.

        Note for implementers: the default probes the index for the victims' slots.
        """
        victims = self.choose_victims(n, now)
        return victims, self._t.index.find(victims)

    def _record_remove(self, ids: np.ndarray) -> None:
        self._t.remove(ids)

    def _access(self, slots: np.ndarray, now: float) -> None:
        """Note accesses of tracked `slots` (duplicates allowed)."""

    def _pop_oldest(self, log: SlotLog, n: int) -> np.ndarray:
        """Untrack and return the `n` ids whose live entries in `log` are oldest.

        Entries are stamped in the "stamp" column.
        """
        n = min(int(n), len(self))
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        slots, _, pos = log.peek_live(n, self._t.cols["stamp"], self._t.alive)
        log.advance(pos)
        return self._t.remove_slots(slots)
