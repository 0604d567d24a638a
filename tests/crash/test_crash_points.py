"""Crash points (embstore._crash): every point, hits 1 and 2, on every persistent backend.

The README's suite crashes every point on rocksdb, the default bottom tier; the slow job
crashes them on the other backends as well.

A child runs steps of updates, gradient steps and deletes through a DRAM cache over the
backend, flushes after each step and says so ("ack <step>"), and takes a checkpoint every
other step, with `EMBSTORE_CRASH_AT=<point>:<hit>`: it SIGKILLs itself at that hit. The parent
then reopens the store with no repair and requires a clean fsck, every row as the last
acknowledged step left it or as a later step wrote it (none lost, none torn), and every
published checkpoint openable and clean. Recovery points crash a reopen; the next reopen must
survive that too. Rebuild points crash a compaction or a migration of the finished store: the
store at its path is then the old or the new one, complete, with every row as acknowledged.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import _crash, fsck, registry
from embstore.errors import BackendUnavailableError

pytestmark = pytest.mark.crash

DIM, IDS, PUTS, DELS, STEPS = 8, 400, 60, 8, 6

SCHEDULE = '''
import numpy as np

def step_ids(step):
    rng = np.random.default_rng(step)
    ids = rng.choice(IDS, size=PUTS + DELS, replace=False).astype(np.int64)
    return ids[:PUTS], ids[PUTS:]

def step_rows(ids, step):
    j = np.arange(DIM - 1, dtype=np.int64)
    rest = (ids[:, None] * 13 + step * 7 + j[None, :] * 3) % 997
    return np.concatenate([np.full((len(ids), 1), step), rest], axis=1).astype(np.float32)
'''

CHILD = '''
import json, sys
import numpy as np
import embstore
cfg = json.loads(sys.argv[1])
globals().update(cfg["constants"])
exec(cfg["schedule"])
spec = embstore.TableSpec("t", dim=DIM, num_embeddings=cfg["bounded"])
tiers = None if cfg["stored_tiers"] else [
    embstore.TierSpec("dram", capacity=PUTS // 2, eviction="lru"),
    embstore.TierSpec(cfg["backend"])]
store = embstore.open(cfg["path"], tables=[spec], tiers=tiers)
first = cfg["first"]
for step in range(first, first + STEPS):
    put, delete = step_ids(step)
    store.update("t", put, step_rows(put, step))
    store.delete("t", delete)
    store.flush()
    print(f"ack {step}", flush=True)  # one write: a kill never tears it
    if step % 2:
        store.checkpoint(cfg["path"] + f"-ckpt{step}", step=step)
store.close()
print("done", flush=True)
'''

CONSTANTS = {"DIM": DIM, "IDS": IDS, "PUTS": PUTS, "DELS": DELS, "STEPS": STEPS}
_ns: dict = dict(CONSTANTS)
exec(SCHEDULE, _ns)


def _persistent() -> list[str]:
    names = []
    for name in registry.backend_names():
        try:
            if registry.load_backend(name).supports_persistence:
                names.append(name)
        except BackendUnavailableError:
            continue
    return names


def run_child(path: Path, backend: str, *, first: int = 0, crash_at: str | None = None,
              bounded: int | None = None, stored_tiers: bool = False) -> tuple[list[int], int]:
    """Run the writer (steps `first`.. `first + STEPS - 1`); its acknowledged steps, its rc.

    With `stored_tiers` it opens the store with the chain it has (a migrated one).
    """
    cfg = {"path": str(path), "backend": backend, "first": first, "bounded": bounded,
           "constants": CONSTANTS, "schedule": SCHEDULE, "stored_tiers": stored_tiers}
    env = {k: v for k, v in os.environ.items() if k != _crash.ENV}
    if crash_at:
        env[_crash.ENV] = crash_at
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    # a line the kill cut short is no acknowledgement
    acks = [int(m[1]) for line in proc.stdout.splitlines()
            if (m := re.fullmatch(r"ack (\d+)", line))]
    return acks, proc.returncode


def allowed_states(acked: int, reached: int) -> dict[int, set[int | None]]:
    """Per id, the steps whose row it may hold (None: absent) after a crash.

    The state the last acknowledged step left, or one that a later, unacknowledged step wrote.
    """
    state: dict[int, int | None] = {}
    allowed: dict[int, set[int | None]] = {}
    for step in range(reached + 1):
        put, delete = _ns["step_ids"](step)
        for i in put.tolist():
            state[i] = step
            if step > acked:
                allowed.setdefault(i, set()).add(step)
        for i in delete.tolist():
            state[i] = None
            if step > acked:
                allowed.setdefault(i, set()).add(None)
        if step == acked:
            for i in range(IDS):
                allowed[i] = {state.get(i)}
    if acked < 0:
        for i in range(IDS):
            allowed.setdefault(i, set()).add(None)
    return allowed


def check_store(path: Path, acked: int, reached: int) -> int:
    """Reopen, fsck and compare every row with the acknowledged state; returns rows checked."""
    assert fsck.check(path) == [], fsck.check(path)
    allowed = allowed_states(acked, reached)
    ids = np.arange(IDS, dtype=np.int64)
    with embstore.open(path) as store:
        rows = store.lookup("t", ids)
        stored = np.zeros(IDS, dtype=bool)
        for got, _, _ in store.items("t"):
            stored[got] = True
    for i in range(IDS):
        ok = allowed[i]
        if not stored[i]:
            assert None in ok, f"id {i}: lost (allowed steps {ok}, acked {acked})"
            continue
        step = int(rows[i, 0])
        assert step in ok, f"id {i}: holds step {step}, allowed {ok} (acked {acked})"
        want = _ns["step_rows"](np.array([i]), step)[0]
        assert np.array_equal(rows[i], want), f"id {i}: torn row {rows[i]}"
    for ckpt in path.parent.glob(path.name + "-ckpt*"):
        assert fsck.check(ckpt) == [], ckpt
    return IDS


POINTS = [p for p in _crash.POINTS
          if not p.startswith(("recovery.", "rebuild.", "access_log."))]


def _on_rocksdb_first(backend: str) -> list:
    """Marks that leave a case to the slow job unless it runs on rocksdb, the default bottom
    tier: the README's suite crashes every point there, the slow job on every backend.
    """
    return [] if backend == "rocksdb" else [pytest.mark.slow]


def _point_cases() -> list:
    """Every backend and point at the first and second hit (the second with the bounded
    written-id record); the README's suite takes rocksdb's first hits, the slow job the rest.
    """
    return [pytest.param(backend, point, hit,
                         marks=_on_rocksdb_first(backend) if hit == 1 else [pytest.mark.slow])
            for backend in _persistent() for point in POINTS for hit in (1, 2)]


@pytest.mark.parametrize("backend, point, hit", _point_cases())
def test_a_crash_at_any_point_loses_no_acknowledged_row(tmp_path, backend, point, hit):
    path = tmp_path / "s"
    bounded = IDS if hit == 2 else None  # both kinds of written-id record
    acks, rc = run_child(path, backend, crash_at=f"{point}:{hit}", bounded=bounded)
    assert rc == -signal.SIGKILL, f"{point}:{hit} was never reached (acks {acks})"
    acked = acks[-1] if acks else -1
    if not (path / "MANIFEST.json").exists():
        # killed while creating the store: nothing was promised, and a new writer creates it
        assert acked == -1
    else:
        check_store(path, acked, min(acked + 1, STEPS - 1))
    # and the store goes on: a second writer continues the schedule from there
    acks2, rc2 = run_child(path, backend, first=STEPS, bounded=bounded)
    assert rc2 == 0 and acks2 == list(range(STEPS, 2 * STEPS))
    assert fsck.check(path) == []


@pytest.mark.parametrize("hit", [1, 2])
@pytest.mark.parametrize("point", [p for p in _crash.POINTS if p.startswith("recovery.")])
@pytest.mark.parametrize("backend", [pytest.param(b, marks=_on_rocksdb_first(b))
                                     for b in _persistent()])
def test_a_crash_during_recovery_is_survived(tmp_path, backend, point, hit):
    path = tmp_path / "s"
    acks, _ = run_child(path, backend, crash_at="writeback.after_put:5")
    acked = acks[-1] if acks else -1
    # two reopens, or two rebuilds of the written-id records (which reopen): hits 1 and 2
    call = ("embstore.rebuild_written_records(sys.argv[1])" if point == "recovery.written"
            else "s = embstore.open(sys.argv[1]); s.lookup('t', [1, 2]); s.close()")
    opener = f"import embstore, sys\nfor _ in range(2):\n    {call}\n"
    env = {**os.environ, _crash.ENV: f"{point}:{hit}"}
    proc = subprocess.run([sys.executable, "-c", opener, str(path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    check_store(path, acked, min(acked + 1, STEPS - 1))


REBUILDER = """
import sys
import embstore
from embstore import _rebuild
from embstore.tools.cli import main
path, op, exchange = sys.argv[1], sys.argv[2], sys.argv[3] == "exchange"
if not exchange:  # a file system without renameat2(RENAME_EXCHANGE): two renames
    _rebuild._exchange = lambda root, new: False
