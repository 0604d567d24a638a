"""Reads split over threads while they wait on the device (embstore._cold_reads, rocksdb)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import _cold_reads, _parallel
from embstore._cold_reads import MIN_ROWS_PER_CHUNK, ColdReads
from embstore._rebuild import read_store
from embstore.backend import BackendSpec
from embstore.backends.rocksdb import RocksDBBackend
from embstore.errors import ConfigError
from embstore.spec import TableSpec, TierSpec
from embstore.tools._bench_cold import drop_cached

splits = pytest.mark.skipif(_cold_reads._RUSAGE_THREAD is None,
                            reason="the OS keeps no per-thread block counts: never split")


class _Medium:
    """A `get` that records each call's keys and thread, and the blocks it 'fetched'."""

    def __init__(self, blocks_per_key: int, *, fail_at: bytes | None = None,
                 delay: float = 0.0) -> None:
        self.calls: list[tuple[list[bytes], str]] = []
        self.blocks_per_key = blocks_per_key
        self.fail_at = fail_at
        self.delay = delay
        self.running = 0
        self._lock = threading.Lock()
        self.blocks = threading.local()

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        with self._lock:
            self.calls.append((list(keys), threading.current_thread().name))
            self.running += 1
        try:
            time.sleep(self.delay)
            self.blocks.n = getattr(self.blocks, "n", 0) + self.blocks_per_key * len(keys)
            if self.fail_at is not None and self.fail_at in keys:
                raise OSError("the medium failed")
            return [None if k.endswith(b"7") else k + b"!" for k in keys]
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture
def medium_blocks(monkeypatch: pytest.MonkeyPatch):
    """Make `_blocks_fetched` count what a `_Medium` fetched on the calling thread."""
    media: list[_Medium] = []

    def fetched() -> int:
        return sum(getattr(m.blocks, "n", 0) for m in media)

    monkeypatch.setattr(_cold_reads, "_blocks_fetched", fetched)
    return media.append


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(8, "big") for i in range(n)]


def _expected(keys: list[bytes]) -> list[bytes | None]:
    return [None if k.endswith(b"7") else k + b"!" for k in keys]


@splits
def test_a_cold_read_splits_the_next_into_ordered_chunks_on_other_threads(medium_blocks):
    medium = _Medium(blocks_per_key=8, delay=0.05)
    medium_blocks(medium)
    reads = ColdReads(threads=4)
    keys = _keys(10 * MIN_ROWS_PER_CHUNK)
    assert reads.read(keys, medium.get) == _expected(keys)  # a table just opened: split
    assert len(medium.calls) == 4
    assert [k for chunk, _ in sorted(medium.calls) for k in chunk] == keys
    threads = {thread for _, thread in medium.calls}
    assert threading.current_thread().name in threads and len(threads) > 1
    assert reads.split_next  # it fetched 8 blocks a row


@splits
def test_a_warm_read_keeps_the_next_on_the_calling_thread(medium_blocks):
    medium = _Medium(blocks_per_key=0)
    medium_blocks(medium)
    reads = ColdReads(threads=16)
    keys = _keys(1000)
    reads.read(keys, medium.get)  # split (unknown yet), and fetched nothing
    assert not reads.split_next
    medium.calls.clear()
    assert reads.read(keys, medium.get) == _expected(keys)
    assert medium.calls == [(keys, threading.current_thread().name)]


def test_small_reads_and_one_thread_never_split(medium_blocks):
    medium = _Medium(blocks_per_key=64)
    medium_blocks(medium)
    small = _keys(2 * MIN_ROWS_PER_CHUNK - 1)
    assert ColdReads(threads=16).read(small, medium.get) == _expected(small)
    assert len(medium.calls) == 1
    medium.calls.clear()
    keys = _keys(1000)
    one = ColdReads(threads=1)
    for _ in range(2):
        assert one.read(keys, medium.get) == _expected(keys)
    assert len(medium.calls) == 2


@splits
def test_chunks_get_at_least_the_minimum_rows(medium_blocks):
    medium = _Medium(blocks_per_key=8)
    medium_blocks(medium)
    keys = _keys(3 * MIN_ROWS_PER_CHUNK + 5)
    ColdReads(threads=64).read(keys, medium.get)
    assert len(medium.calls) == 3
    assert min(len(chunk) for chunk, _ in medium.calls) >= MIN_ROWS_PER_CHUNK


