"""Least-recently-used eviction over a lazy recency log."""

from __future__ import annotations

from typing import ClassVar, final

from ._recency import RecencyEviction

__all__ = ["LRUEviction"]


@final
class LRUEviction(RecencyEviction):
    """Evict the ids whose last access or insert is oldest.

    Recency is the order of calls; ids touched in the same call leave in the order of their
    first occurrence in it. Costs O(batch) per call amortised (see `RecencyEviction`).

    Args:
        seed: kept for the common interface; LRU uses no randomness.
    """

    name: ClassVar[str] = "lru"
