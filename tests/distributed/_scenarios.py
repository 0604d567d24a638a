"""What each rank runs in the distributed tests (module-level, so spawned processes find it).

Every rank builds the same inputs for every rank from seeds, so each one can also feed a
single-process store the ranks' inputs concatenated in rank order and compare bit for bit.
"""

from __future__ import annotations

import os
import time

import numpy as np

import embstore
import embstore.distributed as ed
from embstore import optim
from embstore.distributed import Placement, Plan

ID_RANGE = 40


def specs() -> list[embstore.TableSpec]:
    """Tables covering the optimizers, with hashed initial values that differ per column."""
    u = embstore.init.Uniform
    return [
        embstore.TableSpec("t_sgd", 5, init=u(seed=1), optimizer=optim.SGD(0.1, weight_decay=0.01)),
        embstore.TableSpec("r_adagrad", 4, init=u(seed=2), optimizer=optim.Adagrad(0.1)),
        embstore.TableSpec("r_adam", 3, init=u(seed=3), optimizer=optim.Adam(0.01)),
        embstore.TableSpec("c_rowwise", 7, init=u(seed=4),
                           optimizer=optim.RowWiseAdagrad(0.1, weight_decay=0.05)),
        embstore.TableSpec("c_adam", 6, init=embstore.init.Normal(seed=5),
                           optimizer=optim.AdamW(0.01)),
        embstore.TableSpec("r_rowwise", 8, init=u(seed=6),
                           optimizer=optim.RowWiseAdagrad(0.1, weight_decay=0.01,
                                                          weight_decay_mode="decoupled")),
    ]


def plan_a(world: int) -> Plan:
    """One plan using every kind of sharding."""
    last = world - 1
    return Plan(world, {
        "t_sgd": Placement("table", (last,)),
        "r_adagrad": Placement("row", tuple(range(world))),
        "r_adam": Placement("row", tuple(range(world))[::-1], "range",
                            tuple(int(b) for b in np.linspace(0, ID_RANGE, world + 1)[1:-1])),
        "c_rowwise": Placement("column", tuple(range(world)),
                               columns={1: (0, 7), 2: (0, 3, 7), 4: (0, 1, 4, 6, 7)}[world]),
        "c_adam": Placement("column", (last, 0), columns=(0, 2, 6)),
        "r_rowwise": Placement("row", (0, last), "hash"),
    })


def plan_b(world: int) -> Plan:
    """Another plan for the same tables (for resharding)."""
    return Plan(world, {
        "t_sgd": Placement("row", tuple(range(world))),
        "r_adagrad": Placement("column", tuple(range(world)), columns=_even(4, world)),
        "r_adam": Placement("table", (0,)),
        "c_rowwise": Placement("row", tuple(range(world))[::-1]),
        "c_adam": Placement("table", (world - 1,)),
        "r_rowwise": Placement("column", (0,), columns=(0, 8)),
    })


def _even(dim: int, world: int) -> tuple[int, ...]:
    return tuple(int(x) for x in np.linspace(0, dim, world + 1).round())


def inputs(step: int, rank: int, spec: embstore.TableSpec) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s ids (with duplicates, some across ranks) and gradients at `step`."""
    rng = np.random.default_rng([step, rank, spec.dim, len(spec.name)])
    n = int(rng.integers(0, 30))
    ids = rng.integers(0, ID_RANGE, n).astype(np.int64)
    return ids, rng.standard_normal((n, spec.dim)).astype(spec.dtype)


def reference(world: int, steps: int, store: embstore.EmbeddingStore | None = None
              ) -> embstore.EmbeddingStore:
    """A single-process store fed the ranks' inputs concatenated in rank order."""
    ref = store or embstore.open(None, tables=specs())
    for step in range(steps):
        _step_ref(ref, world, step)
    return ref


def _step_ref(ref: embstore.EmbeddingStore, world: int, step: int) -> None:
    for spec in specs():
        parts = [inputs(step, r, spec) for r in range(world)]
        ids = np.concatenate([p[0] for p in parts])
        grads = np.concatenate([p[1] for p in parts])
        if step == 1:
            ref.update(spec.name, ids, grads * spec.dtype.type(0.01))
        else:
            ref.apply_gradients(spec.name, ids, grads)


def _step_sharded(store: ed.ShardedStore, rank: int, step: int) -> None:
    mine = {s.name: inputs(step, rank, s) for s in specs()}
    if step == 1:
        store.update_many({t: (i, g * g.dtype.type(0.01)) for t, (i, g) in mine.items()})
    else:
        store.apply_gradients_many(mine)


