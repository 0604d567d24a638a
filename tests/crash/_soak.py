"""Random kills under load: a mixed workload on a multi-tier store, SIGKILLed at random times.

    python tests/crash/_soak.py KILLS [BACKEND ...]     # e.g. 1000 kills on each backend

The child runs seeded steps of lookups, updates, gradient steps (row-wise Adagrad) and deletes
on a DRAM cache over the backend, flushes after every step and reports it ("ack <step>"), and
takes a checkpoint every 8 steps. The parent kills it at a random time, replays the same steps
in an in-memory store and requires every row (weights and optimizer state) to be as the last
acknowledged flush left it or as a later step made it: nothing acknowledged lost, nothing torn.
Each kill continues the same store, so recovery after recovery is exercised. Prints a tally.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import embstore
from embstore import fsck

DIM, IDS, BATCH = 8, 2000, 64
SPEC = embstore.TableSpec("t", dim=DIM, optimizer=embstore.optim.RowWiseAdagrad(lr=0.05),
                          init=embstore.init.Uniform(-0.1, 0.1, seed=9))

STEP = '''
def step(store, s):
    rng = np.random.default_rng(s)
    ids = rng.integers(0, IDS, BATCH)
    store.lookup("t", ids)
    store.apply_gradients("t", ids, rng.standard_normal((BATCH, DIM)).astype(np.float32))
    up = rng.integers(0, IDS, BATCH // 4)
    store.update("t", up, rng.standard_normal((len(up), DIM)).astype(np.float32))
    store.delete("t", rng.integers(0, IDS, 4))
'''

CHILD = '''
import json, sys
import numpy as np
import embstore
cfg = json.loads(sys.argv[1])
globals().update(cfg["constants"])
exec(cfg["step"])
spec = embstore.TableSpec("t", dim=DIM, optimizer=embstore.optim.RowWiseAdagrad(lr=0.05),
                          init=embstore.init.Uniform(-0.1, 0.1, seed=9))
tiers = [embstore.TierSpec("dram", capacity=BATCH * 2, eviction="clock"),
         embstore.TierSpec(cfg["backend"])]
store = embstore.open(cfg["path"], tables=[spec], tiers=tiers)
s = cfg["first"]
while True:
    step(store, s)
    store.flush()
    print(f"ack {s}", flush=True)  # one write: a kill never tears it
    if s % 8 == 7:
        store.checkpoint(cfg["path"] + f"-ckpt{s}", step=s)
    s += 1
'''

CONSTANTS = {"DIM": DIM, "IDS": IDS, "BATCH": BATCH}
_ns: dict = {"np": np, **CONSTANTS}
exec(STEP, _ns)


class Model:
    """The steps replayed in an in-memory store: full rows after each step."""

    def __init__(self) -> None:
        self.store = embstore.open(None, tables=[SPEC])
        self.done = -1  # last step applied
        self.ids = np.arange(IDS)

    def rows(self) -> np.ndarray:
        return np.concatenate([self.store.lookup("t", self.ids),
                               self.store.lookup_state("t", self.ids)], axis=1)

    def reset(self, rows: np.ndarray, done: int) -> None:
        """Every row set to `rows` (weights and state), as after step `done`."""
        self.store.close()
        self.store = embstore.open(None, tables=[SPEC])
        self.store.bulk_load("t", self.ids, rows[:, :DIM], rows[:, DIM:])
        self.done = done

    def advance(self, to: int) -> None:
        while self.done < to:
            self.done += 1
            _ns["step"](self.store, self.done)


def run_one(path: Path, backend: str, first: int, model: Model, rng: np.random.Generator,
            tally: dict[str, int]) -> int:
    """One child, killed at a random time; checks the store; returns the next step to run."""
    cfg = {"path": str(path), "backend": backend, "first": first, "constants": CONSTANTS,
           "step": STEP}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(float(rng.uniform(0.3, 1.5)))  # opening, stepping, flushing or checkpointing
    child.send_signal(signal.SIGKILL)
    out, err = child.communicate(timeout=60)
    if child.returncode != -signal.SIGKILL:
        raise AssertionError(f"child ended by itself ({child.returncode}): {err[-3000:]}")
    # a line the kill cut short is no acknowledgement (the step counts as in progress)
    acks = [int(m[1]) for line in out.splitlines() if (m := re.fullmatch(r"ack (\d+)", line))]
    acked = acks[-1] if acks else first - 1
    tally["kills"] += 1
    tally["acked_steps"] += len(acks)
    if not (path / "MANIFEST.json").exists():  # killed while creating the store
        assert first == 0 and not acks
        tally["kills_while_creating"] += 1
        return 0
    # allowed per id: its row after the acknowledged step, or after the one the child was in
    model.advance(acked)
    at_ack = model.rows()
    model.advance(acked + 1)
    after = model.rows()
    findings = fsck.check(path)
    assert findings == [], findings
    with embstore.open(path) as store:
        got = np.concatenate([store.lookup("t", model.ids), store.lookup_state("t", model.ids)],
                             axis=1)
    ok = (got == at_ack).all(axis=1) | (got == after).all(axis=1)
    tally["rows_checked"] += IDS
    tally["rows_wrong"] += int((~ok).sum())
    assert ok.all(), f"{int((~ok).sum())} rows neither as acked (step {acked}) nor as step " \
                     f"{acked + 1} left them, e.g. id {int(np.flatnonzero(~ok)[0])}"
    # the same store goes on from the step after the acknowledged one: a step that was cut
    # short runs again, and replaying it from the acknowledged state gives the same rows
    # (rows and optimizer state rewound to the acknowledged step, in the store and the model)
    with embstore.open(path) as store:
        store.bulk_load("t", model.ids, at_ack[:, :DIM], at_ack[:, DIM:])
    model.reset(at_ack, acked)
    return acked + 1


def soak(root: Path, backend: str, kills: int, seed: int = 0) -> dict[str, int]:
    """Run `kills` kills on one store of `backend` under `root`; the tally."""
    rng = np.random.default_rng(seed)
    tally = {"kills": 0, "kills_while_creating": 0, "acked_steps": 0, "rows_checked": 0,
             "rows_wrong": 0}
    model = Model()
    path = root / f"soak-{backend}"
    first = 0
    for _ in range(kills):
        first = run_one(path, backend, first, model, rng, tally)
    for ckpt in sorted(root.glob(f"soak-{backend}-ckpt*"))[-2:]:
        assert fsck.check(ckpt) == [], ckpt
    return tally


def main() -> None:
    import tempfile

    kills = int(sys.argv[1])
    backends = sys.argv[2:] or ["rocksdb", "lmdb", "pmem"]
    for backend in backends:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            tally = soak(Path(tmp), backend, kills)
            print(json.dumps({"backend": backend, **tally,
                              "seconds": round(time.monotonic() - start)}), flush=True)


if __name__ == "__main__":
    main()
