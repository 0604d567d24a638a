"""What each rank runs in test_misuse.py (module-level, so spawned processes find it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

import embstore
import embstore.distributed as ed
from embstore import optim
from embstore.distributed import Placement, Plan


def specs() -> list[embstore.TableSpec]:
    """Two small tables."""
    u = embstore.init.Uniform
    return [embstore.TableSpec("a", 4, init=u(seed=1), optimizer=optim.Adagrad(0.1)),
            embstore.TableSpec("b", 6, init=u(seed=2), optimizer=optim.RowWiseAdagrad(0.1))]


def outcome(call: Callable[[], Any]) -> str:
    """The call's error class, 'ok' or 'slow' (an error that took the group's timeout)."""
    start = time.monotonic()
    try:
        call()
        out = "ok"
    except embstore.errors.EmbstoreError as exc:
        out = type(exc).__name__
    return "slow" if time.monotonic() - start > 4 else out


def mismatched_small_calls(rank: int, world: int) -> list[Any]:
    """Calls without rows (num_rows, flush) that differ between ranks are refused on every
    rank, and a table one rank does not know is its own error and the others' at once.
    """
    out: list[Any] = []
    with ed.open(None, tables=specs(), timeout_s=20) as store:
        store.update("a", np.arange(6), np.ones((6, 4), np.float32))
        out.append(outcome(lambda: store.flush() if rank == 0 else store.num_rows("a")))
        out.append(outcome(lambda: store.num_rows("a" if rank == 0 else "b")))
        out.append(outcome(lambda: store.num_rows("a" if rank == 0 else "nope")))
        out.append(store.num_rows("a"))
    return out


def after_close_and_empty(rank: int, world: int) -> list[Any]:
    """Calls on a closed store (rank 1 owns the tables) raise StoreClosedError on every rank,
    and a call of no tables returns nothing.
    """
    plan = Plan(world, {"a": Placement("table", (1,)), "b": Placement("table", (1,))})
    store = ed.open(None, tables=specs(), plan=plan, timeout_s=20)
    out: list[Any] = [store.lookup_many({}), store.lookup_many({}, state=True)]
    store.close()
    for call in (lambda: store.lookup("a", np.arange(3)),
                 lambda: store.lookup_state("b", np.arange(3)),
                 lambda: store.update("a", np.arange(1), np.ones((1, 4), np.float32)),
                 lambda: store.apply_gradients("b", np.arange(1), np.ones((1, 6), np.float32)),
                 lambda: store.delete("a", np.arange(3)),
                 lambda: store.num_rows("a")):
        out.append(outcome(call))
    return out
