"""What each rank runs in test_misuse.py (module-level, so spawned processes find it)."""

from __future__ import annotations

import errno
import json
import os
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
                 lambda: store.num_rows("a"),
                 store.flush,
                 store.stats):
        out.append(outcome(call))
    return out


def closed_on_one_rank(rank: int, world: int) -> list[Any]:
    """Rank 1 closed its shards (its `with` block failed): flush and stats raise
    StoreClosedError there and PeerFailedError on rank 0, at once (rank 0 is not left
    waiting for rank 1's next call), and both ranks then open a store together.
    """
    store = ed.open(None, tables=specs(), timeout_s=5)
    if rank == 1:
        store.local.close()
    out: list[Any] = [outcome(store.flush), outcome(store.stats)]
    store.local.close()
    with ed.open(None, tables=specs(), timeout_s=5) as again:
        out.append(again.num_rows("a"))
    return out


def _no_space(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def checkpoint_numpy_step_and_failed_record(rank: int, world: int, tmp: str) -> list[Any]:
    """A numpy step is recorded as an int; a record rank 0 cannot write fails every rank at
    once and leaves nothing, so the same checkpoint is taken next.
    """
    import embstore.distributed._checkpoint as ck

    with ed.open(None, tables=specs(), timeout_s=5) as store:
        store.update("a", np.arange(4), np.ones((4, 4), np.float32))
        out: list[Any] = [outcome(lambda: store.checkpoint(f"{tmp}/c1", step=np.int64(3)))]
        real = ck.write_atomic
        if rank == 0:
            ck.write_atomic = _no_space  # type: ignore[assignment]
        out.append(outcome(lambda: store.checkpoint(f"{tmp}/c2", step=4)))
        ck.write_atomic = real
        out.append(os.path.exists(f"{tmp}/c2"))
        out.append(outcome(lambda: store.checkpoint(f"{tmp}/c2", step=4)))
    with open(f"{tmp}/c1/sharded.json") as f:
        out.append(json.load(f)["step"])
    return out


def checkpoint_bad_step_leaves_nothing(rank: int, world: int, tmp: str) -> list[Any]:
    """A refused step is refused on every rank before anything is made: the retry works."""
    with ed.open(None, tables=specs(), timeout_s=5) as store:
        out: list[Any] = [outcome(lambda: store.checkpoint(f"{tmp}/c", step=-1)),
                          outcome(lambda: store.checkpoint(f"{tmp}/c", step="1")),
                          os.path.exists(f"{tmp}/c"),
                          outcome(lambda: store.checkpoint(f"{tmp}/c", step=1))]
    return out


def open_fails_to_make_or_publish(rank: int, world: int, tmp: str) -> list[Any]:
    """A path under a file, and a record rank 0 cannot write: StorageIOError there,
    PeerFailedError on rank 1, at once; nothing is left, and the store then opens.
    """
    import embstore.distributed._open as eo

    out: list[Any] = [outcome(lambda: ed.open(f"{tmp}/file/s", tables=specs(), timeout_s=5))]
    real = eo.write_atomic
    if rank == 0:
        eo.write_atomic = _no_space  # type: ignore[assignment]
    out.append(outcome(lambda: ed.open(f"{tmp}/new/s", tables=specs(), timeout_s=5)))
    eo.write_atomic = real
    out.append(os.path.exists(f"{tmp}/new"))
    with ed.open(f"{tmp}/new/s", tables=specs(), timeout_s=5) as store:
        out.append(store.num_rows("a"))
    return out


def restore_fails_then_retried(rank: int, world: int, tmp: str) -> list[Any]:
    """Rank 1 cannot write its rows of a restore: every rank raises at once, nothing is left
    at the path, and the same restore then works.
    """
    import embstore.distributed._restore as eo

    with ed.open(None, tables=specs(), timeout_s=5) as store:
        store.update("a", np.arange(20), np.ones((20, 4), np.float32))
        store.checkpoint(f"{tmp}/ckpt", step=1)
    real = eo._write_mine
    if rank == 1:
        def fail(*args: Any, **kwargs: Any) -> None:
            raise embstore.errors.StorageIOError(errno.EIO, "write error")
        eo._write_mine = fail
    out: list[Any] = [outcome(lambda: ed.restore(f"{tmp}/ckpt", f"{tmp}/new/r", timeout_s=5))]
    eo._write_mine = real
    out.append(os.path.exists(f"{tmp}/new"))
    with ed.restore(f"{tmp}/ckpt", f"{tmp}/new/r", timeout_s=5) as restored:
        out.append(restored.num_rows("a"))
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


def policies_that_drop_rows(rank: int, world: int, tmp: str) -> list[Any]:
    """A store of record that may drop rows (admission, eviction, a capacity) is refused on
    every rank before anything is made, wherever its chain comes from; a bounded cache above
    an unbounded store of record opens.
    """
    u = embstore.init.Uniform
    T = embstore.TierSpec
    plan = Plan(world, {"a": Placement("row", (0, 1)), "b": Placement("table", (1,))})
    cached = (T("dram", capacity=4, eviction="lru"), T("rocksdb"))
    own = [specs()[0], embstore.TableSpec("b", 6, init=u(seed=2), tiers=(T("dram"), T(
        "dram", eviction="lru")))]
    on_rank_1 = Plan(world, plan.tables, tiers={1: {"b": (T("dram", capacity=8),)}})
    out: list[Any] = []
    for n, (tables, tiers, given) in enumerate([
            (specs(), [T("dram", admission="probability", admission_options={"p": 0.5})], plan),
            (specs(), [T("dram", capacity=8)], plan),
            (own, None, plan),
            (specs(), None, on_rank_1)]):
        try:
            ed.open(f"{tmp}/{n}", tables=tables, tiers=tiers, plan=given, timeout_s=20)
            out.append("opened")
        except embstore.errors.ConfigError as exc:
            out.append("its own shard" in str(exc) and not os.path.exists(f"{tmp}/{n}"))
    with ed.open(f"{tmp}/ok", tables=specs(), tiers=list(cached), plan=plan,
                 timeout_s=20) as store:
        store.update("a", np.arange(10) + 10 * rank, np.ones((10, 4), np.float32))
        out.append(store.num_rows("a"))
    return out


def group_and_timeout(rank: int, world: int) -> list[Any]:
    """timeout_s with group= is refused on every rank (the group keeps its own), and a rank
    that stops calling fails the others after the group's timeout, which the error names.
    """
    from datetime import timedelta

    import torch.distributed as dist

    out: list[Any] = []
    for mine in (3.0, 3.0 if rank == 0 else None):
        out.append(outcome(lambda mine=mine: ed.open(None, tables=specs(), group=dist.group.WORLD,
                                                     timeout_s=mine)))
    # 6 s: the open's own collectives run on this group too, and a loaded machine may hold
    # one rank back for seconds before it gets there
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=6))
    store = ed.open(None, tables=specs(), group=group)
    if rank == 1:
        time.sleep(9)  # makes no call: rank 0's lookup waits for the group's 6 s
    else:
        try:
            store.lookup("a", np.arange(3))
        except embstore.errors.PeerFailedError as exc:
            out.append("within 6 s" in str(exc))
    store.local.close()
    return out


