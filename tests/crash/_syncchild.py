"""The traced child of test_sync_coverage.py: one workload, its acknowledged points marked.

    python _syncchild.py WORKLOAD BACKEND ROOT REPORT

Each acknowledged point (an operation that promises durability when it returns) is run between
the markers `EMBSTORE-MARK-A <label>` and `EMBSTORE-MARK-B <label>`, written to stderr for
strace to see; at each B the pages of the files under ROOT that are dirty or under write-back
in the page cache are measured (cachestat(2); /proc/self/smaps for the mapped files where the
kernel lacks it) and written, per label, as JSON to REPORT. BACKEND `pmem-mmap` is pmem on the
mmap + msync fallback. `DROP_SYNC=<site>` removes one sync of the code first
(tests/crash/_syncsites.py); `EMBSTORE_TEST_HIDE_LIBPMEM=1` hides libpmem as in conftest.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _syncsites  # noqa: E402

from embstore import _libpmem  # noqa: E402

if os.environ.get("EMBSTORE_TEST_HIDE_LIBPMEM", "").strip() in ("1", "true", "yes"):
    _libpmem.LIBRARY_NAME = "libpmem-hidden-by-EMBSTORE_TEST_HIDE_LIBPMEM.so.1"

import embstore  # noqa: E402
from embstore import _export, _rebuild, layout  # noqa: E402

_CACHESTAT = 451  # the same number on every architecture
_libc = ctypes.CDLL(None, use_errno=True)
DIM = 8


def dirty_pages(root: Path) -> dict[str, int]:
    """Pages of each file under `root` dirty or under write-back in the page cache."""
    out: dict[str, int] = {}
    stat = ctypes.create_string_buffer(40)
    whole = ctypes.create_string_buffer(struct.pack("QQ", 0, 0))
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if _libc.syscall(_CACHESTAT, fd, whole, stat, 0) != 0:
                    return _mapped_dirty_pages(root)  # no cachestat(2): before Linux 6.5
                _, dirty, writeback = struct.unpack_from("QQQ", stat.raw)
                if dirty or writeback:
                    out[path] = dirty + writeback
            finally:
                os.close(fd)
    return out


def _mapped_dirty_pages(root: Path) -> dict[str, int]:
    """Dirty pages of the files under `root` this process maps (its mappings only)."""
    out: dict[str, int] = {}
    path = None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s+(.*)$", line)
            if head:
                path = head.group(1).strip() or None
            elif path and path.startswith(f"{root}/") and line.startswith(
                    ("Shared_Dirty:", "Private_Dirty:")):
                out[path] = out.get(path, 0) + int(line.split()[1]) // 4
    return {p: n for p, n in out.items() if n}


class Points:
    """Runs acknowledged operations between markers and measures the page cache after each."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirty: dict[str, dict[str, int]] = {}

    def __call__(self, label: str, op: Callable[[], Any]) -> Any:
        os.write(2, f"EMBSTORE-MARK-A {label}\n".encode())
        out = op()
        self.dirty[label] = dirty_pages(self.root)
        os.write(2, f"EMBSTORE-MARK-B {label}\n".encode())
        return out


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def _open(path: Path, backend: str) -> Any:
    spec = embstore.TableSpec("t", dim=DIM, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))
    bottom = embstore.TierSpec("pmem" if backend == "pmem-mmap" else backend)
    tiers = [bottom] if backend == "dram" else [embstore.TierSpec("dram", capacity=50), bottom]
    return embstore.open(path, tables=[spec], tiers=tiers)


def _fill(store: Any, seed: int, n: int = 200, rounds: int = 3) -> None:
    rng = np.random.default_rng(seed)
    for i in range(rounds):
        ids = rng.integers(0, 500, n)
        store.update("t", ids, _rows(n, seed + i))
        store.apply_gradients("t", ids, np.ones((n, DIM), np.float32))


def flush(root: Path, backend: str, point: Points) -> None:
    """Flushes: the first of a new store, after deletes, of new rows only (pmem: it grows),
    after the delete journal made the record's directory, and the first after a reopen that
    made the written-id records.
    """
    store = _open(root / "stores" / "s", backend)  # "stores" is new: open makes it
    _fill(store, 0)
    point("flush", store.flush)
    store.delete("t", np.arange(0, 500, 25))  # the written-id record's delete journal
    store.update("t", np.arange(500, 520), _rows(20, 1))  # new rows: the record grows
    point("flush-deletes", store.flush)
    new = np.arange(1000, 21000)  # none flushed before: nothing to retire; pmem must grow
    store.update("t", new, np.ones((len(new), DIM), np.float32))
    point("flush-new-rows", store.flush)
    shutil.rmtree(root / "stores" / "s" / "written")  # the journal must make its directory
    store.delete("t", np.arange(1000, 1010))
    point("journal-new-dir", store.flush)
    store.close()  # reopened as a store from before written-id records: open makes them
    doc = layout.read_manifest(root / "stores" / "s")
    doc.pop("written_records")
    layout.write_manifest(root / "stores" / "s", doc)
    shutil.rmtree(root / "stores" / "s" / "written")
    store = _open(root / "stores" / "s", backend)
    store.update("t", np.arange(30000, 30010), _rows(10, 7))
    point("flush-reopened", store.flush)


