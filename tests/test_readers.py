"""Readers beside a writer in another process: read-only opens, `embstore info` and `fsck`.

A child process holds the store open for writing (its lock names its pid). Beside it the
parent opens the store read-only and looks rows up, runs `embstore info` and `embstore fsck`:
each works, reads what the writer's last flush left (rows written since may show too, never
a row older than that flush), and writes nothing in the store (every file's bytes and mtime
unchanged, LMDB's table of readers in lock.mdb apart). A second writer and `fsck --repair`
are still refused at once, naming the writer's pid.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, fsck
from embstore.errors import StoreLockedError
from embstore.layout import lock_for_reading
from embstore.tools.cli import main

PERSISTENT = ["rocksdb", "lmdb", "pmem"]
N = 300
ROUNDS = 20
INIT = -1.0
_WRITER = textwrap.dedent("""
    import sys, numpy as np, embstore
    from embstore import TableSpec, TierSpec
    path, bottom, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tables = [TableSpec("t", dim=4, num_embeddings=1000, init=embstore.init.Constant(-1.0)),
              TableSpec("u", dim=2, init=embstore.init.Constant(-1.0))]
    # a cache tier with files of its own (readers use DRAM instead); small RocksDB memtables:
    # its files come and go (flushes, compactions) under the readers
    options = {"write_buffer_bytes": 1 << 16} if bottom == "rocksdb" else {}
    store = embstore.open(path, tables=tables,
                          tiers=[TierSpec("pmem", capacity=20), TierSpec(bottom, options=options)])
    ids = np.arange(n)

    def write(value, deleted):
        store.update("t", ids, np.full((n, 4), value, np.float32))
        store.update("u", ids, np.full((n, 2), value, np.float32))
        for table in ("t", "u"):
            store.delete(table, ids[deleted])

    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "write":  # value k, rows with (id + k) % 7 == 0 deleted
            k = int(arg)
            write(float(k), (ids + k) % 7 == 0)
        elif cmd == "flush":
            store.flush()
        elif cmd == "rounds":  # write and flush rounds 1..k, announcing each flush
            for k in range(1, int(arg) + 1):
                write(float(k), (ids + k) % 7 == 0)
                store.flush()
                print("flushed", k, flush=True)
            continue
        elif cmd == "close":
            store.close()
            print("closed", flush=True)
            break
        print("ok", flush=True)
""")


class _Writer:
    """The writer child: commands on its stdin, one answer line per command."""

    def __init__(self, path: Path, bottom: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), bottom, str(N)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def ask(self, line: str) -> str:
        self.send(line)
        return self.answer()

    def answer(self) -> str:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().strip()
        assert got, f"the writer died (exit {self.proc.poll()})"
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask("close")
        self.proc.wait(timeout=60)
        assert self.proc.returncode == 0


@pytest.fixture
def writer(tmp_path, request):
    w = _Writer(tmp_path / "s", request.param)
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait(timeout=60)
        for pipe in (w.proc.stdin, w.proc.stdout):
            if pipe is not None:
                pipe.close()


def _files(root: Path) -> dict[str, tuple[int, int, str]]:
    """(mtime ns, size, sha256) of every file under `root`, by path relative to it."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_size,
                                             hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def _expected(k: int) -> np.ndarray:
    """Weights of ids 0..N-1 after round k: k, or the initial value where round k deleted."""
    ids = np.arange(N)
    return np.where((ids + k) % 7 == 0, INIT, float(k))