def compare(store: ed.ShardedStore, ref: embstore.EmbeddingStore, rank: int) -> list[str]:
    """Tables whose weights, state or row counts differ in any bit (empty: identical)."""
    bad = []
    everything = np.arange(ID_RANGE, dtype=np.int64)
    # each rank asks for a different order of its own ids, duplicates included
    asked = np.random.default_rng(rank).permutation(np.concatenate([everything, everything[:5]]))
    for spec in specs():
        w = store.lookup(spec.name, asked)
        s = store.lookup_state(spec.name, asked)
        if not np.array_equal(w.view(np.uint8), np.ascontiguousarray(
                ref.lookup(spec.name, asked)).view(np.uint8)):
            bad.append(f"{spec.name} weights")
        if not np.array_equal(s.view(np.uint8), np.ascontiguousarray(
                ref.lookup_state(spec.name, asked)).view(np.uint8)):
            bad.append(f"{spec.name} state")
        if store.num_rows(spec.name) != ref.num_rows(spec.name):
            bad.append(f"{spec.name} rows {store.num_rows(spec.name)} != "
                       f"{ref.num_rows(spec.name)}")
    return bad


def train_and_compare(rank: int, world: int, plan_name: str, steps: int) -> dict:
    """Train with a plan, checking every lookup and the final tables against the reference."""
    plan = {"a": plan_a, "b": plan_b}[plan_name](world)
    ref = embstore.open(None, tables=specs())
    bad: list[str] = []
    with ed.open(None, tables=specs(), plan=plan, timeout_s=60) as store:
        for step in range(steps):
            # the rows this rank sees before the step equal the reference's, in its order
            for spec in specs():
                parts = [inputs(step, r, spec)[0] for r in range(world)]
                got = store.lookup(spec.name, parts[rank])
                want = ref.lookup(spec.name, parts[rank])
                if not np.array_equal(got, want):
                    bad.append(f"step {step} {spec.name} lookup")
            _step_sharded(store, rank, step)
            _step_ref(ref, world, step)
        bad += compare(store, ref, rank)
        removed = store.delete("r_adagrad", np.arange(rank, ID_RANGE, 7))
        want = ref.delete("r_adagrad", np.concatenate([np.arange(r, ID_RANGE, 7)
                                                       for r in range(world)]))
        if removed != want:
            bad.append(f"delete removed {removed}, reference {want}")
        bad += compare(store, ref, rank)
        store.flush()
        stats = store.stats()
        if len(stats) != world or not all(isinstance(st, dict) and st for st in stats):
            bad.append(f"stats {stats}")
        traffic = store.traffic
    return {"bad": bad, "sent": traffic.sent, "minimum": traffic.minimum}


def train_and_compare_plans(rank: int, world: int, plans: str, steps: int) -> list[dict]:
    """`train_and_compare` with each plan in turn, in one group."""
    return [train_and_compare(rank, world, p, steps) for p in plans]


def checkpoint_run(rank: int, world: int, path: str, ckpt: str, steps: int) -> list[str]:
    """Train on disk with plan A, each rank's shards in a small DRAM cache over RocksDB,
    checkpoint, then compare with the reference.
    """
    tiers = [embstore.TierSpec("dram", capacity=10), embstore.TierSpec("rocksdb")]
    with ed.open(path, tables=specs(), tiers=tiers, plan=plan_a(world), timeout_s=60) as store:
        for step in range(steps):
            _step_sharded(store, rank, step)
        store.checkpoint(ckpt, step=steps)
        return compare(store, reference(world, steps), rank)


def restore_run(rank: int, world: int, ckpt: str, path: str, old_world: int, steps: int
                ) -> list[str]:
    """Reshard the checkpoint to this world with plan B; compare, train one more step."""
    with ed.restore(ckpt, path, plan=plan_b(world), timeout_s=60) as store:
        ref = reference(old_world, steps)
        bad = compare(store, ref, rank)
        # restored rows are written rows: a medium that loses one must not serve it as new
        for name in store.local.tables:
            record = store.local._tables[name].written
            held = [i for i, _, _ in store.local.items(name)]
            if record is None or not held:
                continue
            if not record.holds(np.concatenate(held)).all():
                bad.append(f"{name}: restored rows missing from the written-id record")
        _step_sharded(store, rank, steps)
        _step_ref(ref, world, steps)
        bad += [f"after a step: {b}" for b in compare(store, ref, rank)]
    # reopen from the directory alone: same plan, same rows
    with ed.open(path, timeout_s=60) as store:
        bad += [f"reopened: {b}" for b in compare(store, ref, rank)]
    return bad


