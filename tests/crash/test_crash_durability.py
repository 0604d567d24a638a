"""Crash durability of every persistent backend, alone and as the bottom tier under a DRAM
cache: SIGKILL a real writer, reopen, check each row.

A child process writes steps of puts and deletes, flushes every FLUSH_EVERY steps and reports
each flush that returned ("ack <step>") on its stdout. The parent kills it with SIGKILL at a
random moment after a random number of acks (mid-write, mid-flush or idle), reopens the table
from its path and checks every id: its state must be the one the last acknowledged step left,
or one that a later step wrote; never an older state, never a row that no step wrote (torn or
mixed), never an error.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import registry
from embstore.backend import BackendSpec
from embstore.errors import BackendUnavailableError

pytestmark = pytest.mark.crash

DIM = 16
ID_SPACE = 4000  # ids in [-ID_SPACE/2, ID_SPACE/2): steps revisit ids often
PUTS = 200
DELETES = 20
FLUSH_EVERY = 2
TRIALS = 4
MAX_ACKS = 6

# Shared by the child (through `exec`) and the parent: the schedule and row contents are pure
# functions of (seed, step), so the parent knows what every step wrote.
SCHEDULE = '''
import numpy as np

def step_ids(seed, step):
    """(ids put, ids deleted) by `step`: disjoint, distinct."""
    rng = np.random.default_rng([seed, step])
    ids = rng.choice(ID_SPACE, size=PUTS + DELETES, replace=False).astype(np.int64)
    ids -= ID_SPACE // 2
    return ids[:PUTS], ids[PUTS:]

def step_rows(ids, step):
    """The rows `step` writes for `ids`: column 0 holds the step, the rest depend on both."""
    j = np.arange(1, DIM, dtype=np.int64)
    rest = (ids[:, None] * 31 + step * 17 + j[None, :] * 7) % 1009
    return np.concatenate([np.full((len(ids), 1), step), rest], axis=1).astype(np.float32)
'''

CHILD = '''
import json, sys
import numpy as np
from embstore import registry
from embstore.backend import BackendSpec

cfg = json.loads(sys.argv[1])
globals().update(cfg["constants"])
exec(cfg["schedule"])
backend = registry.load_backend(cfg["name"]).open(
    BackendSpec(path=cfg["path"], dim=DIM, table="crash"))
step = 0
while True:
    put, delete = step_ids(cfg["seed"], step)
    backend.put(put, step_rows(put, step))
    backend.delete(delete)
    if step % FLUSH_EVERY == FLUSH_EVERY - 1:
        backend.flush()
        print(f"ack {step}", flush=True)  # one write: a kill never tears it
    step += 1
'''

# The same schedule through a store whose DRAM cache tier holds half a step's rows: every
# step evicts dirty rows, written back into the persistent bottom tier on a second thread.
CHILD_TIERED = '''
import json, sys
import embstore
from embstore import TableSpec, TierSpec

cfg = json.loads(sys.argv[1])
globals().update(cfg["constants"])
exec(cfg["schedule"])
store = embstore.open(cfg["path"], tables=[TableSpec("crash", dim=DIM)],
                      tiers=[TierSpec("dram", capacity=PUTS // 2, eviction="clock"),
                             TierSpec(cfg["name"])])
step = 0
while True:
    put, delete = step_ids(cfg["seed"], step)
    store.update("crash", put, step_rows(put, step))
    store.delete("crash", delete)
    if step % FLUSH_EVERY == FLUSH_EVERY - 1:
        store.flush()
        print(f"ack {step}", flush=True)  # one write: a kill never tears it
    step += 1
'''

CONSTANTS = {"DIM": DIM, "ID_SPACE": ID_SPACE, "PUTS": PUTS, "DELETES": DELETES,
             "FLUSH_EVERY": FLUSH_EVERY}
_namespace: dict = dict(CONSTANTS)
exec(SCHEDULE, _namespace)
step_ids = _namespace["step_ids"]
step_rows = _namespace["step_rows"]


def _persistent_backends() -> list:
    params = []
    for name in registry.backend_names():
        try:
            cls = registry.load_backend(name)
        except BackendUnavailableError as exc:
            params.append(pytest.param(name, marks=pytest.mark.skip(reason=str(exc))))
            continue
        if cls.supports_persistence:
            params.append(name)
    return params


def _run_and_kill(name: str, path: Path, seed: int, rng: np.random.Generator,
                  child_code: str = CHILD) -> list[int]:
    """Run the writer, SIGKILL it at a random point, return every step it acknowledged."""
    cfg = {"name": name, "path": str(path), "seed": seed, "constants": CONSTANTS,
           "schedule": SCHEDULE}
    # unbuffered bytes: a buffered reader's readline may read ahead lines that communicate()
    # (which reads the descriptor itself) would then never see, and acks would go missing
    child = subprocess.Popen([sys.executable, "-c", child_code, json.dumps(cfg)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    acks: list[int] = []
    try:
        wanted = int(rng.integers(1, MAX_ACKS + 1))
        while len(acks) < wanted:
            line = child.stdout.readline()
            if not line:
                child.wait(timeout=30)
                pytest.fail(f"the {name} writer died on its own: "
                            f"{child.stderr.read().decode(errors='replace')}")
            acks.append(int(line.split()[1]))
        # Kill somewhere in the next steps: while writing, flushing, or between the two.
        time.sleep(float(rng.uniform(0.0, 0.03)))
    finally:
        child.send_signal(signal.SIGKILL)
        raw, _ = child.communicate(timeout=30)
        out = raw.decode()
    assert child.returncode == -signal.SIGKILL
    # Whole lines the child printed before it died are acknowledgements too; a line the kill
    # cut short is dropped (that only widens the states the check allows, never narrows them).
    acks += [int(m.group(1)) for m in re.finditer(r"^ack (\d+)\n", out, re.MULTILINE)]
    return acks


def _allowed_states(seed: int, last_ack: int) -> dict[int, set[int | None]]:
    """For each id, the steps whose write it may show (None: absent) after the crash.

    The state after the last acknowledged step must have survived; a later step (up to the
    next flush, which may have finished without its ack reaching us) may have replaced it.
    """
    state: dict[int, int | None] = {}
    later: dict[int, set[int | None]] = {}
    for step in range(last_ack + FLUSH_EVERY + 1):
        put, delete = step_ids(seed, step)
        for ids, value in ((put, step), (delete, None)):
            for i in ids.tolist():
                if step <= last_ack:
                    state[i] = value
                else:
                    later.setdefault(i, set()).add(value)
    allowed: dict[int, set[int | None]] = {}
    for i in range(-ID_SPACE // 2, ID_SPACE // 2):
        allowed[i] = {state.get(i)} | later.get(i, set())
    return allowed


def _read_backend(name: str, path: Path, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, found) of `ids` in the table the backend-level writer left."""
    with registry.load_backend(name).open(BackendSpec(path=path, dim=DIM, table="crash")) as b:
        rows, found = b.get(ids)
        assert set(b.ids().tolist()) == set(ids[found].tolist())
    return rows, found