@pytest.mark.parametrize("writer", PERSISTENT, indirect=True)
def test_readers_info_and_fsck_beside_a_writer_read_its_last_flush_and_write_nothing(
        tmp_path, writer, capsys):
    path = tmp_path / "s"
    assert writer.ask("write 1") == "ok" and writer.ask("flush") == "ok"
    before = _files(path)
    pid = writer.proc.pid

    with embstore.open(path, read_only=True) as store:
        assert store.read_only
        for table, dim in (("t", 4), ("u", 2)):
            got = store.lookup(table, np.arange(N))
            np.testing.assert_array_equal(got, np.repeat(_expected(1)[:, None], dim, axis=1))
            assert len(store.lost_rows(table)) == 0
    assert main(["info", "--json", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    alive = int(np.count_nonzero(_expected(1) != INIT))
    assert info["read_only"] and info["tables"]["t"]["tiers"][-1]["rows"] == alive
    assert main(["fsck", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"note: (store): process {pid} held the store open for writing" in out
    assert out.strip().endswith(f"{path}: clean")

    after = _files(path)
    changed = sorted(name for name in set(before) | set(after)
                     if before.get(name) != after.get(name))
    # LMDB's readers register in its lock file (the writer then keeps their pages)
    assert [c for c in changed if not c.endswith("lock.mdb")] == []

    # the writer's lock still keeps out a second writer and a repair, naming it
    with pytest.raises(StoreLockedError, match=f"process {pid} holds it") as err:
        embstore.open(path)
    assert err.value.holder_pid == pid
    assert main(["fsck", "--repair", str(path)]) == 8
    assert f"process {pid} holds it for writing" in capsys.readouterr().out

    # writes not yet flushed may show; nothing older than the last flush does
    assert writer.ask("write 2") == "ok"
    with embstore.open(path, read_only=True) as store:
        got = store.lookup("t", np.arange(N))[:, 0]
        assert ((got == _expected(1)) | (got == _expected(2))).all()
    assert main(["fsck", str(path)]) == 0
    capsys.readouterr()
    assert writer.ask("flush") == "ok"
    with embstore.open(path, read_only=True) as store:
        np.testing.assert_array_equal(store.lookup("t", np.arange(N))[:, 0], _expected(2))
    writer.close()
    assert main(["fsck", str(path)]) == 0  # alone now: every check, no note
    assert "note" not in capsys.readouterr().out


@pytest.mark.parametrize("writer", PERSISTENT, indirect=True)
def test_readers_and_fsck_follow_a_writer_that_flushes_and_deletes_without_false_alarms(
        tmp_path, writer):
    path = tmp_path / "s"
    assert writer.ask("write 1") == "ok" and writer.ask("flush") == "ok"
    with embstore.open(path, read_only=True) as early:  # open before the writer goes on
        writer.send(f"rounds {ROUNDS}")
        flushed, reads = 1, 0
        while flushed < ROUNDS:
            line = writer.answer()
            assert line.startswith("flushed")
            flushed = int(line.split()[1])
            for store in (early, embstore.open(path, read_only=True)):
                got = store.lookup("t", np.arange(N))[:, 0]
                reads += 1
                # each row: a round's value (no torn or foreign row) or deleted; a fresh
                # reader never older than the flush announced before it opened
                assert np.isin(got, [INIT, *range(1, ROUNDS + 1)]).all()
                if store is not early:
                    assert ((got >= flushed) | (got == INIT)).all()
                    store.close()
            if flushed % 8 == 0:  # fsck of a store in flight: no problem, one note
                findings = fsck.check(path)
                assert [f.note for f in findings] == [True], findings
    assert reads >= 2
    writer.close()
    with embstore.open(path, read_only=True) as store:
        np.testing.assert_array_equal(store.lookup("t", np.arange(N))[:, 0], _expected(ROUNDS))


def test_a_writer_kept_out_by_a_reader_that_holds_the_store_still_is_told_so(tmp_path):
    path = tmp_path / "s"
    with embstore.open(path, tables=[TableSpec("t", dim=2)], tiers=[TierSpec("lmdb")]):
        pass  # a clean close takes the writer's pid out of the lock file
    fd = lock_for_reading(path)  # as export, or fsck with no writer around, hold it
    try:
        with pytest.raises(StoreLockedError, match="a reader that needs it to hold still") \
                as err:
            embstore.open(path)
        assert err.value.holder_pid is None
        with embstore.open(path, read_only=True) as store:  # readers do not mind
            assert store.num_rows("t") == 0
    finally:
        os.close(fd)
    embstore.open(path).close()
