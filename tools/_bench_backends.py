"""Batched reads and writes of each persistent backend against its raw library, same run.

For every registered backend with a raw baseline (rocksdb: rocksdict; lmdb: the lmdb package;
pmem: a numpy memmap), the table is loaded into the backend and, separately, into the raw
library opened with the same options. Reads are batches of Zipf ids (duplicates included),
through the writing handle and through a read-only one, writes the distinct ids of such
batches. The raw side runs every way its library offers to do
the same work (e.g. multi-get and a per-key get loop, with and without first removing
duplicate ids) and the fastest one is the baseline, timed again head to head with the backend;
the backend also verifies and writes its per-row checksums. Contenders run interleaved, each on
its own batches, and the median batch time counts. Last, a flush of
1,000 scattered dirty rows reports the bytes written: those the block device under the table
counted (sectors written, whole system), and the process's own /proc/self/io accounting.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from embstore import registry
from embstore.backend import Backend, BackendSpec
from embstore.backends._keys import encode_keys
from embstore.errors import BackendUnavailableError
from embstore.tools.workload import ZipfIds

from ._args import bench_size, one_of, quick_sizes, work_dir
from ._benchutil import add_size_arguments, interleaved_medians

__all__ = ["add_arguments", "run"]

LOAD_BATCH = 65536
FLUSH_TRIALS = 3  # measured flushes per backend; the least bytes count
Fetch = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (ids, ranks) -> rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `embstore bench backends`."""
    add_size_arguments(parser, rows=2_000_000, repeats=5)
    parser.add_argument("--dir", type=work_dir, default=None,
                        help="where to build the tables, made if missing (default: a "
                             "temporary directory)")
    parser.add_argument("--backends", nargs="*", type=_backend_name, default=None,
                        help="backends to run (default: every persistent one with a baseline)")
    parser.add_argument("--flush-rows", type=bench_size, default=1000,
                        help="scattered dirty rows per measured flush (1000)")
    quick_sizes(parser, repeats=3)


# a misspelt backend would only be skipped, silently
_backend_name = one_of(registry.backend_names, "backend")


def _rows(args: argparse.Namespace, start: int, n: int) -> np.ndarray:
    """The rows of ranks [start, start + n): a pure function of the seed and the position."""
    return np.random.default_rng([args.seed, start]).standard_normal((n, args.dim),
                                                                     dtype=np.float32)


def _row_of(args: argparse.Namespace, rank: int) -> np.ndarray:
    """The loaded row of one rank (rows are generated LOAD_BATCH at a time)."""
    start = rank - rank % LOAD_BATCH
    return _rows(args, start, min(LOAD_BATCH, args.rows - start))[rank - start]


def _io_counters() -> dict[str, int] | None:
    """This process's /proc/self/io counters (write_bytes, wchar, ...), or None off Linux."""
    try:
        with open("/proc/self/io") as fh:
            return {k: int(v) for k, v in (line.split(":") for line in fh)}
    except OSError:
        return None


def _device_stat(path: Path) -> Path | None:
    """The /sys stat file of the block device (or partition) holding `path`, if it has one."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def _sectors_written(stat: Path | None) -> int | None:
    """Bytes the device has written since boot (field 7 of its stat file: 512-byte sectors)."""
    if stat is None:
        return None
    try:
        return int(stat.read_text().split()[6]) * 512
    except (OSError, IndexError, ValueError):
        return None


# --- raw baselines ------------------------------------------------------------------------


@runtime_checkable
class _Compactable(Protocol):
    def compact(self) -> None: ...


class _Raw:
    """The raw library holding the same rows: ways to read a batch, one way to write one."""

    readers: dict[str, Fetch]
    write_way = "one write batch"

    def compact(self) -> None:
        """Bring the store to a steady state after loading (no background work pending)."""

    def write(self, ids: np.ndarray, ranks: np.ndarray, rows: np.ndarray) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """Make every write so far durable, the library's own way (what `flush` is to us)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _assemble(values: list[Any], dim: int) -> np.ndarray:
    """The rows of raw values that are each a row's bytes (what any raw reader must produce)."""
    return np.frombuffer(b"".join(values), dtype=np.float32).reshape(len(values), dim)