def _read_store(name: str, path: Path, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, found) of `ids` in the store the tiered writer left (stored rows only)."""
    rows = np.zeros((len(ids), DIM), dtype=np.float32)
    found = np.zeros(len(ids), dtype=bool)
    with embstore.open(path) as store:
        for batch_ids, weights, _ in store.items("crash"):
            at = np.searchsorted(ids, batch_ids)
            assert (ids[at] == batch_ids).all(), "a row for an id no step wrote"
            rows[at], found[at] = weights, True
    return rows, found


@pytest.mark.parametrize("layout", ["backend", "dram cache over it"])
@pytest.mark.parametrize("name", _persistent_backends())
def test_every_acknowledged_flush_survives_sigkill(name, layout, tmp_path):
    tiered = layout != "backend"
    rng = np.random.default_rng(zlib.crc32(f"{name} {layout}".encode()))
    for trial in range(TRIALS):
        path = tmp_path / f"trial{trial}"
        seed = 1000 * trial + 7
        acks = _run_and_kill(name, path, seed, rng, CHILD_TIERED if tiered else CHILD)
        assert acks == sorted(acks) and acks
        allowed = _allowed_states(seed, acks[-1])
        ids = np.array(sorted(allowed), dtype=np.int64)
        rows, found = (_read_store if tiered else _read_backend)(name, path, ids)
        for i, row, hit in zip(ids.tolist(), rows, found.tolist(), strict=True):
            if not hit:
                assert None in allowed[i], (
                    f"{name} trial {trial}: id {i} is missing, but acknowledged step "
                    f"{acks[-1]} left it written")
                continue
            step = int(row[0])
            assert step in allowed[i], (
                f"{name} trial {trial}: id {i} holds the write of step {row[0]}, allowed: "
                f"{sorted(allowed[i], key=lambda s: -1 if s is None else s)}")
            expected = step_rows(np.array([i], dtype=np.int64), step)[0]
            assert np.array_equal(row, expected), f"{name} trial {trial}: id {i} is torn"