def dies(rank: int, world: int, timeout_s: float) -> float:
    """Rank 1 dies after opening; the others' next call must fail within the timeout."""
    store = ed.open(None, tables=specs()[:1], timeout_s=timeout_s)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        store.lookup("t_sgd", np.arange(5))
    finally:
        store.local.close()
    return time.monotonic() - start


def mismatched(rank: int, world: int) -> None:
    """Ranks call with different tables: a ConfigError on every rank, no hang."""
    store = ed.open(None, tables=specs()[:2], timeout_s=20)
    table = "t_sgd" if rank == 0 else "r_adagrad"
    store.lookup(table, np.arange(3))


def modules_on(rank: int, world: int, device_type: str) -> list[str]:
    """Over the world group (NCCL: buffers staged on the GPU), modules on `device_type`
    ("cuda" or "cpu"): the same bits as one store fed the ranks' inputs in order.
    """
    import torch
    import torch.distributed as dist

    import embstore.torch as et

    tables = specs()[:2]
    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device("cpu"))
    ref = embstore.open(None, tables=tables)
    ref_ebc = et.EmbeddingBagCollection(ref, {"a": "t_sgd", "b": "r_adagrad"}).to(device)
    bad = []
    with ed.open(None, tables=tables, group=dist.group.WORLD) as store:
        ebc = et.EmbeddingBagCollection(store, {"a": "t_sgd", "b": "r_adagrad"}).to(device)
        for step in range(3):
            feats = []
            for r in range(world):
                rng = np.random.default_rng([step, r])
                lengths = rng.integers(0, 4, 5)
                feats.append({f: (torch.from_numpy(rng.integers(0, ID_RANGE, int(lengths.sum()))
                                                   ).to(device),
                                  torch.from_numpy(lengths).to(device)) for f in "ab"})
            out = ebc(feats[rank]).values()
            (out * out).sum().backward()
            whole = {f: (torch.cat([x[f][0] for x in feats]), torch.cat([x[f][1] for x in feats]))
                     for f in "ab"}
            ref_out = ref_ebc(whole).values()
            if not torch.equal(out, ref_out[5 * rank: 5 * rank + 5]):
                bad.append(f"step {step} outputs")
            # every rank's loss together: the same gradient of each position
            (ref_out * ref_out).sum().backward()
        everything = np.arange(ID_RANGE)
        for t in ("t_sgd", "r_adagrad"):
            if not np.array_equal(store.lookup(t, everything), ref.lookup(t, everything)):
                bad.append(f"{t} weights")
    return bad


def modules_with_repeats(rank: int, world: int) -> list[str]:
    """Bags whose ids repeat on every rank (sum with per-sample weights, mean and max with a
    padding id; SGD, Adagrad, row-wise Adagrad row- and column-wise): the same bits as one
    store fed the ranks' bags in order.
    """
    import torch

    import embstore.torch as et

    u = embstore.init.Uniform
    tables = [embstore.TableSpec("sgd", 4, init=u(seed=1), optimizer=optim.SGD(0.1)),
              embstore.TableSpec("ada", 4, init=u(seed=2), optimizer=optim.Adagrad(0.1)),
              embstore.TableSpec("rw", 6, init=u(seed=3), optimizer=optim.RowWiseAdagrad(0.1))]
    plan = Plan(world, {"sgd": Placement("row", tuple(range(world))),
                        "ada": Placement("row", tuple(range(world))[::-1]),
                        "rw": Placement("column", tuple(range(world)),
                                        columns=_even(6, world))})
    cases = [(t, mode) for t in ("sgd", "ada", "rw") for mode in ("sum", "mean", "max")]
    bad = []
    ref = embstore.open(None, tables=tables)
    with ed.open(None, tables=tables, plan=plan, timeout_s=30) as store:
        for table, mode in cases:
            # not both: torch pools weighted bags with a padding id by another kernel where
            # the id is in the batch, so one rank's outputs already differ in the forward
            weighted = mode == "sum"
            padding = None if weighted else 2
            mine = et.EmbeddingBag(store, table, mode=mode, padding_idx=padding)
            theirs = et.EmbeddingBag(ref, table, mode=mode, padding_idx=padding)
            for step in range(3):
                batches = []
                for r in range(world):
                    rng = np.random.default_rng([step, r, len(table)])
                    lengths = rng.integers(0, 9, 4)
                    ids = torch.from_numpy(rng.integers(0, 6, int(lengths.sum())))
                    offsets = torch.from_numpy(np.cumsum(lengths) - lengths)
                    w = torch.from_numpy(rng.random(len(ids), dtype=np.float32)) \
                        if weighted else None
                    batches.append((ids, offsets, w))
                out = mine(*batches[rank])
                (out * out * 1.37).sum().backward()
                cat = [torch.cat([b[0] for b in batches]),
                       torch.from_numpy(np.concatenate([[0], np.cumsum(
                           [len(b[0]) for b in batches])[:-1]]).repeat(4)
                           + np.concatenate([b[1].numpy() for b in batches])),
                       torch.cat([b[2] for b in batches]) if weighted else None]
                ref_out = theirs(*cat)
                (ref_out * ref_out * 1.37).sum().backward()
                if not torch.equal(out, ref_out[4 * rank: 4 * rank + 4]):
                    bad.append(f"{table} {mode} step {step} outputs")
            everything = np.arange(6)
            if store.lookup(table, everything).tobytes() != ref.lookup(table, everything
                                                                       ).tobytes():
                bad.append(f"{table} {mode} weights")
    return bad


