"""Least-frequently-used eviction with aging."""

from __future__ import annotations

import math
from typing import Any, ClassVar, final

import numpy as np

from embstore.errors import ConfigError
from embstore.policy import real_setting, whole_setting

from ._hashing import positions
from ._tracked import Tracked, TrackedEviction, count_accesses, smallest

__all__ = ["LFUEviction"]

_HISTORY_ROWS = 4
# Shortest aging period. `now` is the tier's batch counter (an int64), so now / period stays
# below 2**63 * 1e6 ~ 9e24, far from float's overflow (1.8e308) that math.floor could not
# take (5e-324 overflowed on the first call). A shorter period would only zero every count
# at each call anyway: 0.5 ** 1e6 is 0.0.
_MIN_AGING_PERIOD = 1e-6


@final
class LFUEviction(TrackedEviction):
    """Evict the ids with the fewest accesses; counts age so that old popularity fades.

    Each tracked id has a count: 1 on insert, +1 per access (duplicates in a batch count).
    Every `aging_period` units of `now` all counts are multiplied by `aging_factor` (0.5
    halves them, as in TinyLFU's reset; a factor near 1 is a slow exponential decay).
    Victims are the smallest counts, ties going to the least recently used, then the lowest
    id. A choice costs one O(tracked) partition: LFU order changes on every access, and a
    heap or bucket list per id would mean Python objects or per-id loops.

    Plain LFU forgets an id's count when it is evicted, so a popular id that was pushed out
    once comes back at count 1 and is the next victim. With `history_width` set, a count-min
    sketch (4 rows of that many counters, aged with the counts) remembers the counts of
    evicted ids (cell-wise max) and the reads of untracked ids passed to `record_access`
    (added), and an inserted id starts from its remembered count: LFU over all ids seen,
    not only over the resident ones. The default, 2**18 counters per row, costs 4 MiB.

    Args:
        aging_period: time between agings, in units of `now`, at least 1e-6; None disables
            aging.
        aging_factor: multiplier applied to every count each period, in (0, 1].
        history_width: counters per row of the evicted-count sketch, a power of two; None
            keeps no history (plain in-cache LFU).
        seed: seeds the history sketch's hashes.

    Raises:
        ConfigError: a setting is out of range.
    """

    name: ClassVar[str] = "lfu"

    def __init__(self, *, aging_period: float | None = 1000.0, aging_factor: float = 0.5,
                 history_width: int | None = 1 << 18, seed: int = 0) -> None:
        if aging_period is not None:
            try:
                aging_period = real_setting("LFUEviction", "aging_period", aging_period,
                                            _MIN_AGING_PERIOD)
            except ConfigError as exc:  # name the way to turn aging off, too
                raise ConfigError(f"{exc}; None disables aging") from None
        aging_factor = real_setting("LFUEviction", "aging_factor", aging_factor, 0, 1,
                                    low_open=True)
        if history_width is not None:
            history_width = whole_setting("LFUEviction", "history_width", history_width, 1,
                                          2**32)
        if history_width is not None and history_width & (history_width - 1):
            raise ConfigError("LFUEviction history_width must be a power of two or None, got "
                             f"{history_width!r}")
        super().__init__(seed=seed)
        self.history_width = None if history_width is None else int(history_width)
        self._history = (None if history_width is None
                         else np.zeros((_HISTORY_ROWS, history_width), dtype=np.float32))
        self.aging_period = None if aging_period is None else float(aging_period)
        self.aging_factor = float(aging_factor)
        self._t = Tracked({"count": (np.float64, 0.0), "seen": (np.int64, 0)})
        self._epoch: int | None = None  # index of the aging period of the last call
        self._calls = 0

    def _age(self, now: float) -> None:
        if self.aging_period is None:
            return
        epoch = math.floor(now / self.aging_period)
        if self._epoch is not None and epoch > self._epoch:
            hw = self._t.index.high_water
            scale = self.aging_factor ** (epoch - self._epoch)
            self._t.cols["count"][:hw] *= scale
            if self._history is not None:
                self._history *= scale
        self._epoch = epoch if self._epoch is None else max(epoch, self._epoch)

    def _advance(self, now: float) -> None:
        self._age(now)

    def _record_access(self, ids: np.ndarray, now: float) -> None:
        if self._history is not None:
            # with history, reads of untracked ids count too: they are remembered for when
            # the id is inserted (the interface lets a policy learn from them, not track them)
            found = self._t.index.find(ids)
            absent, counts = np.unique(ids[found < 0], return_counts=True)
            if len(absent):
                flat, _ = self._history_cells(absent)
                np.add.at(self._history.reshape(-1), flat.ravel(),
                          np.tile(counts.astype(np.float32), _HISTORY_ROWS))
            slots = self._t.live_slots(found[found >= 0])
        else:
            slots = self._t.find(ids)
        if len(slots):
            self._access(slots, now)

    def record_access_slots(self, slots: np.ndarray, now: float) -> None:
        # docstring inherited
        self._age(now)
        super().record_access_slots(slots, now)

    def _access(self, slots: np.ndarray, now: float) -> None:
        self._calls += 1
        count_accesses(self._t.cols["count"], self._t.cols["seen"], self._calls, slots)

    def _record_insert(self, ids: np.ndarray, now: float) -> None:
        self._calls += 1
        slots = self._t.insert(ids)
        self._t.cols["count"][slots] = 1.0
        if self._history is not None:
            self._t.cols["count"][slots] += self._history_cells(ids)[1].min(axis=0)
        self._t.cols["seen"][slots] = self._calls

    def _choose_victims(self, n: int, now: float) -> np.ndarray:
        live = np.flatnonzero(self._t.alive[: self._t.index.high_water])
        chosen = smallest(live, self._t.cols["count"], self._t.cols["seen"], self._t.ids, n)
        if self._history is not None:
            # remember the victims' counts; max keeps each cell an upper bound of its ids
            flat, _ = self._history_cells(self._t.ids[chosen])
            np.maximum.at(self._history.reshape(-1), flat.ravel(),
                          np.tile(self._t.cols["count"][chosen].astype(np.float32),
                                  _HISTORY_ROWS))
        return self._t.remove_slots(chosen)

    def _history_cells(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat sketch indices (int64[rows, N]) of `ids` and the values stored there."""
        assert self._history is not None and self.history_width is not None
        pos = positions(ids, self.seed, _HISTORY_ROWS, self.history_width.bit_length() - 1)
        flat = pos + (np.arange(_HISTORY_ROWS, dtype=np.int64) * self.history_width)[:, None]
        return flat, self._history.reshape(-1)[flat]

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"aging_period": self.aging_period, "aging_factor": self.aging_factor,
                "history_width": self.history_width, "seed": self.seed}
