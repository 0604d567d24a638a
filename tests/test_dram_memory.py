"""The DRAM tier where memory is short: wide rows, caches larger than their rows, no memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.errors import CapacityError
from embstore.index import RowSlabs


def test_wide_rows_take_chunks_of_fewer_rows() -> None:
    assert RowSlabs(64, np.dtype(np.float32)).shift == 16  # 256-byte rows: 16 MiB chunks
    assert RowSlabs(1024, np.dtype(np.float32)).shift == 16  # 4 KiB rows: 256 MiB
    assert RowSlabs(1 << 18, np.dtype(np.float32)).shift == 8  # 1 MiB rows: 256 of them
    assert RowSlabs(1 << 27, np.dtype(np.float32)).shift == 0  # 512 MiB: one a chunk
    assert RowSlabs(64, np.dtype(np.float32), shift=4).shift == 4  # a smaller shift stays


def test_a_table_of_one_mebibyte_rows_stores_and_reads_them(tmp_path: Path) -> None:
    # 2**16 rows a chunk asked for 64 GiB at the first row: a raw numpy MemoryError, with
    # the ids left in the index, and the next lookup read past the chunks (a segfault)
    dim = 1 << 18
    rows = np.arange(2 * dim, dtype=np.float32).reshape(2, dim)
    with embstore.open(tmp_path / "s", tables=[embstore.TableSpec("t", dim=dim)]) as store:
        store.update("t", np.array([1, 2]), rows)
        np.testing.assert_array_equal(store.lookup("t", np.array([2, 1])), rows[::-1])
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store.lookup("t", np.array([1, 2])), rows)


def test_a_cache_far_larger_than_memory_takes_room_as_its_rows_come(tmp_path: Path) -> None:
    # its index made room for 4 x 2**31 ids at the first batch past 1,024 rows (110 GB)
    tiers = [embstore.TierSpec("dram", capacity=2**31), embstore.TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=[embstore.TableSpec("t", dim=4)],
                       tiers=tiers) as store:
        ids = np.arange(3000, dtype=np.int64)
        rows = np.random.default_rng(0).standard_normal((3000, 4), dtype=np.float32)
        store.update("t", ids, rows)
        np.testing.assert_array_equal(store.lookup("t", ids), rows)
        held = store.tier_statistics("t")[0].bytes  # rows and index: 1 MiB of rows a chunk
        assert held < 4 << 20, held


_NO_MEMORY = textwrap.dedent("""
    import resource
    import numpy as np
    import embstore
    from embstore.errors import CapacityError

    dim = 1 << 22  # 16 MiB rows, 16 a chunk
    store = embstore.open(None, tables=[embstore.TableSpec("t", dim=dim)])
    first = np.full((1, dim), 3.0, np.float32)
    store.update("t", np.array([0]), first)
    more = np.ones((16, dim), np.float32)  # made before the limit: 256 MiB
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    room = pages * resource.getpagesize() + (96 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (room, room))
    for attempt in range(2):  # the second finds the index as the first left it
        try:
            store.update("t", np.arange(1, 17), more)
        except CapacityError as exc:
            print("CapacityError", "cannot allocate" in str(exc))
    print("rows", store.num_rows("t"))
    print("first", bool(np.array_equal(store.lookup("t", np.array([0])), first)))
    store.update("t", np.arange(1, 16), more[:15])  # fits in the first chunk
    print("fits", store.num_rows("t"))
""")


def test_rows_memory_cannot_hold_are_a_capacity_error_and_change_nothing() -> None:
    # a real shortage, by an address-space limit in a child process: the new chunk of 256 MiB
    # cannot be had, while the rows already stored and a 16 MiB lookup can
    done = subprocess.run([sys.executable, "-c", _NO_MEMORY], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n") == ["CapacityError True", "CapacityError True", "rows 1",
                                       "first True", "fits 16", ""]


def test_capacity_error_is_what_a_failed_allocation_raises() -> None:
    slabs = RowSlabs(1 << 61, np.dtype(np.float32))  # a row of 2**63 bytes: past numpy's arrays
    with pytest.raises(CapacityError, match="cannot allocate"):
        slabs.ensure(1)
    with pytest.raises(CapacityError, match="more than a table's slots"):
        RowSlabs(64, np.dtype(np.float32)).ensure(1 << 40)
    assert slabs.nbytes() == 0


_PART_OF_THE_CHUNKS = textwrap.dedent("""
    import resource
    import numpy as np
    from embstore.errors import CapacityError
    from embstore.index import RowSlabs

    slabs = RowSlabs(1 << 22, np.dtype(np.float32))  # 256 MiB chunks of 16 rows
    slabs.ensure(16)
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    room = pages * resource.getpagesize() + (384 << 20)  # one more chunk, not two
    resource.setrlimit(resource.RLIMIT_AS, (room, room))
    try:
        slabs.ensure(48)
    except CapacityError:
        print("CapacityError", slabs.nbytes() // (256 << 20))
    slabs.ensure(32)
    print("then", slabs.nbytes() // (256 << 20))
""")


def test_a_growth_memory_allows_only_in_part_keeps_the_chunks_as_they_were() -> None:
    # the chunks it could make stayed, unaddressed by any slot
    done = subprocess.run([sys.executable, "-c", _PART_OF_THE_CHUNKS], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n") == ["CapacityError 1", "then 2", ""]