def _error(call: Callable[[], Any]) -> str:
    try:
        call()
    except embstore.errors.EmbstoreError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def many_calls_checked_as_one_store(rank: int, world: int) -> list[Any]:
    """Calls of several tables that one store refuses (requests not a mapping, not pairs of
    (ids, values)) are refused with its error on the rank that makes them, changing nothing;
    a table named as the placeholder of a rank without shards is refused on every rank.
    """
    ids, rows = np.arange(3), np.ones((3, 4), np.float32)
    calls = [lambda s: s.lookup_many(["a"]),
             lambda s: s.update_many({"a": ids}),
             lambda s: s.update_many({"a": (ids, rows, 1)}),
             lambda s: s.apply_gradients_many({"a": (ids, rows, 1)}),
             lambda s: s.apply_gradients_many({"a": ids})]
    good = [lambda s: s.lookup_many({"a": ids}),
            lambda s: s.update_many({"a": (ids, rows)}),
            lambda s: s.update_many({"a": (ids, rows)}),
            lambda s: s.apply_gradients_many({"a": (ids, rows)}),
            lambda s: s.apply_gradients_many({"a": (ids, rows)})]
    one = embstore.open(None, tables=specs())
    out: list[Any] = []
    with ed.open(None, tables=specs(), timeout_s=20) as store:
        for bad, fine in zip(calls, good, strict=True):
            got = _error(lambda bad=bad, fine=fine: (bad if rank == 1 else fine)(store))
            out.append(got == _error(lambda bad=bad: bad(one)) if rank == 1
                       else got.split(":")[0])
        out.append(store.num_rows("a"))
    plan = Plan(world, {"_no_shards": Placement("table", (1,))})
    out.append(outcome(lambda: ed.open(None, tables=[embstore.TableSpec("_no_shards", 4)],
                                       plan=plan, timeout_s=20)))
    return out


def checkpointed(rank: int, world: int, path: str, ckpt: str) -> None:
    """A store on disk with rows on both ranks, checkpointed and closed."""
    plan = Plan(world, {"a": Placement("row", (0, 1)),
                        "b": Placement("column", (0, 1), columns=(0, 3, 6))})
    with ed.open(path, tables=specs(), plan=plan, timeout_s=20) as store:
        store.apply_gradients("a", np.arange(20), np.ones((20, 4), np.float32))
        store.apply_gradients("b", np.arange(20), np.ones((20, 6), np.float32))
        store.checkpoint(ckpt, step=1)


