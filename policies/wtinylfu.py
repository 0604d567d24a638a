"""W-TinyLFU eviction: an LRU window, a segmented main region, TinyLFU admission between them."""

from __future__ import annotations

from typing import Any, ClassVar, final

import numpy as np

from embstore._unique import unique_sorted
from embstore.errors import ConfigError
from embstore.policy import real_setting

from ._hashing import sketch_count, sketch_estimate, sketch_halve
from ._tracked import SlotLog, Tracked, TrackedEviction, slots_by_id

__all__ = ["WTinyLFUEviction"]

_WINDOW, _PROBATION, _PROTECTED = 0, 1, 2
_DEPTH = 4  # rows of the frequency sketch
_AGE_COUPLING = 3.0  # the sketch forgets (1 - 3 x window share) times as slowly
_WIDTH = 16  # sketch counters per row per id of capacity
# the climber's probe phases: above, below, below, above its centre, so that a hit ratio
# that rises or falls steadily over the four (a drifting hot set) weighs on both sides alike
_PATTERN = (1, -1, -1, 1)
# the step after a move in the same direction (2x when the two sides' hit ratios differ by
# more than _STRONG of the larger: a recency-heavy stream then reaches a full window in a few
# rounds), and after a move in the other direction
_GROW, _GROW_STRONG, _STRONG, _SHRINK = 1.5, 2.0, 0.05, 0.5
_MIN_STEP, _MAX_STEP = 0.01, 0.5
_MIN_PROBE, _MAX_PROBE = 0.02, 0.1  # the probe's distance from the centre: the step, bounded
# a phase whose hit ratio falls by more than a fifth of the last one's (and by more than
# chance allows) marks a new hot set: the sketch is halved twice at once, so the old set's
# counts stop outbidding the new ids for space in the main region; and the climber's step is
# raised to a quarter (Caffeine restarts its climber, at its initial step, on a jump of the
# hit rate): the best window moves too
_SHIFT_DROP, _SHIFT_HALVINGS, _SHIFT_STEP = 0.2, 2, 0.25
# a round moves the centre only if its two sides' hit ratios differ by more than one
# standard error: on a flat stretch the climber otherwise wanders on noise alone
_SIGNIF = 1.0