def bulk(root: Path, backend: str, point: Points) -> None:
    """bulk_load into a new store (RocksDB: SST ingestion), durable when it returns."""
    store = _open(root / "stores" / "b", backend)
    ids = np.arange(5000, dtype=np.int64)
    point("bulk-load", lambda: store.bulk_load("t", ids, _rows(len(ids), 2)))
    store.close()  # reopened with two new tables: their tier opens them together
    spec = embstore.TableSpec("t", dim=DIM, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))
    more = [embstore.TableSpec(n, dim=DIM) for n in ("u", "v")]
    store = embstore.open(root / "stores" / "b", tables=[spec, *more])
    point("bulk-load-new-tables", lambda: store.bulk_load("u", ids, _rows(len(ids), 3)))


def checkpoint(root: Path, backend: str, point: Points) -> None:
    """A full and an incremental checkpoint, and a restore of each (into new directories)."""
    store = _open(root / "stores" / "c", backend)
    _fill(store, 3)
    full, incr = root / "ckpt" / "a" / "full", root / "ckpt" / "a" / "incr"
    point("checkpoint", lambda: store.checkpoint(full, step=1))
    _fill(store, 4, rounds=1)
    store.delete("t", np.arange(0, 100, 7))
    point("checkpoint-incr", lambda: store.checkpoint(incr, step=2, incremental=True))
    point("restore", lambda: embstore.restore(full, root / "restored" / "x" / "full"))
    point("restore-incr", lambda: embstore.restore(incr, root / "restored" / "x" / "incr"))


def rebuild(root: Path, backend: str, point: Points, *, renames: bool = False) -> None:
    """compact, migrate and fsck --repair: a store rewritten beside itself and swapped in."""
    path = root / "stores" / "r"
    store = _open(path, backend)
    _fill(store, 5)
    store.close()
    if renames:  # as where renameat2 cannot exchange, after a crash between the two renames
        _rebuild._exchange = lambda a, b: False
        os.replace(path, path.parent / f".{path.name}.swap-old")
    from embstore.tools import cli

    point("compact", lambda: _ok(cli.main(["compact", str(path)]), 0))
    assert not (path.parent / f".{path.name}.swap-old").exists()
    chain = "dram:64:lru," + ("pmem" if backend == "pmem-mmap" else backend)
    point("migrate", lambda: _ok(cli.main(["migrate", str(path), "--tiers", chain]), 0))
    if backend.startswith("pmem"):  # fsck --repair: a damaged row, the old store kept
        _damage_a_pmem_row(path)
        point("fsck-repair", lambda: _ok(cli.main(["fsck", "--repair", str(path)]), 1))
        assert any(path.parent.glob(f".{path.name}.fsck-backup-*"))


def _ok(code: int, expected: int) -> None:
    if code != expected:
        raise SystemExit(f"the command exited {code}, not {expected}")


def _damage_a_pmem_row(path: Path) -> None:
    from embstore.backends import _pmem_format as fmt

    file = next(path.rglob("t.pmem"))
    rec = fmt.record_size((DIM + 1) * 4)
    data = file.read_bytes()
    for slot in range((len(data) - fmt.DATA_OFFSET) // rec):
        at = fmt.DATA_OFFSET + slot * rec + fmt.REC_PAYLOAD
        if struct.unpack_from("<Q", data, at - fmt.REC_PAYLOAD + fmt.REC_SEQ)[0]:
            fd = os.open(file, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes([data[at] ^ 0xFF]), at)
                os.fsync(fd)  # the damage is the test's: nothing of it left for the check
            finally:
                os.close(fd)
            return
    raise AssertionError(f"no record in {file}")


def export(root: Path, backend: str, point: Points) -> None:
    """export, then import into a new store (both into directories not made yet)."""
    path = root / "stores" / "e"
    store = _open(path, backend)
    _fill(store, 6)
    store.close()
    out = root / "exports" / "z" / "out"
    point("export", lambda: _export.export_store(path, out))
    point("import", lambda: _export.import_store(out, root / "imports" / "z" / "new"))


def demo(root: Path, backend: str, point: Points) -> None:
    """The demo's dense-model file, saved atomically."""
    import torch

    from embstore.tools import demo as demo_cli

    (root / "run").mkdir()  # the directory is the caller's, the file the demo's
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    point("demo-save", lambda: demo_cli._save_dense(root / "run" / "dense.pt",
                                                     {"w": torch.ones(4)}))


def access(root: Path, backend: str, point: Points) -> None:
    """A store recording an access log (in directories not made yet): flush and close."""
    spec = embstore.TableSpec("t", dim=DIM, optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))
    tiers = [embstore.TierSpec("dram", capacity=50), embstore.TierSpec(backend)]
    store = embstore.open(root / "stores" / "s", tables=[spec], tiers=tiers,
                          record_accesses=root / "logs" / "a")
    rng = np.random.default_rng(3)
    for _ in range(3):
        ids = rng.integers(0, 500, 200)
        store.lookup("t", ids)
        store.apply_gradients("t", ids, np.ones((200, DIM), np.float32))
    point("access-flush", store.flush)
    store.lookup("t", rng.integers(0, 500, 200))
    point("access-close", store.close)


WORKLOADS: dict[str, Callable[[Path, str, Points], None]] = {
    "flush": flush, "bulk": bulk, "checkpoint": checkpoint, "rebuild": rebuild,
    "rebuild-renames": lambda r, b, p: rebuild(r, b, p, renames=True),
    "export": export, "demo": demo, "access": access}


def main() -> None:
    workload, backend, root, report = sys.argv[1:5]
    if backend == "pmem-mmap":
        os.environ["EMBSTORE_PMEM_FORCE_MMAP"] = "1"
    if os.environ.get("DROP_SYNC"):
        _syncsites.remove(os.environ["DROP_SYNC"])
    point = Points(Path(root))  # ROOT exists: the test made it
    WORKLOADS[workload](Path(root), backend, point)
    Path(report).write_text(json.dumps(point.dirty))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