@splits
@pytest.mark.parametrize("failing", [0, -1], ids=["caller's chunk", "a pool thread's chunk"])
def test_a_failed_chunk_is_raised_after_every_chunk_ended(medium_blocks, failing):
    keys = _keys(8 * MIN_ROWS_PER_CHUNK)
    medium = _Medium(blocks_per_key=8, fail_at=keys[failing], delay=0.05)
    medium_blocks(medium)
    with pytest.raises(OSError, match="the medium failed"):
        ColdReads(threads=8).read(keys, medium.get)
    assert medium.running == 0  # no chunk still reads after the call
    assert len(medium.calls) == 8


class _PoolOutOfThreads:
    """A pool that starts `room` threads' work, then cannot start another."""

    def __init__(self, room: int, real) -> None:
        self.room = room
        self.real = real

    def submit(self, fn, *args):
        if self.room == 0:
            raise RuntimeError("can't start new thread")
        self.room -= 1
        return self.real.submit(fn, *args)


@splits
def test_chunks_no_thread_could_take_are_read_on_the_calling_thread(
        medium_blocks, monkeypatch: pytest.MonkeyPatch):
    medium = _Medium(blocks_per_key=8, delay=0.02)
    medium_blocks(medium)
    pool = _PoolOutOfThreads(room=2, real=_cold_reads._executor())
    monkeypatch.setattr(_cold_reads, "_executor", lambda: pool)
    keys = _keys(8 * MIN_ROWS_PER_CHUNK)
    assert ColdReads(threads=8).read(keys, medium.get) == _expected(keys)
    mine = threading.current_thread().name
    assert sorted(len(chunk) for chunk, t in medium.calls if t != mine) == [16, 16]
    assert sum(len(chunk) for chunk, t in medium.calls if t == mine) == len(keys) - 32


@splits
def test_an_interrupt_while_waiting_lets_every_chunk_end_first(
        medium_blocks, monkeypatch: pytest.MonkeyPatch):
    medium = _Medium(blocks_per_key=8, delay=0.1)
    medium_blocks(medium)
    real_wait, interrupted = _parallel.wait, []

    def wait_interrupted_once(futures):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_wait(futures)

    monkeypatch.setattr(_parallel, "wait", wait_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        ColdReads(threads=4).read(_keys(4 * MIN_ROWS_PER_CHUNK), medium.get)
    assert interrupted and medium.running == 0
    assert len(medium.calls) == 4


def test_without_per_thread_block_counts_reads_never_split(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_cold_reads, "_RUSAGE_THREAD", None)
    medium = _Medium(blocks_per_key=64)
    keys = _keys(1000)
    reads = ColdReads(threads=16)
    for _ in range(2):
        assert reads.read(keys, medium.get) == _expected(keys)
    assert len(medium.calls) == 2


def _split_read_in_child(out: multiprocessing.Queue) -> None:
    medium = _Medium(blocks_per_key=8, delay=0.05)
    keys = _keys(4 * MIN_ROWS_PER_CHUNK)
    same = ColdReads(threads=4).read(keys, medium.get) == _expected(keys)
    out.put(same and len(medium.calls) == 4
            and len({thread for _, thread in medium.calls}) > 1)


@splits
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this OS")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_reads_split_on_threads_of_its_own():
    # the parent's pool exists; a child inherits the object but none of its threads
    ColdReads(threads=4).read(_keys(4 * MIN_ROWS_PER_CHUNK), _Medium(8).get)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_split_read_in_child, args=(out,))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        pytest.fail("a split read in a forked child hung")
    assert out.get(timeout=5) is True


# --- the rocksdb backend ------------------------------------------------------------------

_BAD_THREAD_COUNTS = [0, -1, 257, True, 1.5, "4", None, np.int64(4)]


@pytest.mark.parametrize("bad", _BAD_THREAD_COUNTS)
def test_cold_read_threads_must_be_a_thread_count(tmp_path: Path, bad):
    with pytest.raises(ConfigError, match="cold_read_threads"):
        RocksDBBackend.open(BackendSpec(path=tmp_path / "r", dim=4), cold_read_threads=bad)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


