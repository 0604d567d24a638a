"""Time-to-live eviction: feature expiry for a bottom tier, LRU order under pressure."""

from __future__ import annotations

from typing import Any, ClassVar, final

import numpy as np

from embstore.errors import ConfigError

from ._recency import RecencyEviction

__all__ = ["TTLEviction"]


@final
class TTLEviction(RecencyEviction):
    """Expire ids not touched for `ttl` time units; under pressure evict the stalest first.

    `expired(now)` returns (and untracks) every id whose last access or insert happened at a
    time <= now - ttl. `now` must never decrease (it is the tier's logical clock).

    Args:
        ttl: idle time after which an id expires, in the units of `now`; must be > 0.
        seed: kept for the common interface; TTL uses no randomness.

    Raises:
        ConfigError: `ttl` is not positive.
    """

    name: ClassVar[str] = "ttl"

    def __init__(self, *, ttl: float = 1000.0, seed: int = 0) -> None:
        if not ttl > 0:
            raise ConfigError(f"TTLEviction ttl must be > 0, got {ttl!r}; pass the idle time "
                             "after which an id expires, in units of `now`")
        super().__init__(seed=seed)
        self.ttl = float(ttl)

    def expired(self, now: float) -> np.ndarray:
        # docstring inherited
        return self._expire_before(now - self.ttl)

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"ttl": self.ttl, "seed": self.seed}