for tiers in ("dram:16,lmdb", "dram:16,rocksdb"):  # two rebuilds: hits 1 and 2
    argv = ["compact", path] if op == "compact" else ["migrate", path, "--tiers", tiers]
    assert main([*argv, "--quiet"]) == 0
print("rebuilt", flush=True)
"""


# the README's suite crashes each rebuild point once (a compact mid-copy, a migrate after its
# exchange, a compact between its renames); the slow job every operation at every point
@pytest.mark.parametrize("hit", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("point, op, exchange", [
    ("rebuild.page", "compact", "exchange"),
    pytest.param("rebuild.page", "migrate", "exchange", marks=pytest.mark.slow),
    pytest.param("rebuild.before_swap", "compact", "exchange", marks=pytest.mark.slow),
    ("rebuild.after_swap", "migrate", "exchange"),
    ("rebuild.swap_parked", "compact", "renames"),
    pytest.param("rebuild.after_swap", "compact", "renames", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("backend", [pytest.param(b, marks=_on_rocksdb_first(b))
                                     for b in _persistent()])
def test_a_crash_while_rebuilding_leaves_the_old_or_the_new_store(tmp_path, backend, point, op,
                                                                   exchange, hit):
    path = tmp_path / "s"
    acks, rc = run_child(path, backend)
    assert rc == 0 and acks == list(range(STEPS))
    env = {**os.environ, _crash.ENV: f"{point}:{hit}"}
    proc = subprocess.run([sys.executable, "-c", REBUILDER, str(path), op, exchange], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"{point}:{hit} not reached: {proc.stderr[-2000:]}"
    if point == "rebuild.swap_parked":  # fsck names the store moved aside ...
        assert any("interrupted between" in f.message for f in fsck.check(path))
    if point == "rebuild.after_swap" and exchange == "renames":  # ... or the one left behind
        assert any("right after its swap" in f.message for f in fsck.check(path))
    # ... and with no repair, no manual step, the next open finds a complete store
    embstore.open(path).close()
    check_store(path, STEPS - 1, STEPS - 1)
    assert not list(tmp_path.glob(".s.swap-old"))
    acks2, rc2 = run_child(path, backend, first=STEPS, stored_tiers=True)
    assert rc2 == 0 and acks2 == list(range(STEPS, 2 * STEPS))
    assert fsck.check(path) == []