def records_accesses(rank: int, world: int, logs: str, ref_log: str) -> None:
    """Train the modules over a recording sharded store; rank 0 also feeds one recording
    store each rank's batches in rank order (what the sharded store computes).
    """
    import torch
    import torch.distributed as dist

    import embstore.torch as et

    tables = specs()[:2]
    features = {"a": "t_sgd", "b": "r_adagrad", "c": "t_sgd"}  # two features share a table
    ref = embstore.open(None, tables=tables, record_accesses=ref_log) if rank == 0 else None
    with ed.open(None, tables=tables, group=dist.group.WORLD,
                 record_accesses=logs) as store:
        assert store.records_accesses
        ebc = et.EmbeddingBagCollection(store, features)
        ref_ebc = None if ref is None else et.EmbeddingBagCollection(ref, features)
        for step in range(3):
            feats = []
            for r in range(world):
                rng = np.random.default_rng([step, r])
                lengths = rng.integers(0, 4, 5)
                feats.append({f: (torch.from_numpy(rng.integers(0, ID_RANGE, int(lengths.sum()))),
                                  torch.from_numpy(lengths)) for f in features})
            ebc(feats[rank]).values().sum().backward()
            if ref_ebc is not None:
                for r in range(world):
                    ref_ebc(feats[r]).values().sum().backward()
        # a write with no lookup of its own is a batch too
        grads = np.full((3, tables[0].dim), 0.5, np.float32)
        store.apply_gradients("t_sgd", np.array([rank, 7, 7]), grads)
        if ref is not None:
            for r in range(world):
                ref.apply_gradients("t_sgd", np.array([r, 7, 7]), grads)
            ref.close()


def stalls(rank: int, world: int, timeout_s: float) -> float:
    """Rank 1 stays alive but stops calling; rank 0's next call fails after the timeout."""
    store = ed.open(None, tables=specs()[:1], timeout_s=timeout_s)
    if rank == 1:
        time.sleep(2 * timeout_s)  # outlives rank 0's wait by one timeout
        os._exit(0)
    start = time.monotonic()
    try:
        store.lookup("t_sgd", np.arange(5))
    except ed.PeerFailedError:
        return time.monotonic() - start
    finally:
        store.local.close()
    return -1.0


def _outcomes(calls: list) -> list[str]:
    """Each call's outcome: "no error" or its embstore error's name, and "slow" after one
    that took over 10 s (a rank waiting out a timeout instead of failing at once).
    """
    out = []
    for call in calls:
        start = time.monotonic()
        try:
            call()
            out.append("no error")
        except embstore.errors.EmbstoreError as exc:
            out.append(type(exc).__name__)
        if time.monotonic() - start > 10:
            out.append("slow")
    return out


