"""Time-to-live eviction: feature expiry for a bottom tier, LRU order under pressure."""

from __future__ import annotations

from typing import Any, ClassVar, final

import numpy as np

from embstore.errors import ConfigError
from embstore.policy import real_setting

from ._recency import RecencyEviction

__all__ = ["TTLEviction"]


@final
class TTLEviction(RecencyEviction):
    """Expire ids not touched for `ttl` time units; under pressure evict the stalest first.

    `expired(now)` returns (and untracks) every id whose last access or insert happened at a
    time <= now - ttl. `now` must never decrease (it is the tier's logical clock).

    Args:
        ttl: idle time after which an id expires, in the units of `now`; finite and > 0.
        seed: kept for the common interface; TTL uses no randomness.

    Raises:
        ConfigError: `ttl` is not a finite positive number.
    """

    name: ClassVar[str] = "ttl"

    def __init__(self, *, ttl: float = 1000.0, seed: int = 0) -> None:
        try:
            ttl = real_setting("TTLEviction", "ttl", ttl, 0, low_open=True)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; pass the idle time after which an id expires, in units "
                              "of `now`") from None
        super().__init__(seed=seed)
        self.ttl = float(ttl)

    def expired(self, now: float) -> np.ndarray:
        # docstring inherited
        return self._expire_before(now - self.ttl)

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"ttl": self.ttl, "seed": self.seed}
