"""Listeners told of every write to any store in this process (the torch pipeline's log).

A row staged ahead of its step goes stale when anything writes it in between: a module's
backward, and equally a trainer's own `update`, `apply_gradients`, `bulk_load` or `delete`.
The store tells the listeners from the one place every write passes (`_before_write`),
under the store's lock, so a reader that takes the lock after a listener counted a write
sees that write's rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["WriteHook", "add", "notify", "remove"]

WriteHook = Callable[[Any, str, np.ndarray], None]
_hooks: tuple[WriteHook, ...] = ()
_lock = threading.Lock()


def add(hook: WriteHook) -> None:
    """Call `hook(store, table, distinct ids)` on each write, the store's lock held.

    The hook must be quick, must not call the store, and must copy `ids` to keep them.
    """
    global _hooks
    with _lock:
        _hooks = (*_hooks, hook)


def remove(hook: WriteHook) -> None:
    """Stop calling `hook` (no error if it was not added)."""
    global _hooks
    with _lock:
        _hooks = tuple(h for h in _hooks if h is not hook)


def notify(store: Any, table: str, ids: np.ndarray) -> None:
    """Tell every listener that `store` is writing the distinct `ids` of `table`."""
    for hook in _hooks:  # a tuple replaced whole: no lock needed to read it
        hook(store, table, ids)