def rejects(rank: int, world: int) -> list[str]:
    """Rank 1 passes bad input: it raises its own error, the others PeerFailedError at once,
    nothing changes, and the next calls work on every rank.
    """
    out = []
    with ed.open(None, tables=specs()[:2], timeout_s=30) as store:
        before = store.lookup("r_adagrad", np.arange(10))
        calls = [
            lambda: store.lookup("r_adagrad", np.arange(3.0) if rank == 1 else np.arange(3)),
            lambda: store.apply_gradients("r_adagrad", np.arange(2), np.ones(
                (2, 4), np.float32) * (np.nan if rank == 1 else 1)),
            lambda: store.update("t_sgd" if rank == 0 else "nope", np.arange(2),
                                 np.ones((2, 5), np.float32)),
        ]
        out += _outcomes(calls)
        if not np.array_equal(store.lookup("r_adagrad", np.arange(10)), before):
            out.append("changed")
    return out


def tiered_plan(rank: int, world: int, path: str, plan_json: dict, steps: int) -> list[str]:
    """Open on disk with a plan that gives shards their own tier chains, train, and check
    that each rank's local tables run those chains (also after reopening) and that the
    rows are the reference's.
    """
    plan = Plan.from_json(plan_json)
    bad = []
    with ed.open(path, tables=specs(), plan=plan, timeout_s=60) as store:
        for step in range(steps):
            _step_sharded(store, rank, step)
        bad += _chains_differ(store, plan, rank)
        bad += compare(store, reference(world, steps), rank)
    with ed.open(path, timeout_s=60) as store:  # the directory alone: the same chains
        bad += [f"reopened: {b}" for b in _chains_differ(store, plan, rank)]
        bad += [f"reopened: {b}" for b in compare(store, reference(world, steps), rank)]
    return bad


def _chains_differ(store: ed.ShardedStore, plan: Plan, rank: int) -> list[str]:
    bad = []
    for spec in specs():
        if rank not in plan.tables[spec.name].ranks:
            continue
        want = plan.chain(rank, spec.name)
        got = store.local.table_spec(spec.name).tiers
        if want is None or got != want:
            bad.append(f"{spec.name}: local tiers {got}, planned {want}")
            continue
        levels = store.local.tier_statistics(spec.name)
        if [t.backend for t in levels] != [t.backend for t in want] or any(
                t.capacity is not None and (s.capacity_rows != t.capacity or s.rows > t.capacity)
                for s, t in zip(levels, want, strict=False)):
            bad.append(f"{spec.name}: tiers run {levels}, planned {want}")
    return bad


def _bad_batches(rank: int, fault: str) -> list:
    """Four batches of 3 bags; rank 1's second breaks the module's or the store's checks."""
    import torch

    batches = []
    for step in range(4):
        ids = torch.from_numpy(np.random.default_rng([step, rank]).integers(0, ID_RANGE, 6))
        offsets = torch.tensor([0, 2, 4])
        if step == 1 and rank == 1:
            if fault == "id outside the table":  # checked by the store, in its lookup
                ids[3] = ID_RANGE
            elif fault == "float ids":  # checked by the module before any lookup
                ids = ids.double()
            else:  # offsets out of order
                offsets = torch.tensor([0, 4, 2])
        batches.append((ids, offsets))
    return batches


def bad_inputs_on_one_rank(rank: int, world: int, cases: list[tuple[str, bool]]
                           ) -> list[tuple[list[str], bool]]:
    """`bad_input_on_one_rank` of each (fault, pipeline) case, in one group of processes."""
    return [bad_input_on_one_rank(rank, world, fault, pipeline) for fault, pipeline in cases]


def bad_input_on_one_rank(rank: int, world: int, fault: str, pipeline: bool
                          ) -> tuple[list[str], bool]:
    """Rank 1's second batch is bad: each rank's forward of that step raises (rank 1 its
    input's error, rank 0 PeerFailedError) at once, as without a pipeline, and the loop goes
    on; the table is then the one store's that took the other steps. Returns the steps'
    outcomes and whether the table matches.
    """
    import embstore.torch as et

    spec = embstore.TableSpec("t", 4, num_embeddings=ID_RANGE, init=embstore.init.Uniform(seed=1),
                              optimizer=optim.Adagrad(0.1))
    batches = _bad_batches(rank, fault)
    seen = []
    with ed.open(None, tables=[spec], timeout_s=30) as store:
        bag = et.EmbeddingBag(store, "t", mode="sum")
        loop = et.TrainPipeline(batches, inputs=lambda b: {bag: b}) if pipeline else batches
        for ids, offsets in loop:
            start = time.monotonic()
            try:
                bag(ids, offsets).sum().backward()
                seen.append("ok")
            except embstore.errors.EmbstoreError as exc:
                seen.append(type(exc).__name__)
            if time.monotonic() - start > 10:
                seen[-1] += " (after the group's timeout)"
        if pipeline:
            loop.close()
        with embstore.open(None, tables=[spec]) as ref:
            for step in (0, 2, 3):
                ids = np.concatenate([_bad_batches(r, fault)[step][0].numpy()
                                      for r in range(world)])
                ref.apply_gradients("t", ids, np.ones((len(ids), 4), np.float32))
            everything = np.arange(ID_RANGE)
            same = (store.lookup("t", everything).tobytes() == ref.lookup("t", everything).tobytes()
                    and store.lookup_state("t", everything).tobytes()
                    == ref.lookup_state("t", everything).tobytes())
    return seen, same