def damaged(rank: int, world: int, tmp: str, names: list[str]) -> list[str]:
    """Restores of damaged or mismatched checkpoints `names`, into an existing directory,
    and a reopen of a store missing a rank's shards: refused on every rank.
    """
    out = [outcome(lambda n=name: ed.restore(f"{tmp}/{n}", f"{tmp}/out-{n}", timeout_s=20))
           for name in names]
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


def owner_read_fails(rank: int, world: int, error: str) -> list[Any]:
    """Rank 1 (the owner) fails to read the rows rank 0 asked for, with an embstore error or
    (`error` "raw") a KeyError: it still sends its failure, so rank 0 raises PeerFailedError
    at once rather than take the bytes of rank 1's next call for rows, and the next lookups
    work on both.
    """
    plan = Plan(world, {"a": Placement("table", (1,)), "b": Placement("table", (1,))})
    with ed.open(None, tables=specs(), plan=plan, timeout_s=20) as store:
        store.update("a", np.arange(3), np.full((3, 4), 7, np.float32))
        if rank == 1:
            def fail(*args: Any, **kwargs: Any) -> None:
                del store.local.lookup
                raise (KeyError("raw") if error == "raw"
                       else embstore.errors.StorageIOError("read error"))
            store.local.lookup = fail  # type: ignore[method-assign]
        start = time.monotonic()
        try:
            store.lookup("a", np.arange(3) if rank == 0 else np.arange(0))
            got = "ok"
        except Exception as exc:  # the raw KeyError too: its name is the outcome
            got = type(exc).__name__
        out: list[Any] = ["slow" if time.monotonic() - start > 4 else got]
        out += [store.lookup("a", np.arange(3)).tolist() for _ in range(2)]
    return out


def record_gone(rank: int, world: int, tmp: str) -> list[str]:
    """Reopens of a store whose record (sharded.json) is removed, a dangling link, or
    damaged past what JSON parsers take: each is refused, and nothing is made there.
    """
    out = []
    for name in ("removed", "dangling", "deep", "huge-world"):
        out.append(outcome(lambda n=name: ed.open(f"{tmp}/{n}", tables=specs(),
                                                  timeout_s=20)))
    return out


def lost_rows_on_one_rank(rank: int, world: int, tmp: str) -> list[Any]:
    """Rank 0's medium loses rows its written-id record holds: num_rows raises
    CorruptStoreError there and PeerFailedError on rank 1, at once.
    """
    plan = Plan(world, {"a": Placement("row", tuple(range(world))),
                        "b": Placement("row", tuple(range(world)))})
    with ed.open(f"{tmp}/s", tables=specs(), tiers=[embstore.TierSpec("lmdb")], plan=plan,
                 timeout_s=20) as store:
        store.update("a", np.arange(40), np.ones((40, 4), np.float32))
        store.flush()
        out: list[Any] = [store.num_rows("a")]
        if rank == 0:  # behind the record, as a damaged medium would
            bottom = store.local._table("a").chain.tiers[-1].backend
            bottom.delete(bottom.ids()[:2])
        out.append(outcome(lambda: store.num_rows("a")))
        out.append(store.num_rows("b"))  # the group goes on
    return out


def ranks_disagree(rank: int, world: int, tmp: str) -> list[Any]:
    """Ranks given other paths or steps for one checkpoint or restore, or a path that is no
    path: refused on every rank at once (each rank's shards would go elsewhere, or a restore
    would mix two checkpoints), and nothing made.
    """
    with ed.open(None, tables=specs(), timeout_s=5) as store:
        store.update("a", np.arange(20), np.ones((20, 4), np.float32))
        out: list[Any] = [outcome(lambda: store.checkpoint(f"{tmp}/c{rank}", step=1)),
                          outcome(lambda: store.checkpoint(f"{tmp}/c", step=rank))]
        store.checkpoint(f"{tmp}/c", step=1)
        store.update("a", np.arange(20), np.zeros((20, 4), np.float32))
        store.checkpoint(f"{tmp}/d", step=2)
    for src, dest in ((f"{tmp}/{'cd'[rank]}", f"{tmp}/r"), (f"{tmp}/c", f"{tmp}/r{rank}"),
                      (f"{tmp}/c", 5 if rank else f"{tmp}/r"), (f"{tmp}/c", f"{tmp}/r\0"),
                      (None if rank else f"{tmp}/c", f"{tmp}/r")):
        out.append(outcome(lambda s=src, d=dest: ed.restore(s, d, timeout_s=5)))
    out.append(sorted(os.listdir(tmp)))
    return out
