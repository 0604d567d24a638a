"""Byte-flip campaign against fsck: flip one byte of a store's files at a time, check, restore.

`campaign(store, flips)` runs a worker process (this file run as a script) that, for each
(file, offset), XORs the byte with 0xFF, runs fsck's checks in-process (the native scanners
too, which the real fsck runs in a child), then reads the store back through an independent
path (the raw library or the backend) to learn whether the flip changed a row, a key or a
header, and restores the byte. A worker that crashes is restarted after the flip it was on,
from pristine copies of the files: a crash inside fsck's native scanners counts as detected
(the real fsck turns a dead child into a finding), a crash of the reference read as a change.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Tally:
    """What a campaign found."""

    flips: int = 0
    changed: int = 0          # flips that change a row, a key or a header
    detected: int = 0         # of those, flagged by fsck
    flagged_benign: int = 0   # flagged though nothing a reader sees changed (free space, padding)
    crashes: int = 0          # worker crashes (counted as detected / changed, see above)
    crash_flips: list[tuple[str, int]] = field(default_factory=list)
    missed: list[tuple[str, int]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Detection rate among the flips that change something."""
        return self.detected / self.changed if self.changed else 1.0


def campaign(store: Path, flips: list[tuple[str, int]], *, timeout: float = 1200) -> Tally:
    """Run the flips (file relative to `store`, offset) and tally them."""
    pristine = {f: (store / f).read_bytes() for f in {f for f, _ in flips}}
    tally = Tally()
    todo = list(flips)
    while todo:
        proc = subprocess.run([sys.executable, __file__, str(store)],
                              input=json.dumps(todo), capture_output=True, text=True,
                              timeout=timeout, check=False)
        done = 0
        state: dict[str, bool] = {}
        for line in proc.stdout.splitlines():
            rec = json.loads(line)
            if "detected" in rec:
                state = {"detected": rec["detected"]}
                continue
            _count(tally, todo[done], state["detected"], rec["changed"])
            done += 1
            state = {}
        if proc.returncode == 0:
            break
        # the worker died on todo[done]: inside fsck (no "detected" yet) or the reference read
        for f, data in pristine.items():
            (store / f).write_bytes(data)
        tally.crashes += 1
        tally.crash_flips.append(todo[done])
        if state:
            _count(tally, todo[done], state["detected"], True)
        else:
            _count(tally, todo[done], True, True)
        todo = todo[done + 1:]
    return tally


def _count(tally: Tally, flip: tuple[str, int], detected: bool, changed: bool) -> None:
    tally.flips += 1
    if changed:
        tally.changed += 1
        if detected:
            tally.detected += 1
        else:
            tally.missed.append(flip)
    elif detected:
        tally.flagged_benign += 1


# --- the worker -------------------------------------------------------------------------------

def _reference(store: Path) -> object:
    """Everything a reader of the store sees, read by another path than fsck's scanners."""
    from embstore._rebuild import open_bottom, read_store
    from embstore.layout import bottom_dir, table_chain

    _, specs, tiers = read_store(store)
    out = []
    for spec in specs:
        backend = table_chain(spec, tiers)[-1].backend
        if backend == "lmdb":
            out.append(_lmdb_dump(bottom_dir(store, spec, tiers), spec.name))
            continue
        with open_bottom(store, spec, tiers, read_only=True) as b:
            pages = list(b.items(1 << 16))
            ids = np.concatenate([p[0] for p in pages]) if pages else np.zeros(0, np.int64)
            rows = np.concatenate([p[1] for p in pages]) if pages else np.zeros((0, 1))
            again, found = b.get(ids)
            assert found.all() and again.tobytes() == rows.tobytes()
            out.append((ids.tobytes(), rows.tobytes()))
    return out


def _lmdb_dump(d: Path, table: str) -> object:
    import lmdb

    env = lmdb.open(str(d), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
        dbs = {}
        for name in names:
            db = env.open_db(name, create=False)
            with env.begin(db=db) as txn:
                items = list(txn.cursor())
                got = [txn.get(k) for k, _ in items]
                assert got == [v for _, v in items]
                dbs[name] = items
        return sorted(dbs.items())
    finally:
        env.close()


def _headers(store: Path, files: set[str]) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges that are a file's header: a pmem file's header page, LMDB's current meta."""
    from embstore._fileinfo import lmdb_metas

    out: dict[str, list[tuple[int, int]]] = {}
    for f in files:
        if f.endswith(".pmem"):
            out[f] = [(0, 4096)]
        elif f.endswith("data.mdb"):
            metas = lmdb_metas(store / f, (store / f).stat().st_size)
            cur = max(metas, key=lambda m: m.txnid)
            out[f] = [(cur.page * cur.page_size, cur.page * cur.page_size + 152)]
    return out


def _worker(store: Path, flips: list[tuple[str, int]]) -> None:
    import embstore.fsck as fsck
    from embstore import _fsck_native

    fsck._run_child = _fsck_native.scan  # the same scanners, without a process per flip
    try:
        original = _reference(store)
    except Exception as exc:  # the campaign needs a readable store to start from
        raise SystemExit(f"reference read of the pristine store failed: {exc}") from exc
    headers = _headers(store, {f for f, _ in flips})
    for f, off in flips:
        fd = os.open(store / f, os.O_RDWR)
        try:
            old = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), off)
            detected = bool(fsck.check(store))
            print(json.dumps({"detected": detected}), flush=True)
            try:
                changed = _reference(store) != original
            except Exception:
                changed = True
            changed |= any(a <= off < b for a, b in headers.get(f, ()))
            os.pwrite(fd, old, off)
        finally:
            os.close(fd)
        print(json.dumps({"changed": changed}), flush=True)


def data_files(store: Path) -> list[str]:
    """The files of a store's tiers a flip should hit (not logs, locks or option files)."""
    out = []
    for p in sorted(store.rglob("*")):
        if p.is_file() and p.parent != store and not p.name.startswith(
                ("LOG", "LOCK", "lock.mdb", "OPTIONS")):
            out.append(str(p.relative_to(store)))
    return out


def every_byte(store: Path) -> list[tuple[str, int]]:
    """Every byte of every data file."""
    return [(f, i) for f in data_files(store) for i in range((store / f).stat().st_size)]


def random_bytes(store: Path, n: int, seed: int) -> list[tuple[str, int]]:
    """`n` distinct random bytes over the data files, weighted by size."""
    everything = every_byte(store)
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(everything), size=min(n, len(everything)), replace=False)
    return [everything[i] for i in sorted(pick.tolist())]


def snapshot(store: Path, dest: Path) -> Path:
    """A copy of `store` to flip in (the original stays pristine)."""
    shutil.copytree(store, dest)
    return dest


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), [tuple(x) for x in json.loads(sys.stdin.read())])