def _distinct(fetch_keys: Callable[[list[bytes]], list[Any]], dim: int) -> Fetch:
    def fetch(ids: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        uniq, inverse = np.unique(ids, return_inverse=True)
        return _assemble(fetch_keys(encode_keys(uniq)), dim)[inverse]
    return fetch


def _every(fetch_keys: Callable[[list[bytes]], list[Any]], dim: int) -> Fetch:
    def fetch(ids: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        return _assemble(fetch_keys(encode_keys(ids)), dim)
    return fetch


class _RawRocksDB(_Raw):
    """rocksdict with the rocksdb backend's default options, one column family."""

    def __init__(self, path: Path, dim: int) -> None:
        import rocksdict

        self._r = rocksdict
        # The rocksdb backend's defaults: no compression, 10-bit bloom filters, 128 MiB block
        # cache, 64 MiB row cache, 64 MiB memtables, 4 KiB blocks, 2 background jobs.
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_compression_type(rocksdict.DBCompressionType.none())
        opts.set_write_buffer_size(64 << 20)
        opts.set_max_background_jobs(2)
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(rocksdict.Cache(128 << 20))
        table.set_block_size(4096)
        table.set_bloom_filter(10, False)
        opts.set_block_based_table_factory(table)
        opts.set_row_cache(rocksdict.Cache(64 << 20))
        self._db = rocksdict.Rdict(str(path), opts)
        self._cf = self._db.create_column_family("raw", opts)
        self._handle = self._db.get_column_family_handle("raw")
        cf = self._cf

        def multi_get(keys: list[bytes]) -> list[Any]:
            return cf[keys]  # type: ignore[no-any-return]

        def get_loop(keys: list[bytes]) -> list[Any]:
            get = cf.get
            return [get(k) for k in keys]

        self.readers = {"multi-get": _every(multi_get, dim),
                        "get loop": _every(get_loop, dim),
                        "multi-get, distinct ids": _distinct(multi_get, dim),
                        "get loop, distinct ids": _distinct(get_loop, dim)}

    def write(self, ids: np.ndarray, ranks: np.ndarray, rows: np.ndarray) -> None:
        batch = self._r.WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._handle)
        put = batch.put
        for key, value in zip(encode_keys(ids), rows.view(f"V{rows.shape[1] * 4}").ravel()
                              .tolist(), strict=True):
            put(key, value)
        self._db.write(batch)

    def compact(self) -> None:
        # docstring inherited
        self._cf.compact_range(None, None)

    def sync(self) -> None:
        # docstring inherited
        self._db.flush_wal(True)

    def close(self) -> None:
        self._cf.close()
        del self._cf, self._handle
        self.readers = {}
        self._db.close()


class _RawLMDB(_Raw):
    """The lmdb package with the lmdb backend's default options, one named database."""

    write_way = "putmulti, one transaction"

    def __init__(self, path: Path, dim: int) -> None:
        import lmdb

        path.mkdir(parents=True, exist_ok=True)
        # The lmdb backend's defaults: sync data pages per commit, not the meta page; no
        # readahead; 0600 files. The map starts large enough never to grow.
        self._env = lmdb.open(str(path), map_size=1 << 40, sync=True, metasync=False,
                              max_dbs=2, readahead=False, mode=0o600)
        self._db = self._env.open_db(b"raw")
        env, db = self._env, self._db

        def get_loop(keys: list[bytes]) -> list[Any]:
            # Values as bytes: copying each once beat joining buffers into the map.
            with env.begin() as txn:
                get = txn.get
                return [get(k, db=db) for k in keys]

        def getmulti(keys: list[bytes]) -> list[Any]:
            with env.begin() as txn:
                return [v for _, v in txn.cursor(db=db).getmulti(keys)]

        self.readers = {"get loop, one txn": _every(get_loop, dim),
                        "getmulti": _every(getmulti, dim),
                        "get loop, one txn, distinct ids": _distinct(get_loop, dim),
                        "getmulti, distinct ids": _distinct(getmulti, dim)}

    def write(self, ids: np.ndarray, ranks: np.ndarray, rows: np.ndarray) -> None:
        items = list(zip(encode_keys(ids), rows.view(f"V{rows.shape[1] * 4}").ravel().tolist(),
                         strict=True))
        with self._env.begin(write=True) as txn:
            txn.cursor(db=self._db).putmulti(items)

    def sync(self) -> None:
        # docstring inherited
        self._env.sync(True)

    def close(self) -> None:
        self._env.close()


class _RawMemmap(_Raw):
    """A numpy memmap of the dense table, row i at rank i: the floor for a mapped file."""

    write_way = "memmap scatter (no msync)"

    def __init__(self, path: Path, rows: int, dim: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._mm = np.memmap(path / "rows.f32", dtype=np.float32, mode="w+", shape=(rows, dim))
        mm = self._mm
        self.readers = {"memmap gather": lambda ids, ranks: mm[ranks]}

    def write(self, ids: np.ndarray, ranks: np.ndarray, rows: np.ndarray) -> None:
        self._mm[ranks] = rows

    def sync(self) -> None:
        # docstring inherited; msync of the mapping (in place: no crash safety for a row)
        self._mm.flush()

    def close(self) -> None:
        self._mm.flush()
        del self._mm
        self.readers = {}


RAW: dict[str, Callable[[Path, argparse.Namespace], _Raw]] = {
    "rocksdb": lambda path, args: _RawRocksDB(path, args.dim),
    "lmdb": lambda path, args: _RawLMDB(path, args.dim),
    "pmem": lambda path, args: _RawMemmap(path, args.rows, args.dim),
}


# --- the run ------------------------------------------------------------------------------


def _open_backend(name: str, path: Path, args: argparse.Namespace, *,
                  read_only: bool = False) -> Backend:
    cls = registry.load_backend(name)
    capacity = 2 * args.rows * (args.dim * 4 + 64)
    return cls.open(BackendSpec(path=path, dim=args.dim, table="bench", capacity_bytes=capacity,
                                read_only=read_only))  # type: ignore[no-any-return]


def _load(backend: Backend, raw: _Raw, zipf: ZipfIds, args: argparse.Namespace) -> float:
    t0 = time.perf_counter()
    for start in range(0, args.rows, LOAD_BATCH):
        n = min(LOAD_BATCH, args.rows - start)
        ranks = np.arange(start, start + n, dtype=np.int64)
        rows = _rows(args, start, n)
        backend.put(zipf.ids[ranks], rows)
        raw.write(zipf.ids[ranks], ranks, rows)
    # Both sides start from a durable table, as one opened from disk does: a mapped file
    # left dirty by its load would take the measured writes without a single write fault.
    backend.flush()
    raw.sync()
    # Compaction left running in the background would slow whichever side it hits.
    if isinstance(backend, _Compactable):
        backend.compact()
    raw.compact()
    return time.perf_counter() - t0


def _bench_one(name: str, root: Path, zipf: ZipfIds,
               args: argparse.Namespace) -> list[tuple[str, str, float, float, str]]:
    """Time one backend against its raw baseline; rows of (backend, op, rate, raw rate, way)."""
    backend = _open_backend(name, root / name, args)
    raw = RAW[name](root / f"{name}-raw", args)
    try:
        took = _load(backend, raw, zipf, args)
        print(f"{name}: loaded {args.rows:,} rows x {args.dim} into the backend and the raw "
              f"library in {took:.1f} s")
        rng = np.random.default_rng(args.seed + 1)
        # Each contender reads its own batches (same law): a batch read by one would be in the
        # caches for the next, and the raw ways share one database.
        read_ranks = {c: [zipf.ranks(args.batch) for _ in range(args.repeats)]
                      for c in ("backend", *raw.readers)}
        read_ids = {c: [zipf.ids[r] for r in ranks] for c, ranks in read_ranks.items()}
        write_ranks = [np.unique(zipf.ranks(args.batch)) for _ in range(args.repeats)]
        write_rows = [rng.standard_normal((len(r), args.dim), dtype=np.float32)
                      for r in write_ranks]
        for c, ranks in read_ranks.items():
            expected = np.stack([_row_of(args, int(r)) for r in ranks[0][:64]])
            if c == "backend":
                got = backend.get(read_ids[c][0])[0][:64]
            else:
                got = raw.readers[c](read_ids[c][0], ranks[0])[:64]
            if not np.array_equal(got, expected):
                raise RuntimeError(f"{name} {c} returned other rows than were loaded")

        readers: dict[str, Callable[[int], None]] = {
            "backend": lambda i: backend.get(read_ids["backend"][i])[0]}
        for way, fetch in raw.readers.items():
            readers[way] = (lambda w, f: lambda i: f(read_ids[w][i], read_ranks[w][i]))(way,
                                                                                        fetch)
        med = interleaved_medians(readers, args.repeats)
        best = min(raw.readers, key=lambda w: med[w])
        print(f"{name}: read rows/s, every way: " + ", ".join(f"{w} {args.batch / t:,.0f}"
                                                              for w, t in med.items()))
        # Head to head with the fastest raw way on fresh batches: in the round above the raw
        # ways run back to back on one database and warm the CPU caches for each other.
        for c in ("backend", best):
            read_ranks[c] = [zipf.ranks(args.batch) for _ in range(args.repeats)]
            read_ids[c] = [zipf.ids[r] for r in read_ranks[c]]
        med = interleaved_medians({"backend": readers["backend"], best: readers[best]},
                                  args.repeats)
        out = [(name, "read", args.batch / med["backend"], args.batch / med[best], best)]

        # A read-only handle, as a reader beside a writer opens one (in this process it
        # shares the writer's database where the library allows only one per process;
        # a pmem reader maps the file itself and checks each record in a copy of it)
        backend.flush()
        with _open_backend(name, root / name, args, read_only=True) as reader:
            for c in ("backend", best):
                read_ranks[c] = [zipf.ranks(args.batch) for _ in range(args.repeats)]
                read_ids[c] = [zipf.ids[r] for r in read_ranks[c]]
            med = interleaved_medians(
                {"backend": lambda i: reader.get(read_ids["backend"][i])[0],
                 best: readers[best]}, args.repeats)
        out.append((name, "read (read-only handle)", args.batch / med["backend"],
                    args.batch / med[best], best))

        def put(i: int) -> None:
            backend.put(zipf.ids[write_ranks[i]], write_rows[i])

        def raw_write(i: int) -> None:
            raw.write(zipf.ids[write_ranks[i]], write_ranks[i], write_rows[i])

        med = interleaved_medians({"backend": put, "raw": raw_write}, args.repeats)
        mean_rows = float(np.mean([len(r) for r in write_ranks]))
        out.append((name, f"write ({mean_rows:,.0f} distinct ids)", mean_rows / med["backend"],
                    mean_rows / med["raw"], raw.write_way))

        # The same batches made durable after each: a write that a crash may lose is only
        # half the work of a persistent medium (for a mapped file, the write faults of pages
        # that the flush cleaned are part of it)
        def put_flush(i: int) -> None:
            put(i)
            backend.flush()

        def raw_write_sync(i: int) -> None:
            raw_write(i)
            raw.sync()

        med = interleaved_medians({"backend": put_flush, "raw": raw_write_sync}, args.repeats)
        out.append((name, "durable write (+ flush)", mean_rows / med["backend"],
                    mean_rows / med["raw"], f"{raw.write_way.split(' (')[0]} + its sync"))

        per_row = _flush_bytes(backend, zipf, args)
        shown = [f"{per_row[k]:,.0f} bytes/row {label}" for k, label in
                 (("device", "by the device's sectors written (whole system)"),
                  ("write_bytes", "by write_bytes"), ("wchar", "handed to write calls (wchar)"))
                 if per_row.get(k) is not None]
        print(f"{name}: flush of {args.flush_rows:,} scattered dirty rows wrote "
              + ("; ".join(shown) if shown else "n/a (no /proc/self/io, no block device)"))
        return out
    finally:
        backend.close()
        raw.close()


def _flush_bytes(backend: Backend, zipf: ZipfIds,
                 args: argparse.Namespace) -> dict[str, float | None]:
    """Bytes written per row by writing and flushing `flush_rows` scattered rows.

    device: sectors the block device under the table wrote meanwhile, whatever wrote them
    (journal commits included; other processes' too, hence the least of FLUSH_TRIALS).
    write_bytes: what the kernel accounts to this process as sent to storage; it counts a
    whole page-cache folio when a write dirties part of one, so on kernels with large folios
    it can exceed what reaches the device. wchar: the bytes handed to write calls (stores
    through a memory map do not count there).
    """
    n = min(args.flush_rows, args.rows)
    stat = _device_stat(Path(backend.spec.path or "."))
    seen: dict[str, list[float]] = {"device": [], "write_bytes": [], "wchar": []}
    for trial in range(FLUSH_TRIALS):
        rng = np.random.default_rng([args.seed, 2, trial])
        ranks = rng.choice(args.rows, size=n, replace=False)
        rows = rng.standard_normal((n, args.dim), dtype=np.float32)
        backend.flush()
        os.sync()  # earlier dirty pages go now, not inside the measured window
        before, dev_before = _io_counters(), _sectors_written(stat)
        backend.put(zipf.ids[ranks], rows)
        backend.flush()
        after, dev_after = _io_counters(), _sectors_written(stat)
        if dev_before is not None and dev_after is not None:
            seen["device"].append((dev_after - dev_before) / n)
        if before is not None and after is not None:
            for k in ("write_bytes", "wchar"):
                seen[k].append((after[k] - before[k]) / n)
    # the least of the trials: other writers on the machine only ever add to a count
    return {k: min(v) if v else None for k, v in seen.items()}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the table of rows/s and backend/raw ratios."""
    names = args.backends
    if names is None:
        names = [n for n in registry.backend_names() if n in RAW]
    zipf = ZipfIds(args.rows, args.zipf, seed=args.seed)
    results: list[tuple[str, str, float, float, str]] = []
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="embstore-bench-", dir=args.dir))
    try:
        for name in names:
            if name not in RAW:
                print(f"{name}: skipped: no raw baseline for this backend")
                continue
            try:
                cls = registry.load_backend(name)
            except BackendUnavailableError as exc:
                print(f"{name}: skipped: {exc}")
                continue
            if not cls.supports_persistence:
                print(f"{name}: skipped: not a persistent backend")
                continue
            results.extend(_bench_one(name, root, zipf, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.batch:,} Zipf({args.zipf}) ids per read batch, {args.rows:,} rows x "
          f"{args.dim} float32; median of {args.repeats} interleaved batches")
    print(f"  {'backend':<9}{'op':<28}{'backend rows/s':>15}{'raw rows/s':>13}{'ratio':>8}"
          "  raw way (fastest)")
    for name, op, rate, raw_rate, way in results:
        print(f"  {name:<9}{op:<28}{rate:>15,.0f}{raw_rate:>13,.0f}{rate / raw_rate:>7.2f}x"
              f"  {way}")
    return 0
