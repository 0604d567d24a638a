"""What the backends sharing one handle per tier directory (rocksdb, lmdb) have in common:
each table's spec is checked on reopen, read-only opens find only existing tables, and a
writer cannot join a directory opened read-only in the same process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embstore import registry
from embstore.backend import Backend, BackendSpec
from embstore.errors import ConfigError, StoreLockedError, StoreNotFoundError

DIM = 8


@pytest.fixture(params=["lmdb", "rocksdb"])
def open_backend(request):
    cls = registry.load_backend(request.param)

    def _open(path: Path, table: str = "t", *, dim: int = DIM,
              read_only: bool = False) -> Backend:
        return cls.open(BackendSpec(path=path, dim=dim, table=table, read_only=read_only))

    return _open


def test_reopening_a_table_with_another_dim_raises_config_error(open_backend, tmp_path):
    with open_backend(tmp_path / "tier") as b:
        b.put(np.arange(3, dtype=np.int64), np.ones((3, DIM), np.float32))
    with pytest.raises(ConfigError, match="dim 8"):
        open_backend(tmp_path / "tier", dim=DIM * 2)


def test_read_only_open_of_a_missing_table_raises_not_found(open_backend, tmp_path):
    with pytest.raises(StoreNotFoundError):
        open_backend(tmp_path / "none", read_only=True)
    open_backend(tmp_path / "tier", table="a").close()
    with pytest.raises(StoreNotFoundError, match="'b'"):
        open_backend(tmp_path / "tier", table="b", read_only=True)


def test_a_writer_cannot_join_a_read_only_directory(open_backend, tmp_path):
    open_backend(tmp_path / "tier", table="a").close()
    with open_backend(tmp_path / "tier", table="a", read_only=True), \
            pytest.raises(StoreLockedError, match="read-only"):
        open_backend(tmp_path / "tier", table="b")