def diverges(rank: int, world: int, ckpt: str) -> list[str]:
    """Rank 1's gradient overflows the row rank 0 owns, after the exchange (both ranks'
    inputs are finite): rank 0 raises the step's error and, from the next call on, every
    rank raises ShardsDivergedError, a checkpoint too, without waiting for a timeout.
    """
    spec = embstore.TableSpec("t", 4, optimizer=optim.SGD(1.0))
    plan = Plan(world, {"t": Placement("table", (0,))})
    out = []
    store = ed.open(None, tables=[spec], plan=plan, timeout_s=30)
    try:
        store.update("t", np.arange(1), np.full((1, 4), 3e38, np.float32))
        calls = [
            lambda: store.apply_gradients("t", np.arange(1) if rank == 1 else np.arange(0),
                                          np.full((rank, 4), -3e38, np.float32)),
            lambda: store.lookup("t", np.arange(2)),
            lambda: store.apply_gradients("t", np.arange(1), np.ones((1, 4), np.float32)),
            lambda: store.checkpoint(ckpt, step=1),
            lambda: store.flush(),
        ]
        out += _outcomes(calls)
    finally:
        store.close()  # closes: closing is all that is left
    out.append("closed" if store.closed else "open")
    return out


def _half_step(store: ed.ShardedStore | embstore.EmbeddingStore, rank: int | None,
               world: int, step: int) -> None:
    """Step k of the half-precision table: odd steps touch id 5 alone (one owner's rows)."""
    spec = _half_spec()
    parts = []
    for r in range(world):
        rng = np.random.default_rng([step, r, 77])
        ids = (np.array([5] if r == 0 else [], np.int64) if step % 2
               else rng.integers(0, ID_RANGE, 12).astype(np.int64))
        parts.append((ids, rng.standard_normal((len(ids), spec.dim)).astype(np.float32)))
    if rank is None:  # the single store: every rank's part, in rank order
        store.apply_gradients("h", np.concatenate([p[0] for p in parts]),
                              np.concatenate([p[1] for p in parts]))
    else:
        store.apply_gradients("h", *parts[rank])


def _half_spec() -> embstore.TableSpec:
    return embstore.TableSpec("h", 8, precision="fp16", init=embstore.init.Uniform(seed=9),
                              optimizer=optim.SGD(0.3))


def half_precision_through_restore(rank: int, world: int, tmp: str) -> list[str]:
    """An fp16 table sharded row-wise, stepped (some steps touch one owner's rows only),
    checkpointed, restored onto one rank and stepped again: bit for bit the single store's.
    Its stochastic rounding is seeded by the count of the table's steps, which every
    owner must keep, and which the restore carries over.
    """
    ids = np.arange(ID_RANGE, dtype=np.int64)
    ref = embstore.open(None, tables=[_half_spec()])
    bad = []
    plan = Plan(world, {"h": Placement("row", tuple(range(world)))})
    with ed.open(f"{tmp}/s", tables=[_half_spec()], plan=plan, timeout_s=60) as store:
        for step in range(6):
            _half_step(store, rank, world, step)
            _half_step(ref, None, world, step)
        if store.lookup("h", ids).tobytes() != ref.lookup("h", ids).tobytes():
            bad.append("trained")
        store.checkpoint(f"{tmp}/c", step=6)
    moved = Plan(world, {"h": Placement("table", (world - 1,))})
    with ed.restore(f"{tmp}/c", f"{tmp}/r", plan=moved, timeout_s=60) as store:
        if store.lookup("h", ids).tobytes() != ref.lookup("h", ids).tobytes():
            bad.append("restored")
        for step in range(6, 9):
            _half_step(store, rank, world, step)
            _half_step(ref, None, world, step)
        if store.lookup("h", ids).tobytes() != ref.lookup("h", ids).tobytes():
            bad.append("stepped after the restore")
    return bad
