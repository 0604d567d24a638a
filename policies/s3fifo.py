"""S3-FIFO eviction (Yang et al., SOSP 2023): a small FIFO, a main FIFO and a ghost FIFO."""

from __future__ import annotations

from typing import Any, ClassVar, final

import numpy as np

from embstore.policy import real_setting, whole_setting

from ._tracked import SlotLog, Tracked, TrackedEviction, count_accesses_saturating

__all__ = ["S3FIFOEviction"]

_SMALL, _MAIN = 0, 1
_MAX_FREQ = 3  # the paper's two-bit counter


@final
class S3FIFOEviction(TrackedEviction):
    """Quick demotion of one-hit wonders through a small probationary FIFO.

    New ids enter the small queue S, or the main queue M if the ghost queue G remembers them.
    Each id has a frequency capped at 3, raised by accesses. While S holds at least
    `small_ratio` of the tracked ids, eviction takes S's oldest: one accessed at least
    `move_to_main_threshold` times moves to M with its frequency cleared, the others are
    evicted into G. Otherwise M's oldest is evicted if its frequency is 0, else re-queued with
    frequency - 1 (2-bit CLOCK). G keeps the last `ghost_ratio` x tracked evicted ids, FIFO.

    The tier gives no capacity, so the policy's "cache size" is the number of tracked ids
    when eviction is asked for (a tier evicts when full, so this is its capacity). Each queue
    is a lazy log swept in numpy chunks; a call costs O(entries swept).

    Args:
        small_ratio: share of the tracked ids the small queue may hold, in (0, 1).
        ghost_ratio: ghost entries kept, as a multiple of the tracked ids, finite and >= 0.
        move_to_main_threshold: accesses in S that earn a move to M (1 in the paper's code).
        seed: kept for the common interface; S3-FIFO uses no randomness.

    Raises:
        ConfigError: a setting is out of range.
    """

    name: ClassVar[str] = "s3fifo"

    def __init__(self, *, small_ratio: float = 0.1, ghost_ratio: float = 0.9,
                 move_to_main_threshold: int = 1, seed: int = 0) -> None:
        small_ratio = real_setting("S3FIFOEviction", "small_ratio", small_ratio, 0, 1,
                                   low_open=True, high_open=True)
        # finite: the ghost queue's size, int(ghost_ratio * tracked), is taken at every
        # eviction, and int(inf) would fail there after the tier had changed. Any finite
        # ratio is exact there; a large one only means "remember every evicted id".
        ghost_ratio = real_setting("S3FIFOEviction", "ghost_ratio", ghost_ratio, 0)
        move_to_main_threshold = whole_setting("S3FIFOEviction", "move_to_main_threshold",
                                               move_to_main_threshold, 1, _MAX_FREQ)
        super().__init__(seed=seed)
        self.small_ratio = float(small_ratio)
        self.ghost_ratio = float(ghost_ratio)
        self.move_to_main_threshold = int(move_to_main_threshold)
        self._t = Tracked({"queue": (np.int8, _SMALL), "freq": (np.uint8, 0),
                           "stamp_s": (np.int64, 0), "stamp_m": (np.int64, 0)})
        self._small = SlotLog()
        self._main = SlotLog()
        self._n_small = 0
        self._ghost = Tracked({"stamp": (np.int64, 0)})
        self._ghost_log = SlotLog()

    def _access(self, slots: np.ndarray, now: float) -> None:
        count_accesses_saturating(self._t.cols["freq"], _MAX_FREQ, slots)

    def _record_insert(self, ids: np.ndarray, now: float) -> None:
        ids = np.sort(ids)
        ghosted = self._ghost.index.find(ids) >= 0
        self._ghost.remove(ids[ghosted])
        slots = self._t.insert(ids)
        self._t.cols["freq"][slots] = 0
        to_main, to_small = slots[ghosted], slots[~ghosted]
        self._t.cols["queue"][to_main] = _MAIN
        self._t.cols["queue"][to_small] = _SMALL
        self._main.push(to_main, self._t.cols["stamp_m"], self._t.alive)
        self._small.push(to_small, self._t.cols["stamp_s"], self._t.alive)
        self._n_small += len(to_small)

    def _record_remove(self, ids: np.ndarray) -> None:
        freed = self._t.remove(ids)
        self._n_small -= int(np.count_nonzero(self._t.cols["queue"][freed] == _SMALL))

    def _evict_small(self, need: int, floor: float) -> tuple[np.ndarray, int]:
        """Sweep S until `need` victims or S drops below `floor` after a victim."""
        t, freq = self._t, self._t.cols["freq"]
        slots, where, end = self._small.peek_live(max(2 * need, 4096), t.cols["stamp_s"],
                                                  t.alive)
        promote = freq[slots] >= self.move_to_main_threshold
        victim = ~promote
        n_victims = np.cumsum(victim)
        small_after = self._n_small - np.arange(1, len(slots) + 1)
        # the paper re-checks |S| >= small share before each eviction, i.e. after each victim
        stop = np.flatnonzero(victim & ((n_victims == need) | (small_after < floor)
                                        | (small_after == 0)))
        cut = int(stop[0]) + 1 if len(stop) else len(slots)
        self._small.advance(int(where[cut - 1]) + 1 if cut < len(slots) else end)
        moved = slots[:cut][promote[:cut]]
        freq[moved] = 0
        t.cols["queue"][moved] = _MAIN
        self._main.push(moved, t.cols["stamp_m"], t.alive)
        gone = slots[:cut][victim[:cut]]
        self._n_small -= cut
        return gone, len(gone)

    def _evict_main(self, need: int) -> tuple[np.ndarray, int]:
        """Sweep M once over a chunk: frequency 0 is evicted, others re-queued one lower."""
        t, freq = self._t, self._t.cols["freq"]
        slots, where, end = self._main.peek_live(max(2 * need, 4096), t.cols["stamp_m"], t.alive)
        victim = freq[slots] == 0
        hit = np.flatnonzero(np.cumsum(victim) == need)
        cut = int(hit[0]) + 1 if len(hit) else len(slots)
        self._main.advance(int(where[cut - 1]) + 1 if cut < len(slots) else end)
        passed = slots[:cut][~victim[:cut]]
        freq[passed] -= 1
        self._main.push(passed, t.cols["stamp_m"], t.alive)
        gone = slots[:cut][victim[:cut]]
        return gone, len(gone)

    def _choose_victims(self, n: int, now: float) -> np.ndarray:
        size = len(self)
        need = min(int(n), size)
        floor = self.small_ratio * size
        out: list[np.ndarray] = []
        ghosts: list[np.ndarray] = []
        while need > 0:
            n_main = len(self) - self._n_small
            if self._n_small > 0 and (self._n_small >= floor or n_main == 0):
                gone, k = self._evict_small(need, floor)
                ids = self._t.remove_slots(gone)
                ghosts.append(ids)
            else:
                gone, k = self._evict_main(need)
                ids = self._t.remove_slots(gone)
            out.append(ids)
            need -= k
        if ghosts:
            self._remember(np.concatenate(ghosts), size)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def _remember(self, ids: np.ndarray, size: int) -> None:
        """Add evicted small-queue ids to the ghost FIFO, dropping its oldest over capacity."""
        if len(ids):
            slots = self._ghost.insert(ids)
            self._ghost_log.push(slots, self._ghost.cols["stamp"], self._ghost.alive)
        excess = len(self._ghost) - int(self.ghost_ratio * size)
        if excess > 0:
            old, _, pos = self._ghost_log.peek_live(excess, self._ghost.cols["stamp"],
                                                    self._ghost.alive)
            self._ghost_log.advance(pos)
            self._ghost.remove_slots(old)

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"small_ratio": self.small_ratio, "ghost_ratio": self.ghost_ratio,
                "move_to_main_threshold": self.move_to_main_threshold, "seed": self.seed}