@final
class WTinyLFUEviction(TrackedEviction):
    """Window TinyLFU with a hill-climbing window, after the design of Caffeine.

    New ids enter a small LRU *window*. What overflows the window is a *candidate* for the
    *main* region, a segmented LRU (a *probation* segment, and a *protected* one that holds
    up to `protected_share` of main; a hit in probation moves an id to protected, protected
    overflow falls back to probation). When ids must go, the candidates and main's oldest
    ids (probation first) compete on their estimated frequency, read from a count-min sketch
    of every id seen (resident or not; 4-bit counters, 16 per row per id of capacity,
    halved after `sketch_factor` x capacity additions, as in TinyLFU): the least frequent
    lose, a tie going against the candidate. Surviving candidates join probation; surviving
    main ids keep their place.

    Batches: one call is one step. A call counts each distinct id once in the sketch (so
    the frequency is the number of batches an id was read in, what a tier's misses depend
    on), and the competition ranks a whole batch of candidates and victims at once, so the
    n evicted are the n least frequent of both groups together rather than the losers of n
    sequential duels.

    The window's share of the capacity starts at `window_share` and is tuned online by hill
    climbing on the hit ratio, in rounds of four probe phases of `sample_factor` x capacity
    requests (hits and inserts) each: the window runs at the climber's centre plus a probe,
    then minus it twice, then plus it again, and the centre then moves by a step toward the
    side whose phases hit more, if by more than one standard error (the first phase, run
    while the cache fills, is not counted).
    A step in the same direction as the last grows 1.5x, or 2x where the two sides' hit
    ratios differ by more than 5% (up to half the capacity); a reversal, or a move the
    bounds [0, 1] cut off entirely, halves it (down to 1%); the probe is the step, within
    [0.02, 0.1]. A window of the whole capacity is LRU: on a stream with no reuse beyond
    recency (a sliding window of ids) the window climbs there within five rounds.
    Caffeine's climber compares each sample with the one before, which a stream whose hit
    ratio moves on its own defeats: on a drifting hot set the ratio fell from sample to
    sample whatever the window did, the climber reversed at every sample, and the window
    stayed at 1-7% where 50% misses 9% less. The symmetric phases cancel such a trend when
    it is steady over a round. Recency-heavy streams grow the window, frequency-heavy ones
    shrink it; the sketch's halving period shrinks with the window (times 1 - 3 x share, at
    least 0.1), so frequencies forget faster where recency pays; and a phase whose hit
    ratio falls by more than a fifth of the last phase's (and by more than three standard
    errors) halves the sketch twice at once and raises the climber's step to a quarter (a
    fall that goes on into the next phase does so again, which can empty the sketch):
    the hot set changed, and the old set's counts would otherwise keep the new ids out of
    the main region for a whole halving period.
    Phases are short (half the capacity; Caffeine samples 10 x): a trace of a few hundred
    batches must see enough rounds to climb. As for S3-FIFO, the capacity is the number of
    tracked ids left after an eviction. A call costs O(batch + victims) numpy work.

    Args:
        window_share: initial share of the capacity in the window, in [0, 1).
        protected_share: share of the main region kept in the protected segment, in [0, 1].
        climb: tune the window share online (False keeps `window_share`, and a fall of the
            hit ratio no longer ages the sketch early).
        step: the climber's initial step, as a share of the capacity, in (0, 1) (0.125,
            twice Caffeine's: a trace of a few hundred batches leaves few rounds to climb).
        sample_factor: requests per probe phase, as a multiple of the capacity, > 0.
        sketch_factor: sketch additions between halvings, as a multiple of the capacity,
            > 0 (TinyLFU halves after 10 x capacity with a 4x narrower sketch; smaller
            forgets faster, for a drifting hot set).
        hold_new: keep the ids inserted at the current `now` out of the competition until a
            later call (for a cache tier of a training store, where the rows a step promotes
            are written by the same step; costs ~2% more misses on the calibrated trace).
        seed: seeds the sketch's hashes.

    Raises:
        ConfigError: a setting is out of range.
    """

    name: ClassVar[str] = "wtinylfu"

    def __init__(self, *, window_share: float = 0.01, protected_share: float = 0.8,
                 climb: bool = True, step: float = 0.125, sample_factor: float = 0.5,
                 sketch_factor: float = 40.0, hold_new: bool = False,
                 seed: int = 0) -> None:
        window_share = real_setting("WTinyLFUEviction", "window_share", window_share, 0, 1,
                                    high_open=True)
        protected_share = real_setting("WTinyLFUEviction", "protected_share", protected_share,
                                       0, 1)
        step = real_setting("WTinyLFUEviction", "step", step, 0, 1, low_open=True,
                            high_open=True)
        sketch_factor = real_setting("WTinyLFUEviction", "sketch_factor", sketch_factor, 0,
                                     low_open=True)
        for setting, value in (("climb", climb), ("hold_new", hold_new)):
            if not (isinstance(value, bool | np.bool_) or
                    (isinstance(value, int) and value in (0, 1))):
                raise ConfigError(f"WTinyLFUEviction {setting} must be true or false, got "
                                  f"{value!r}")
        sample_factor = real_setting("WTinyLFUEviction", "sample_factor", sample_factor, 0,
                                     low_open=True)
        super().__init__(seed=seed)
        self.window_share = float(window_share)
        self.protected_share = float(protected_share)
        self.climb = bool(climb)
        self.step = float(step)
        self.sample_factor = float(sample_factor)
        self.sketch_factor = float(sketch_factor)
        self.hold_new = bool(hold_new)
        self._t = Tracked({"queue": (np.int8, _WINDOW), "stamp_w": (np.int64, 0),
                           "stamp_p": (np.int64, 0), "stamp_r": (np.int64, 0)})
        self._logs = {_WINDOW: SlotLog(), _PROBATION: SlotLog(), _PROTECTED: SlotLog()}
        self._stamp = {_WINDOW: "stamp_w", _PROBATION: "stamp_p", _PROTECTED: "stamp_r"}
        self._sizes = {_WINDOW: 0, _PROBATION: 0, _PROTECTED: 0}
        self._bits = 10
        self._sketch = np.zeros((_DEPTH, 1 << (self._bits - 1)), dtype=np.uint8)  # 4-bit pairs
        self._added = 0
        self._capacity = 0  # largest number of ids tracked after an eviction
        self._share = self.window_share
        self._step = self.step
        self._hits = 0
        self._misses = 0
        self._center = self.window_share
        self._phase = 0
        # hits and requests of the round's phases below (index 0) and above (1) the centre
        self._phase_hits = [0, 0]
        self._phase_requests = [0, 0]
        self._last_ratio = 0.0
        self._last_requests = 0
        self._shifts = 0
        self._warm = False
        self._direction = 0.0  # of the climber's last move: 1 up, -1 down, 0 none yet
        if self.climb:
            self._share = self._probe_share()
        self._fresh = (-np.inf, 0)  # (now, ids inserted at that time)

    @property
    def current_window_share(self) -> float:
        """The climber's window share: the centre its probes alternate around."""
        return self._center

    @property
    def hot_set_shifts(self) -> int:
        """How many times a sharp fall of the hit ratio aged the sketch (a new hot set)."""
        return self._shifts

    # --- frequency sketch -------------------------------------------------------------------

    def _count(self, ids: np.ndarray) -> None:
        """Add distinct `ids` to the sketch (4-bit saturating), halving it when a sample ends."""
        if not len(ids):
            return
        sketch_count(self._sketch, ids, self.seed, 15)
        self._added += len(ids)
        if self._added >= self._sketch_period():
            sketch_halve(self._sketch)
            self._added //= 2

    def _sketch_period(self) -> float:
        """Sketch additions between halvings.

        Shorter as the climber grows the window: a recency-heavy stream also wants
        frequencies that forget sooner.
        """
        base = self.sketch_factor * max(self._capacity, 1 << self._bits >> 4)
        return base * max(0.1, 1.0 - _AGE_COUPLING * self._center)

    def _estimate(self, ids: np.ndarray) -> np.ndarray:
        return sketch_estimate(self._sketch, ids, self.seed)

    def _fit_sketch(self) -> None:
        """Grow the sketch to `_WIDTH` counters per row per id of capacity.

        Two 4-bit counters a byte: 32-64 bytes per id of capacity over the 4 rows (the row
        length is a power of two). Tiling keeps every estimate: a position at the wider
        mask is the old one plus high bits, and each copy starts from the old counter; a
        row's length is even, so a counter keeps its nibble.
        """
        want = max(10, int(_WIDTH * self._capacity - 1).bit_length())
        if want > self._bits:
            self._sketch = np.tile(self._sketch, (1, 1 << (want - self._bits)))
            self._bits = want

    # --- queues -----------------------------------------------------------------------------

    def _push(self, queue: int, slots: np.ndarray) -> None:
        cols = self._t.cols
        cols["queue"][slots] = queue
        self._logs[queue].push(slots, cols[self._stamp[queue]], self._t.alive)
        self._sizes[queue] += len(slots)

    def _leave(self, queue: int, slots: np.ndarray) -> None:
        """Make the log entries of `slots` in `queue` stale (they move or go)."""
        self._t.cols[self._stamp[queue]][slots] = 0
        self._sizes[queue] -= len(slots)

    def _oldest(self, queue: int, n: int) -> tuple[np.ndarray, int]:
        """The `n` oldest ids of `queue` (slots) and where the scan stopped; consumes nothing."""
        if n <= 0:
            return np.zeros(0, dtype=np.int32), self._logs[queue].head
        slots, _, end = self._logs[queue].peek_live(n, self._t.cols[self._stamp[queue]],
                                                    self._t.alive)
        return slots, end

    def _keep_at_head(self, queue: int, end: int, slots: np.ndarray) -> None:
        """Consume `queue`'s log up to `end`, then put `slots` back at its head, in order.

        The entries before `end` were all scanned, so the last len(slots) positions before it
        are free to rewrite: survivors keep their place, as an unsuccessful challenge in
        Caffeine leaves the victim where it was.
        """
        log = self._logs[queue]
        k = len(slots)
        stamp = self._t.cols[self._stamp[queue]]
        fresh = np.arange(log.next_stamp, log.next_stamp + k, dtype=np.int64)
        log.next_stamp += k
        log.slots[end - k:end] = slots
        log.stamps[end - k:end] = fresh
        stamp[slots] = fresh
        log.head = end - k
        if log.head == log.tail:
            log.head = log.tail = 0

    # --- the policy interface -----------------------------------------------------------------

    def _access(self, slots: np.ndarray, now: float) -> None:
        slots = unique_sorted(slots)
        slots = slots_by_id(self._t.ids[slots], slots)  # id order: same as with a shared index
        self._hits += len(slots)
        self._count(self._t.ids[slots])
        queue = self._t.cols["queue"][slots]
        window = slots[queue == _WINDOW]
        self._leave(_WINDOW, window)
        self._push(_WINDOW, window)
        promoted = slots[queue == _PROBATION]
        self._leave(_PROBATION, promoted)
        self._push(_PROTECTED, promoted)
        protected = slots[queue == _PROTECTED]
        self._leave(_PROTECTED, protected)
        self._push(_PROTECTED, protected)

    def _record_insert(self, ids: np.ndarray, now: float) -> None:
        # docstring inherited
        ids = np.sort(ids)
        slots = self._t.insert(ids)
        self._fresh = (now, len(ids) + (self._fresh[1] if self._fresh[0] == now else 0))
        self._misses += len(ids)
        self._count(ids)
        self._push(_WINDOW, slots)

    def _record_remove(self, ids: np.ndarray) -> None:
        # docstring inherited
        freed = self._t.remove(ids)
        queue = self._t.cols["queue"][freed]
        for q in self._sizes:
            self._leave(q, freed[queue == q])

    def _adapt(self) -> None:
        """End the probe phase once it has seen its requests; after a round, move the centre."""
        requests = self._hits + self._misses
        if not self.climb or not requests or requests < self.sample_factor * self._capacity:
            return
        if not self._warm:
            # the first phase ran while the cache filled: its hit ratio says nothing of the
            # window (on a sliding-window trace a move on it sent the window down)
            self._warm = True
            self._hits = self._misses = 0
            return
        self._notice_shift(self._hits / requests, requests)
        above = int(_PATTERN[self._phase] > 0)
        self._phase_hits[above] += self._hits
        self._phase_requests[above] += requests
        self._hits = self._misses = 0
        self._phase = (self._phase + 1) % len(_PATTERN)
        if self._phase == 0:
            r_low, r_high = (h / max(r, 1) for h, r in zip(self._phase_hits,
                                                           self._phase_requests, strict=True))
            n_low, n_high = (max(r, 1) for r in self._phase_requests)
            self._phase_hits = [0, 0]
            self._phase_requests = [0, 0]
            p = (r_low + r_high) / 2
            noise = _SIGNIF * np.sqrt(max(p * (1 - p), 0.0) * (1 / n_low + 1 / n_high))
            if abs(r_high - r_low) > noise:
                direction = 1.0 if r_high > r_low else -1.0
                center = float(np.clip(self._center + direction * self._step, 0.0, 1.0))
                if center == self._center or (self._direction and direction != self._direction):
                    self._step = max(self._step * _SHRINK, _MIN_STEP)
                elif direction == self._direction:
                    strong = abs(r_high - r_low) > _STRONG * max(r_high, r_low)
                    self._step = min(self._step * (_GROW_STRONG if strong else _GROW),
                                     _MAX_STEP)
                self._direction = direction
                self._center = center
        self._share = self._probe_share()

    def _notice_shift(self, ratio: float, requests: int) -> None:
        """Age the sketch and widen the climber's step when the hit ratio falls sharply.

        The probes move the ratio by a few percent; a fall of a fifth that is also three
        standard errors wide is a new hot set, whose ids would otherwise wait a whole
        halving period (`sketch_factor` x capacity additions, less with a wide window) to
        outbid the old set's counts. The error is that of the difference of the two phases'
        ratios, each measured on its own requests: counting only this phase's noise, small
        caches (a few hundred requests a phase) saw a new hot set every hundred batches in a
        steady stream.
        """
        last, last_requests = self._last_ratio, self._last_requests
        self._last_ratio, self._last_requests = ratio, requests
        if not last_requests:
            return
        p = (last + ratio) / 2
        chance = 3.0 * np.sqrt(p * (1.0 - p) * (1 / requests + 1 / last_requests))
        if ratio < last * (1.0 - _SHIFT_DROP) and last - ratio > chance:
            for _ in range(_SHIFT_HALVINGS):
                sketch_halve(self._sketch)
            self._added = 0
            self._step = max(self._step, _SHIFT_STEP)
            self._shifts += 1

    def _probe_share(self) -> float:
        """The window share of the current phase: the centre plus or minus the probe."""
        probe = max(_MIN_PROBE, min(self._step, _MAX_PROBE))
        return float(np.clip(self._center + _PATTERN[self._phase] * probe, 0.0, 1.0))

    def _choose_victims(self, n: int, now: float) -> np.ndarray:
        # docstring inherited
        capacity = len(self) - n
        if capacity > self._capacity:
            self._capacity = capacity
            self._fit_sketch()
        self._adapt()
        # with hold_new, ids inserted at this very time stay in the window: a training tier
        # promotes a batch's rows at its lookup and writes them at its update, and a row
        # rejected in between is read from below twice
        fresh = self._fresh[1] if self.hold_new and self._fresh[0] == now else 0
        share_target = int(round(self._share * capacity))
        window_target = max(share_target, min(fresh, capacity))
        protected_target = int(self.protected_share * (capacity - share_target))
        sizes = self._sizes
        if sizes[_PROTECTED] > protected_target:
            demoted, end = self._oldest(_PROTECTED, sizes[_PROTECTED] - protected_target)
            self._logs[_PROTECTED].advance(end)
            self._leave(_PROTECTED, demoted)
            self._push(_PROBATION, demoted)
        n_main = sizes[_PROBATION] + sizes[_PROTECTED]
        from_main = min(n, n_main)
        # candidates: the window's overflow, or more of its oldest if main cannot give n
        k = max(sizes[_WINDOW] - window_target, n - from_main, 0)
        cand, cand_end = self._oldest(_WINDOW, k)
        prob, prob_end = self._oldest(_PROBATION, from_main)
        prot, prot_end = self._oldest(_PROTECTED, from_main - len(prob))
        pool = np.concatenate([cand, prob, prot])
        ids = self._t.ids[pool]
        freq = self._estimate(ids) if len(pool) else np.zeros(0, dtype=np.uint8)
        # least frequent first; a tie goes against the candidate, then the older id
        is_main = np.repeat(np.array([0, 1, 1], dtype=np.int8), [len(cand), len(prob), len(prot)])
        order = np.lexsort((np.arange(len(pool)), is_main, freq))
        evict = np.zeros(len(pool), dtype=bool)
        evict[order[:n]] = True
        parts = np.cumsum([len(cand), len(prob)])
        ev_c, ev_p, ev_r = np.split(evict, parts)
        # main's survivors go back first: a push could compact a log and move its entries
        for queue, slots, end, gone in ((_PROBATION, prob, prob_end, ev_p),
                                        (_PROTECTED, prot, prot_end, ev_r)):
            if len(slots):
                self._leave(queue, slots)
                self._keep_at_head(queue, end, slots[~gone])
                self._sizes[queue] += int(np.count_nonzero(~gone))
        self._logs[_WINDOW].advance(cand_end)
        self._leave(_WINDOW, cand)
        self._push(_PROBATION, cand[~ev_c])
        return self._t.remove_slots(pool[evict])

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"window_share": self.window_share, "protected_share": self.protected_share,
                "climb": self.climb, "step": self.step, "sample_factor": self.sample_factor,
                "sketch_factor": self.sketch_factor,
                "hold_new": self.hold_new,
                "seed": self.seed}
