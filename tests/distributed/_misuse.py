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


def open_refused_on_one_rank(rank: int, world: int, tmp: str) -> list[str]:
    """Input that only rank 1 gets wrong makes every rank raise at once (none waits for the
    group's timeout), and the same ranks then open the store.
    """
    good = Plan(world, {"a": Placement("row", (0, 1)), "b": Placement("table", (1,))})
    other = Plan(3, {"a": Placement("row", (0, 1)), "b": Placement("table", (2,))})
    out = []
    for call in (lambda: ed.open(None, tables=specs(), plan=other if rank == 1 else good,
                                 timeout_s=20),
                 lambda: ed.open(None, tables=specs(), timeout_s=20, record_accesses=tmp,
                                 record_sample=2.0 if rank == 1 else 1.0),
                 lambda: ed.open(None if rank == 1 else tmp, tables=specs(), timeout_s=20)):
        out.append(outcome(call))
    with ed.open(tmp, tables=specs(), plan=good, timeout_s=20) as store:
        out.append(str(store.num_rows("a")))
    return out


def checkpointed(rank: int, world: int, path: str, ckpt: str) -> None:
    """A store on disk with rows on both ranks, checkpointed and closed."""
    plan = Plan(world, {"a": Placement("row", (0, 1)),
                        "b": Placement("column", (0, 1), columns=(0, 3, 6))})
    with ed.open(path, tables=specs(), plan=plan, timeout_s=20) as store:
        store.apply_gradients("a", np.arange(20), np.ones((20, 4), np.float32))
        store.apply_gradients("b", np.arange(20), np.ones((20, 6), np.float32))
        store.checkpoint(ckpt, step=1)


def damaged(rank: int, world: int, tmp: str) -> list[str]:
    """Restores of damaged or mismatched checkpoints, into an existing directory, and a
    reopen of a store missing a rank's shards: refused on every rank.
    """
    out = [outcome(lambda n=name: ed.restore(f"{tmp}/{n}", f"{tmp}/out-{n}", timeout_s=20))
           for name in ("no-rank1", "bad-json", "other-columns")]
    out.append(outcome(lambda: ed.restore(f"{tmp}/ckpt", f"{tmp}/store", timeout_s=20)))
    out.append(outcome(lambda: ed.open(f"{tmp}/store", timeout_s=20)))
    return out


def checkpoint_fails_on_one_rank(rank: int, world: int, tmp: str) -> list[str]:
    """Rank 1's shards cannot be written (its disk fails): every rank raises at once, the
    checkpoint is left incomplete, and the next one is taken on every rank.
    """
    import os

    with ed.open(None, tables=specs(), timeout_s=20) as store:
        store.update("a", np.arange(4), np.ones((4, 4), np.float32))
        if rank == 1:
            def fail(*args: Any, **kwargs: Any) -> None:
                raise embstore.errors.StorageIOError("No space left on device")
            store.local.checkpoint = fail  # type: ignore[method-assign]
        out = [outcome(lambda: store.checkpoint(f"{tmp}/c1", step=1))]
        if rank == 1:
            del store.local.checkpoint
        out.append(outcome(lambda: store.checkpoint(f"{tmp}/c2", step=2)))
        out.append(str(sorted(os.listdir(f"{tmp}/c2"))))
    return out


def owner_read_fails(rank: int, world: int) -> list[Any]:
    """Rank 1 (the owner) fails to read the rows rank 0 asked for: rank 0 gets no rows (it
    took the bytes of rank 1's next call for rows) and the next lookups work on both.
    """
    plan = Plan(world, {"a": Placement("table", (1,)), "b": Placement("table", (1,))})
    with ed.open(None, tables=specs(), plan=plan, timeout_s=20) as store:
        store.update("a", np.arange(3), np.full((3, 4), 7, np.float32))
        if rank == 1:
            def fail(*args: Any, **kwargs: Any) -> None:
                del store.local.lookup
                raise embstore.errors.StorageIOError("read error")
            store.local.lookup = fail  # type: ignore[method-assign]
        out: list[Any] = [outcome(lambda: store.lookup(
            "a", np.arange(3) if rank == 0 else np.arange(0)))]
        out += [store.lookup("a", np.arange(3)).tolist() for _ in range(2)]
    return out