# a tier's options keep a numpy scalar as the Python number it is: np.int64(4) is 4 there
@pytest.mark.parametrize("bad", [b for b in _BAD_THREAD_COUNTS if not isinstance(b, np.generic)])
def test_a_store_refuses_a_bad_thread_count_and_can_be_made_right_after(tmp_path: Path, bad):
    path = tmp_path / "s"
    with pytest.raises(ConfigError, match="cold_read_threads|JSON"):
        _store_of(path, bad)
    assert not path.exists()
    with _store_of(path, 2) as store:  # nothing of the refused create holds the store
        store.update("t", np.arange(3), np.ones((3, 8), dtype=np.float32))


def test_a_numpy_thread_count_in_a_tiers_options_is_the_count_it_holds(tmp_path: Path):
    with _store_of(tmp_path / "s", np.int64(4)) as store:
        store.update("t", np.arange(3), np.ones((3, 8), dtype=np.float32))
    _, _, (tier,) = read_store(tmp_path / "s")  # as the manifest keeps it
    assert tier.options == {"cold_read_threads": 4}
    assert type(tier.options["cold_read_threads"]) is int


def _store_of(path: Path, threads: int) -> embstore.EmbeddingStore:
    return embstore.open(path, tables=[TableSpec("t", dim=8)],
                         tiers=[TierSpec("rocksdb", options={"cold_read_threads": threads})])


@splits
def test_split_reads_return_what_one_multi_get_returns(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch):
    ids = np.arange(0, 20_000, 3, dtype=np.int64)
    rows = np.random.default_rng(0).standard_normal((len(ids), 8)).astype(np.float32)
    for name in ("split", "whole"):
        with _store_of(tmp_path / name, 16 if name == "split" else 1) as store:
            store.bulk_load("t", ids, rows)
    gets: list[int] = []
    read = ColdReads.read

    def counted(self: ColdReads, keys: list[bytes], get):
        def one(chunk: list[bytes]):
            gets.append(len(chunk))
            return get(chunk)
        return read(self, keys, one)

    monkeypatch.setattr(ColdReads, "read", counted)
    asked = np.random.default_rng(1).integers(-5, 20_005, 3000)  # absent ids and repeats
    got = {}
    for name in ("split", "whole"):
        gets.clear()
        with embstore.open(tmp_path / name, read_only=True) as store:
            got[name] = [store.lookup("t", asked), store.lookup("t", asked[::-1])]
        # a table just opened counts as cold: its first read splits where it may
        assert (len(gets) > 2) == (name == "split")
    for a, b in zip(got["split"], got["whole"], strict=True):
        np.testing.assert_array_equal(a, b)
    stored = np.isin(asked, ids)
    np.testing.assert_array_equal(got["split"][0][stored],
                                  rows[np.searchsorted(ids, asked[stored])])


def test_the_option_reopens_with_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with _store_of(tmp_path / "s", 4) as store:
        store.update("t", np.arange(10), np.ones((10, 8), dtype=np.float32))
    made: list[int] = []
    real_init = ColdReads.__init__

    def recorded(self: ColdReads, threads: int) -> None:
        made.append(threads)
        real_init(self, threads)

    monkeypatch.setattr(ColdReads, "__init__", recorded)
    with embstore.open(tmp_path / "s") as store:
        assert store.lookup("t", np.arange(10)).sum() == 80
        assert store.describe()["tiers"][0]["options"] == {"cold_read_threads": 4}
    assert made == [4]


@splits
@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_reads_from_the_device_split_and_page_cache_reads_do_not(tmp_path: Path):
    backend_dir = tmp_path / "r"
    spec = BackendSpec(path=backend_dir, dim=64)
    ids = np.arange(200_000, dtype=np.int64)
    with RocksDBBackend.open(spec) as b:
        b.bulk_load(ids, np.ones((len(ids), 64), dtype=np.float32))
    drop_cached(backend_dir)
    asked = np.sort(np.random.default_rng(0).choice(ids, 500, replace=False))
    with RocksDBBackend.open(spec, cold_read_threads=8) as b:
        before = _cold_reads._blocks_fetched()
        b.get(asked[:1])  # one row, on this thread: did it come from a device?
        if _cold_reads._blocks_fetched() == before:
            pytest.skip(f"{tmp_path} is on no block device whose reads the kernel counts")
        b.get(asked)
        assert b._cold_reads.split_next  # the cold read fetched its rows' pages
        b.get(asked)  # cached now: split once more, and it fetched nothing
        assert not b._cold_reads.split_next
